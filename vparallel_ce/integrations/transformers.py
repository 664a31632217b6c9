"""Hugging Face ``transformers``: the causal-LM loss of a ``*ForCausalLM`` model by
:func:`vparallel_ce.linear_cross_entropy`, from the final hidden states and the lm_head weight.

``apply(model, **options)`` gives one model instance a new ``forward``; nothing else changes (no
class swap, no patched HF module):

* **without labels** the call is exactly HF's own forward (``type(model).forward``), logits,
  cache, ``logits_to_keep`` and every other keyword as HF has them;
* **with labels** it runs the base model (``model.base_model``, e.g. ``model.model`` of a
  ``LlamaForCausalLM``) and hands its ``last_hidden_state`` with ``model.get_output_embeddings()``'s
  weight (and bias) to :func:`vparallel_ce.linear_cross_entropy`. The output is HF's
  ``CausalLMOutputWithPast`` with ``logits=None``: the logits are never made. For logits and a
  loss, call without labels (HF's forward) and compute the loss from them.

HF's loss conventions are kept: the labels are shifted left by one and padded with ``-100``
(``shift_labels=`` is taken as given), ``ignore_index`` (default ``-100``) is ignored, and
``num_items_in_batch`` -- what HF's ``Trainer`` passes under gradient accumulation -- is the mean's
divisor (``num_valid_tokens`` where it is an integer; a float count divides the summed loss as it
is, as HF does). Tied embeddings need nothing: the lm_head weight *is* the embedding parameter,
and autograd sums both uses' gradients into it. A call without labels but with
``num_items_in_batch`` (the ``Trainer`` computing its own loss from the logits, as with
``label_smoothing_factor``) warns once: nothing is saved there; ``label_smoothing=`` is the op's.

The HF surface this relies on (verified with ``transformers`` 5.25): ``PreTrainedModel.base_model``,
``get_output_embeddings()``, the base model returning ``last_hidden_state`` (after the final norm)
and its cache / hidden-states / attentions fields under the names ``CausalLMOutputWithPast``
uses, ``forward(..., **kwargs)`` taking ``num_items_in_batch`` (so the ``Trainer`` passes it: the
new forward keeps HF's signature through ``__wrapped__``), and for tensor parallelism
(``tp_plan="auto"``) the lm_head weight as a DTensor ``Shard(0)`` over the TP mesh, which the op
reads its group from. That is the whole causal-LM head of Llama, Mistral, Qwen2/3, Gemma and
their kind. What a model or its user does to the head beyond that is honoured exactly or refused,
never skipped:

* a PEFT LoRA adapter on the lm_head (``peft.tuners.lora.Linear``): the op gets the effective
  weight ``W + scaling * B @ A`` (one ``[V, H]`` tensor per call, built by autograd, so ``A`` and
  ``B`` get their gradients) and bias ``b + scaling * b_B``; an lm_head in PEFT's
  ``modules_to_save`` is the copy PEFT runs; LoRA dropout while training, DoRA and other LoRA
  variants, a LoRA head under TP and any other PEFT tuner on the head are refused;
* ``config.lm_head_multiplier`` (FalconH1) scales the logits, ``final_logit_softcapping`` (Gemma)
  and ``logits_soft_cap`` (RecurrentGemma) cap them; a logit scale of other names (Cohere,
  Granite) and a mixture-of-experts router loss are refused by :func:`apply`;
* forward or backward hooks on the lm_head (or on its submodules, or global module hooks) would
  not run: refused;
* anything else -- the first call with labels (and the first after the lm_head module is
  replaced) runs the model's own forward on a few positions and compares its logits with the
  ones the loss assumes; where they differ the call is refused.
"""

from __future__ import annotations

import functools
import inspect
import sys
import types
import warnings

import torch
import torch.nn.functional as F

import vparallel_ce

__all__ = ["apply", "remove", "is_applied", "OPTIONS"]

#: keyword options of :func:`apply`, handed to :func:`vparallel_ce.linear_cross_entropy`
OPTIONS = ("chunks", "schedule", "recompute", "policy", "check", "check_replicated", "z_loss", "label_smoothing")

# config attributes of heads that are more than ``hidden @ W.T (+ b)`` followed by the loss
_REFUSED = ("logit_scale", "logits_scaling", "output_router_logits")
# config attributes that cap the logits, ``cap * tanh(logits / cap)``: the op's ``softcap``
_CAPS = ("final_logit_softcapping", "logits_soft_cap")
# config attributes that multiply the logits (before any cap)
_MULTIPLIERS = ("lm_head_multiplier",)

_MARK = "_vparallel_ce_forward"
# per-model state in the instance's __dict__ (travels with copy.deepcopy, as the forward does)
_CHECKED = "_vparallel_ce_checked_head"
_WARNED = "_vparallel_ce_warned_no_labels"
# positions of the first call's check of the model's own head (a handful: it costs one short forward)
_CHECK_POSITIONS = 4


def apply(model, **options):
    """Compute ``model``'s causal-LM loss with :func:`vparallel_ce.linear_cross_entropy`.

    ``model`` is a ``*ForCausalLM`` or a PEFT model wrapping one (``peft_model.get_base_model()``
    gets the new forward; PEFT's forward calls it). ``options`` are the op's ``chunks``,
    ``schedule``, ``recompute``, ``policy``, ``check``, ``check_replicated``, ``z_loss`` and
    ``label_smoothing`` (defaults: the op's). Returns ``model`` (the same object); applying again
    replaces the options, :func:`remove` undoes it.
    """
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise TypeError(f"apply() got unknown option(s) {unknown}; known: {list(OPTIONS)}")
    lm = _causal_lm(model)
    if not callable(getattr(lm, "get_output_embeddings", None)) or lm.get_output_embeddings() is None:
        raise TypeError(f"{type(lm).__name__} has no output embeddings (lm_head): not a causal LM")
    head = lm.get_output_embeddings()
    if not isinstance(getattr(head, "weight", None), torch.Tensor):
        raise TypeError(f"{type(lm).__name__}'s lm_head has no weight tensor")
    base = _base_model(lm)
    if base is None:
        raise TypeError(f"{type(lm).__name__} has no base model at model.base_model or model.model")
    text_config = _text_config(lm)
    for name in _REFUSED:
        value = getattr(text_config, name, None)
        if value not in (None, False, 1, 1.0) or (name == "output_router_logits" and value):
            raise NotImplementedError(
                f"{type(lm).__name__}: config.{name}={value!r} changes the head's logits or loss beyond "
                "hidden @ W.T + b; vparallel_ce.integrations.transformers does not handle it")
    op_options = dict(options)
    caps = {name: getattr(text_config, name) for name in _CAPS if getattr(text_config, name, None)}
    if len(set(caps.values())) > 1:
        raise NotImplementedError(f"{type(lm).__name__}: two logit caps {caps}; one is supported")
    if caps:
        op_options["softcap"] = float(next(iter(caps.values())))
    scale = 1.0
    for name in _MULTIPLIERS:
        value = getattr(text_config, name, None)
        if value is not None:
            scale *= float(value)
    hf_forward = type(lm).forward

    def forward(self, *args, **kwargs):
        labels = kwargs.get("labels")
        if labels is None and args:
            bound = inspect.signature(hf_forward).bind_partial(self, *args, **kwargs)
            labels = bound.arguments.get("labels")
        if labels is None:
            if kwargs.get("num_items_in_batch") is not None:
                _warn_loss_outside(self)
            return hf_forward(self, *args, **kwargs)
        return _loss_forward(self, hf_forward, op_options, scale, args, kwargs)

    functools.update_wrapper(forward, hf_forward)   # signature (and **kwargs) as HF's own forward
    setattr(forward, _MARK, True)
    lm.__dict__.pop(_CHECKED, None)   # new options, new check
    lm.forward = types.MethodType(forward, lm)
    return model


def remove(model):
    """Undo :func:`apply`: ``model.forward`` is HF's again. Returns ``model``."""
    lm = _causal_lm(model)
    if is_applied(lm):
        del lm.forward
        lm.__dict__.pop(_CHECKED, None)
    return model


def is_applied(model) -> bool:
    fn = _causal_lm(model).__dict__.get("forward")
    return getattr(getattr(fn, "__func__", None), _MARK, False)


def _causal_lm(model):
    """The causal LM itself: a PEFT model's ``get_base_model()`` (PEFT's forward calls its
    ``forward``), else ``model``."""
    get = getattr(model, "get_base_model", None)
    inner = get() if callable(get) else None
    return inner if isinstance(inner, torch.nn.Module) and inner is not model else model


def _warn_loss_outside(model):
    """Called without labels but with a loss divisor: the caller computes the loss from the logits
    (HF's ``Trainer`` does with ``label_smoothing_factor`` or ``compute_loss_func``), so the full
    logits are made. Said once per model."""
    if model.__dict__.get(_WARNED):
        return
    model.__dict__[_WARNED] = True
    warnings.warn(
        f"{type(model).__name__} was called without labels and with num_items_in_batch: the caller computes the "
        "loss from the full logits, and vparallel_ce does not run (no memory saved). HF's Trainer does this when "
        "TrainingArguments.label_smoothing_factor > 0 or compute_loss_func is set; for label smoothing, leave "
        "label_smoothing_factor at 0 and pass label_smoothing= to vparallel_ce.integrations.transformers.apply "
        "(the same loss).", UserWarning, stacklevel=3)


def _text_config(model):
    config = getattr(model, "config", None)
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _is_dtensor(t) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:   # torch built without distributed
        return False
    return isinstance(t, DTensor)


def _base_model(model):
    base = getattr(model, "base_model", None)
    if base is None or base is model:
        base = getattr(model, "model", None)
    return base if isinstance(base, torch.nn.Module) and base is not model else None


def _loss_forward(model, hf_forward, op_options, scale, args, kwargs):
    bound = inspect.signature(hf_forward).bind(model, *args, **kwargs)
    call = dict(bound.arguments)
    call.pop("self", None)
    for name, p in inspect.signature(hf_forward).parameters.items():
        if p.kind is p.VAR_KEYWORD and name in call:
            call.update(call.pop(name))
    labels = call.pop("labels")
    num_items = call.pop("num_items_in_batch", None)
    shift_labels = call.pop("shift_labels", None)
    ignore_index = call.pop("ignore_index", -100)
    return_dict = call.pop("return_dict", None)
    logits_to_keep = call.pop("logits_to_keep", 0)
    if call.get("output_router_logits"):
        raise NotImplementedError("output_router_logits: the router's auxiliary loss is not added by "
                                  "vparallel_ce.integrations.transformers")
    if not (isinstance(logits_to_keep, int) and logits_to_keep == 0):
        raise ValueError("logits_to_keep applies to calls without labels (the loss needs every position)")

    head = model.get_output_embeddings()
    _refuse_hooks(head)
    weight, bias = _head_terms(model, head)
    base = _base_model(model)
    if model.__dict__.get(_CHECKED) is not head:
        _check_head(model, hf_forward, base, head, call, weight, bias, scale, op_options.get("softcap"))
        model.__dict__[_CHECKED] = head
    out = base(**call)
    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    if hidden.shape[-1] != weight.shape[-1]:
        raise TypeError(
            f"{type(model).__name__}.base_model ({type(base).__name__}) gives outputs of width {hidden.shape[-1]}, "
            f"the lm_head takes {weight.shape[-1]}: it is not the decoder under the lm_head (a wrapped model? apply "
            "takes the causal LM itself, or a PEFT model)")
    if scale != 1.0:   # m * (h @ W.T + b) = (m * h) @ W.T + m * b
        hidden = hidden * scale
        bias = None if bias is None else bias * scale
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    shift_labels = shift_labels.to(hidden.device)
    divide_by = None   # a divisor that is not an integer: HF divides the summed loss by it as it is
    if isinstance(num_items, torch.Tensor):
        num_items = num_items.to(hidden.device)
        if num_items.is_floating_point():
            num_items, divide_by = None, num_items
    elif isinstance(num_items, float):
        num_items, divide_by = None, num_items
    rows = getattr(head, "out_features", None) or getattr(_text_config(model), "vocab_size", None)
    if not _is_dtensor(weight) and rows is not None and weight.shape[0] != rows:
        raise ValueError(
            f"the lm_head weight holds {weight.shape[0]} of the vocab's {rows} rows: a vocab-sharded lm_head "
            "must be a DTensor Shard(0) (HF's tp_plan), whose mesh gives the group")
    if divide_by is None:
        loss = vparallel_ce.linear_cross_entropy(
            hidden, weight, shift_labels, bias, ignore_index=ignore_index, num_valid_tokens=num_items, **op_options)
    else:
        loss = vparallel_ce.linear_cross_entropy(
            hidden, weight, shift_labels, bias, ignore_index=ignore_index, reduction="sum", **op_options)
        loss = loss / (divide_by.to(loss.dtype) if isinstance(divide_by, torch.Tensor) else divide_by)

    from transformers.modeling_outputs import CausalLMOutputWithPast

    rest = {k: v for k, v in out.items() if k != "last_hidden_state"} if hasattr(out, "items") else {}
    result = CausalLMOutputWithPast(loss=loss, logits=None, **rest)
    if return_dict is False or (return_dict is None and getattr(model.config, "return_dict", True) is False):
        return result.to_tuple()
    return result


def _refuse_hooks(head):
    """Hooks on the lm_head would not run (the head module is never called with labels): refused,
    named. Global module hooks too, as they would run on every module but this one."""
    kinds = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
    for name, module in head.named_modules(prefix="lm_head"):
        found = [k.strip("_").replace("_", " ").rstrip("s") for k in kinds if getattr(module, k, None)]
        if found:
            raise NotImplementedError(
                f"{name} ({type(module).__name__}) has a {' and a '.join(found)} registered: with labels the loss "
                "is computed from its weight without calling the module, so the hook would not run. Remove the hook, "
                "or call the model without labels and compute the loss from the logits")
    from torch.nn.modules import module as nn_module

    found = [k for k in ("_global_forward_pre_hooks", "_global_forward_hooks", "_global_backward_pre_hooks",
                         "_global_backward_hooks") if getattr(nn_module, k, None)]
    if found:
        raise NotImplementedError(
            f"global module hooks are registered ({', '.join(found)}): they would not run on the lm_head, which "
            "the loss does not call")


def _head_terms(model, head):
    """The effective ``(weight, bias)`` of the lm_head: its own, or through PEFT's wrappers (the
    module a ``modules_to_save`` wrapper runs, a LoRA layer folded in)."""
    if _is_peft_layer(head):
        return _lora_terms(model, head)
    saved = _peft_saved_module(model, head)
    if saved is not None:
        return _head_terms(model, saved)
    return head.weight, getattr(head, "bias", None)


def _peft_utils():
    return sys.modules.get("peft.utils") if "peft" in sys.modules else None   # PEFT's layers need peft imported


def _is_peft_layer(module) -> bool:
    if _peft_utils() is None:
        return False
    from peft.tuners.tuners_utils import BaseTunerLayer

    return isinstance(module, BaseTunerLayer)


def _peft_saved_module(model, head):
    """The module PEFT's ``modules_to_save`` wrapper runs (its trained copy for the active adapter, or
    the original where adapters are off), else None; any other PEFT wrapper is refused."""
    utils = _peft_utils()
    if utils is None or not isinstance(head, utils.AuxiliaryTrainingWrapper):
        return None
    if not isinstance(head, utils.ModulesToSaveWrapper):
        raise NotImplementedError(f"{type(model).__name__}'s lm_head is wrapped by a PEFT {type(head).__name__}; "
                                  "supported are LoRA and modules_to_save")
    active = head.active_adapters
    if head.disable_adapters or not active or any(a not in head.modules_to_save for a in active):
        return head.original_module
    return head.modules_to_save[active[0]]


def _lora_terms(model, head):
    """PEFT's LoRA lm_head, ``base(x) + sum_a scaling_a * B_a(A_a(dropout_a(x)))``, as one linear map:
    weight ``W + sum_a scaling_a * B_a.weight @ A_a.weight``, bias ``b + sum_a scaling_a * B_a.bias``
    (the LoRA bias, if any). Exact where PEFT's forward is linear in ``x``; what is not is refused."""
    from peft.tuners.lora import Linear as LoraLinear

    where = f"{type(model).__name__}'s lm_head"
    if not isinstance(head, LoraLinear):
        raise NotImplementedError(
            f"{where} is wrapped by a PEFT {type(head).__name__} layer; only a LoRA adapter on a linear lm_head "
            "(peft.tuners.lora.Linear) is supported")
    base = head.get_base_layer()
    if not isinstance(base, torch.nn.Linear) or _is_peft_layer(base):
        raise NotImplementedError(f"{where}: the LoRA layer wraps a {type(base).__name__}, not a torch.nn.Linear")
    _refuse_hooks(base)
    weight, bias = base.weight, base.bias
    if _is_dtensor(weight):
        raise NotImplementedError(f"{where}: a LoRA adapter on a tensor-parallel (DTensor) lm_head is not supported")
    if head.disable_adapters:
        if head.merged:
            raise NotImplementedError(
                f"{where}: adapters are disabled but merged into the weight (PEFT unmerges them in its forward); "
                "unmerge them first")
        return weight, bias
    if head.merged:   # the merged adapters are in the base weight; PEFT's forward adds nothing
        return weight, bias
    for name in head.active_adapters:
        if name not in head.lora_A:
            continue
        if getattr(head, "use_dora", {}).get(name):
            raise NotImplementedError(f"{where}: adapter {name!r} is DoRA (use_dora=True), whose output is not a "
                                      "low-rank term added to the logits; not supported")
        if name in getattr(head, "lora_variant", {}):
            raise NotImplementedError(
                f"{where}: adapter {name!r} is a LoRA variant ({type(head.lora_variant[name]).__name__}, e.g. DoRA) "
                "whose output is not a low-rank term added to the logits; not supported")
        dropout = head.lora_dropout[name]
        if isinstance(dropout, torch.nn.Dropout):
            if dropout.training and dropout.p > 0:
                raise NotImplementedError(
                    f"{where}: adapter {name!r} has lora_dropout={dropout.p} and the model is training: the dropped "
                    "input of the low-rank term cannot be folded into one weight. Use lora_dropout=0 for the lm_head")
        elif not isinstance(dropout, torch.nn.Identity):
            raise NotImplementedError(f"{where}: adapter {name!r} has a {type(dropout).__name__} as its dropout")
        lora_a, lora_b, scaling = head.lora_A[name], head.lora_B[name], head.scaling[name]
        for m in (lora_a, lora_b):
            if not isinstance(m, torch.nn.Linear):
                raise NotImplementedError(f"{where}: adapter {name!r} has a {type(m).__name__} factor, not a Linear")
            _refuse_hooks(m)
        delta = (lora_b.weight @ lora_a.weight) * scaling
        weight = weight + delta.to(weight.dtype)
        if lora_b.bias is not None:
            term = (lora_b.bias * scaling).to(weight.dtype)
            bias = term if bias is None else bias + term
    return weight, bias


def _check_head(model, hf_forward, base, head, call, weight, bias, scale, softcap):
    """Refuse a head whose logits are not the ones the loss assumes, ``cap(scale * (h @ W.T + b))``:
    the model's own forward runs on the first few positions of the first row (no labels, no
    gradients), the base model's output is caught on the way, and both logits are compared. Catches
    what no config field or wrapper names (a family's own transform, a replaced head forward)."""
    ids, embeds = call.get("input_ids"), call.get("inputs_embeds")
    if ids is not None:
        small = {"input_ids": ids[:1, :_CHECK_POSITIONS]}
    elif embeds is not None:
        small = {"inputs_embeds": embeds[:1, :_CHECK_POSITIONS]}
    else:
        return
    caught = []

    def catch(module, inputs, output):
        caught.append(output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0])

    handle = base.register_forward_hook(catch)
    try:
        with torch.no_grad():
            out = hf_forward(model, **small, use_cache=False)
    finally:
        handle.remove()
    theirs = out.logits if hasattr(out, "logits") else out[0]
    if not caught or theirs is None:
        return
    with torch.no_grad():
        ours = _logits(caught[-1], weight, bias, scale, softcap)
    # the rounding of the least precise dtype that made either (autocast may make bf16 from fp32)
    eps = max(torch.finfo(t.dtype).eps for t in (theirs, ours, weight) if t.dtype.is_floating_point)
    theirs = theirs.to(torch.float64)
    ours = ours.to(device=theirs.device, dtype=torch.float64)
    if ours.shape != theirs.shape:
        raise NotImplementedError(
            f"{type(model).__name__}'s own logits have shape {tuple(theirs.shape)}, the lm_head weight gives "
            f"{tuple(ours.shape)}: its head is not hidden @ W.T + b")
    rtol = min(3e-2, max(1e-9, 1000 * eps))
    size = theirs.abs().max().item() + 1.0
    diff = (ours - theirs).abs().max().item()
    if not diff <= rtol * size:   # (nan-safe)
        raise NotImplementedError(
            f"{type(model).__name__}'s own forward gives logits that differ from "
            f"{'cap(' if softcap else ''}{'m * ' if scale != 1.0 else ''}(hidden @ W.T + b){')' if softcap else ''} "
            f"with its lm_head ({type(head).__name__}) weight by up to {diff:.3g} (logits up to {size - 1:.3g}; "
            f"softcap={softcap}, multiplier={scale}): the model or its lm_head does something to the logits that "
            "vparallel_ce.integrations.transformers does not know, so the loss would be wrong. Call the model "
            "without labels and compute the loss from the logits")


def _logits(hidden, weight, bias, scale, softcap):
    """``cap(scale * (hidden @ weight.T + bias))`` in full, for the check's few rows; a vocab-sharded
    DTensor weight gives its gathered logits."""
    if _is_dtensor(weight):
        from torch.distributed.tensor import DTensor, Replicate

        mesh = weight.device_mesh
        hidden = DTensor.from_local(hidden, mesh, [Replicate()] * mesh.ndim, run_check=False)
        logits = F.linear(hidden, weight, bias).full_tensor()
    else:
        logits = F.linear(hidden.to(weight.dtype), weight, None if bias is None else bias.to(weight.dtype))
    logits = logits * scale
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    return logits
