"""vparallel_ce.integrations.transformers: what models and users do to the lm_head is honoured
exactly or refused, never skipped.

Honoured (loss and every gradient equal to HF's or PEFT's own forward with full logits, float64):
a PEFT LoRA adapter on the lm_head (applied before or after ``apply``, with or without other
LoRA targets, with a LoRA bias), FalconH1's ``lm_head_multiplier``, RecurrentGemma's
``logits_soft_cap``, a non-integer ``num_items_in_batch``, HF ``Trainer`` label smoothing through the
op's ``label_smoothing``. Refused with an error naming the cause: hooks on the lm_head, LoRA dropout
while training, a family whose forward changes the logits in a way no config field names, a head
module whose forward is replaced.
"""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tests.test_transformers import SMALL, V, _batch  # noqa: E402  the same tiny Llama and batch
from vparallel_ce.integrations import transformers as vt  # noqa: E402


def _llama(tied: bool = False, dtype=torch.float64):
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL, tie_word_embeddings=tied)).to(dtype)


def _assert_same_loss_and_grads(ref, ours, **kw):
    """``ours`` (applied) against ``ref`` (HF's or PEFT's own forward): the loss, and the gradient of
    every parameter that gets one -- the same set of parameters on both."""
    ids, labels = _batch()
    out_ref, out = ref(ids, labels=labels, **kw), ours(ids, labels=labels, **kw)
    assert out.logits is None and out_ref.logits is not None
    # HF upcasts the logits to float32 for its loss: the float64 models agree to float32 rounding
    torch.testing.assert_close(out.loss.double(), out_ref.loss.double(), rtol=1e-6, atol=1e-6)
    out_ref.loss.backward()
    out.loss.backward()
    g_ref = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    g = {n: p.grad for n, p in ours.named_parameters() if p.grad is not None}
    assert g.keys() == g_ref.keys() == {n for n, p in ref.named_parameters() if p.requires_grad}
    for name in g:
        scale = g_ref[name].abs().max().item() + 1e-12
        assert (g[name] - g_ref[name]).abs().max().item() <= 1e-5 * scale, name
    return g


# ---- PEFT LoRA on the lm_head ----------------------------------------------------------------------

def _lora(model, targets, **kw):
    peft = pytest.importorskip("peft")
    torch.manual_seed(3)   # init_lora_weights=False: B is random too, so the adapter changes the logits
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=kw.pop("lora_dropout", 0.0),
                             init_lora_weights=False, **kw)
    return peft.get_peft_model(model, config)


@pytest.mark.parametrize("targets,when,lora_bias", [
    (["q_proj", "v_proj", "lm_head"], "after", False),
    (["q_proj", "v_proj", "lm_head"], "before", False),
    (["lm_head"], "after", False),
    (["lm_head"], "before", True),
], ids=["attn+head-apply-after", "attn+head-apply-before", "head-only", "head-only-lora-bias-apply-before"])
def test_lora_lm_head_matches_peft(targets, when, lora_bias):
    ref = _lora(_llama(), targets, lora_bias=lora_bias)
    if when == "after":   # apply(peft_model): the causal LM inside gets the new forward
        ours = vt.apply(_lora(_llama(), targets, lora_bias=lora_bias))
    else:                 # get_peft_model(apply(model)): PEFT's forward calls the applied one
        ours = _lora(vt.apply(_llama()), targets, lora_bias=lora_bias)
    assert vt.is_applied(ours) and not vt.is_applied(ref)
    g = _assert_same_loss_and_grads(ref, ours)
    assert any("lm_head.lora_A" in n for n in g) and any("lm_head.lora_B" in n for n in g)
    # the adapter switched off, or merged into the weight (PEFT cannot merge a LoRA bias into a
    # head without one): PEFT's own head again
    for ctx in ("disabled",) if lora_bias else ("disabled", "merged"):
        ids, labels = _batch(2)
        if ctx == "disabled":
            with ref.disable_adapter(), ours.disable_adapter():
                a, b = ref(ids, labels=labels).loss, ours(ids, labels=labels).loss
        else:
            ref.base_model.model.lm_head.merge(), ours.base_model.model.lm_head.merge()
            a, b = ref(ids, labels=labels).loss, ours(ids, labels=labels).loss
        torch.testing.assert_close(b.double(), a.double(), rtol=1e-6, atol=1e-6, msg=ctx)


def test_lm_head_in_modules_to_save_matches_peft():
    # PEFT trains a copy of the lm_head: the loss uses the copy, and the original only with adapters off
    peft = pytest.importorskip("peft")
    ref = peft.get_peft_model(_llama(), peft.LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"]))
    with torch.no_grad():   # the trained copy differs from the original
        ref.base_model.model.lm_head.modules_to_save["default"].weight.mul_(1.5)
    ours = vt.apply(copy.deepcopy(ref))
    g = _assert_same_loss_and_grads(ref, ours)
    assert any("lm_head.modules_to_save.default.weight" in n for n in g)
    ids, labels = _batch(2)
    with ref.disable_adapter(), ours.disable_adapter():
        torch.testing.assert_close(ours(ids, labels=labels).loss.double(), ref(ids, labels=labels).loss.double(),
                                   rtol=1e-6, atol=1e-6)


def test_lora_dropout_refused_in_training_exact_in_eval():
    ref = _lora(_llama(), ["lm_head"], lora_dropout=0.1)
    ours = vt.apply(copy.deepcopy(ref))
    ids, labels = _batch()
    with pytest.raises(NotImplementedError, match="lora_dropout=0.1 and the model is training"):
        ours(ids, labels=labels)
    ref.eval(), ours.eval()   # dropout off: the LoRA head is one linear map again
    _assert_same_loss_and_grads(ref, ours)


# ---- hooks ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("when", ["before", "after"])
def test_hooks_on_the_lm_head_are_refused(when):
    model = _llama()
    ids, labels = _batch()
    hooks = {"forward hook": lambda m, a, out: out * 1.01, "forward pre hook": lambda m, a: (a[0] * 1.01,)}
    for kind, fn in hooks.items():
        if when == "after":
            vt.apply(model)
        register = model.lm_head.register_forward_hook if kind == "forward hook" \
            else model.lm_head.register_forward_pre_hook
        handle = register(fn)
        if when == "before":
            vt.apply(model)
        with pytest.raises(NotImplementedError, match=f"lm_head \\(Linear\\) has a {kind}"):
            model(ids, labels=labels)
        handle.remove()
        assert model(ids, labels=labels).logits is None   # no hook: runs
        vt.remove(model)


def test_global_module_hooks_are_refused():
    model = vt.apply(_llama())
    ids, labels = _batch()
    handle = torch.nn.modules.module.register_module_forward_hook(lambda m, a, out: None)
    try:
        with pytest.raises(NotImplementedError, match="global module hooks"):
            model(ids, labels=labels)
    finally:
        handle.remove()
    assert model(ids, labels=labels).logits is None


# ---- config fields that scale or cap the logits ---------------------------------------------------

def _falcon_h1():
    torch.manual_seed(0)
    return transformers.FalconH1ForCausalLM(transformers.FalconH1Config(
        **SMALL, mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8, mamba_d_state=8, mamba_n_groups=1,
        mamba_chunk_size=8, lm_head_multiplier=1.7)).to(torch.float64)


def _recurrent_gemma():
    torch.manual_seed(0)
    return transformers.RecurrentGemmaForCausalLM(transformers.RecurrentGemmaConfig(
        **SMALL, lru_width=32, attention_window_size=8, conv1d_width=2, logits_soft_cap=3.0,
        block_types=["recurrent", "attention"])).to(torch.float64)


@pytest.mark.parametrize("build", [_falcon_h1, _recurrent_gemma], ids=["falcon_h1-lm_head_multiplier",
                                                                       "recurrent_gemma-logits_soft_cap"])
def test_logit_multiplier_and_cap_match_hf(build):
    ref = build()
    _assert_same_loss_and_grads(ref, vt.apply(copy.deepcopy(ref)), num_items_in_batch=13)


class _TemperedLlama(transformers.LlamaForCausalLM):
    """A family whose forward changes the logits with nothing in its config to say so."""

    def forward(self, input_ids=None, labels=None, **kwargs):
        out = super().forward(input_ids, labels=labels, **kwargs)
        out.logits = out.logits / 2
        return out


def test_a_head_nobody_listed_is_refused_on_the_first_call():
    torch.manual_seed(0)
    model = vt.apply(_TemperedLlama(transformers.LlamaConfig(**SMALL)).to(torch.float64))
    ids, labels = _batch()
    with pytest.raises(NotImplementedError, match="_TemperedLlama's own forward gives logits that differ"):
        model(ids, labels=labels)
    # an lm_head module whose forward is replaced: checked again once the head is a new module
    model = vt.apply(_llama())
    assert model(ids, labels=labels).logits is None
    head = torch.nn.Linear(32, V, bias=False, dtype=torch.float64)
    head.forward = lambda x: torch.nn.functional.linear(x, head.weight) + 1.0
    model.lm_head = head
    with pytest.raises(NotImplementedError, match=r"with its lm_head \(Linear\) weight"):
        model(ids, labels=labels)


# ---- HF Trainer conventions -----------------------------------------------------------------------

def test_num_items_in_batch_not_an_integer_divides_the_sum():
    ref = _llama()
    _assert_same_loss_and_grads(ref, vt.apply(copy.deepcopy(ref)), num_items_in_batch=torch.tensor(2.5))
    ref = _llama()
    _assert_same_loss_and_grads(ref, vt.apply(copy.deepcopy(ref)), num_items_in_batch=7.5)


def test_label_smoothing_option_is_hf_trainers_label_smoother():
    # HF's Trainer with label_smoothing_factor=eps pops the labels and applies its LabelSmoother to the
    # full logits; apply(label_smoothing=eps) with the factor left at 0 is the same loss
    from transformers.trainer_pt_utils import LabelSmoother

    ref = _llama()
    ours = vt.apply(copy.deepcopy(ref), label_smoothing=0.1)
    ids, labels = _batch()
    loss_ref = LabelSmoother(epsilon=0.1)(ref(ids), labels, shift_labels=True, num_items_in_batch=torch.tensor(13))
    loss = ours(ids, labels=labels, num_items_in_batch=torch.tensor(13)).loss
    torch.testing.assert_close(loss.double(), loss_ref.double(), rtol=1e-6, atol=1e-6)
    loss_ref.backward()
    loss.backward()
    for (name, p), q in zip(ours.named_parameters(), ref.parameters()):
        assert (p.grad - q.grad).abs().max().item() <= 1e-5 * (q.grad.abs().max().item() + 1e-12), name


def test_trainer_with_label_smoothing_factor_warns(tmp_path):
    from transformers import Trainer, TrainingArguments

    ids, labels = _batch()
    data = [{"input_ids": i, "labels": t} for i, t in zip(ids, labels)]
    args = TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=3, max_steps=1, report_to=[], use_cpu=True,
        save_strategy="no", disable_tqdm=True, dataloader_num_workers=0, label_smoothing_factor=0.1)
    trainer = Trainer(model=vt.apply(_llama(dtype=torch.float32)), args=args, train_dataset=data)
    with pytest.warns(UserWarning, match="label_smoothing_factor > 0 .* pass label_smoothing="):
        trainer.train()
