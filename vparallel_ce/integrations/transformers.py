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
divisor (``num_valid_tokens``). Tied embeddings need nothing: the lm_head weight *is* the
embedding parameter, and autograd sums both uses' gradients into it. Gemma-style
``config.final_logit_softcapping`` becomes ``softcap``.

The HF surface this relies on (verified with ``transformers`` 5.25): ``PreTrainedModel.base_model``,
``get_output_embeddings()``, the base model returning ``last_hidden_state`` (after the final norm)
and its cache / hidden-states / attentions fields under the names ``CausalLMOutputWithPast``
uses, ``forward(..., **kwargs)`` taking ``num_items_in_batch`` (so the ``Trainer`` passes it: the
new forward keeps HF's signature through ``__wrapped__``), and for tensor parallelism
(``tp_plan="auto"``) the lm_head weight as a DTensor ``Shard(0)`` over the TP mesh, which the op
reads its group from. That is the whole causal-LM head of Llama, Mistral, Qwen2/3, Gemma and
their kind; a model whose head does more (a logit scale, a mixture-of-experts auxiliary loss) is
refused by :func:`apply`.
"""

from __future__ import annotations

import functools
import inspect
import types

import torch
import torch.nn.functional as F

import vparallel_ce

__all__ = ["apply", "remove", "is_applied", "OPTIONS"]

#: keyword options of :func:`apply`, handed to :func:`vparallel_ce.linear_cross_entropy`
OPTIONS = ("chunks", "schedule", "recompute", "policy", "check", "check_replicated", "z_loss", "label_smoothing")

# config attributes of heads that are more than ``hidden @ W.T (+ b)`` followed by the loss
_REFUSED = ("logit_scale", "logits_scaling", "output_router_logits")

_MARK = "_vparallel_ce_forward"


def apply(model, **options):
    """Compute ``model``'s causal-LM loss with :func:`vparallel_ce.linear_cross_entropy`.

    ``options`` are the op's ``chunks``, ``schedule``, ``recompute``, ``policy``, ``check``,
    ``check_replicated``, ``z_loss`` and ``label_smoothing`` (defaults: the op's). Returns
    ``model`` (the same object); applying again replaces the options, :func:`remove` undoes it.
    """
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise TypeError(f"apply() got unknown option(s) {unknown}; known: {list(OPTIONS)}")
    if not callable(getattr(model, "get_output_embeddings", None)) or model.get_output_embeddings() is None:
        raise TypeError(f"{type(model).__name__} has no output embeddings (lm_head): not a causal LM")
    head = model.get_output_embeddings()
    if not isinstance(getattr(head, "weight", None), torch.Tensor):
        raise TypeError(f"{type(model).__name__}'s lm_head has no weight tensor")
    base = _base_model(model)
    if base is None:
        raise TypeError(f"{type(model).__name__} has no base model at model.base_model or model.model")
    text_config = _text_config(model)
    for name in _REFUSED:
        value = getattr(text_config, name, None)
        if value not in (None, False, 1, 1.0) or (name == "output_router_logits" and value):
            raise NotImplementedError(
                f"{type(model).__name__}: config.{name}={value!r} changes the head's logits or loss beyond "
                "hidden @ W.T + b; vparallel_ce.integrations.transformers does not handle it")
    softcap = getattr(text_config, "final_logit_softcapping", None)
    op_options = dict(options)
    if softcap:
        op_options["softcap"] = float(softcap)
    hf_forward = type(model).forward

    def forward(self, *args, **kwargs):
        labels = kwargs.get("labels")
        if labels is None and args:
            bound = inspect.signature(hf_forward).bind_partial(self, *args, **kwargs)
            labels = bound.arguments.get("labels")
        if labels is None:
            return hf_forward(self, *args, **kwargs)
        return _loss_forward(self, hf_forward, op_options, args, kwargs)

    functools.update_wrapper(forward, hf_forward)   # signature (and **kwargs) as HF's own forward
    setattr(forward, _MARK, True)
    model.forward = types.MethodType(forward, model)
    return model


def remove(model):
    """Undo :func:`apply`: ``model.forward`` is HF's again. Returns ``model``."""
    if is_applied(model):
        del model.forward
    return model


def is_applied(model) -> bool:
    fn = model.__dict__.get("forward")
    return getattr(getattr(fn, "__func__", None), _MARK, False)


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


def _loss_forward(model, hf_forward, op_options, args, kwargs):
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

    out = _base_model(model)(**call)
    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    shift_labels = shift_labels.to(hidden.device)
    if isinstance(num_items, torch.Tensor):
        num_items = num_items.to(hidden.device)
        if num_items.is_floating_point():
            num_items = num_items.round().to(torch.int64)   # the Trainer's count may come as a float tensor
    elif isinstance(num_items, float) and num_items.is_integer():
        num_items = int(num_items)
    head = model.get_output_embeddings()
    rows = getattr(head, "out_features", None) or getattr(_text_config(model), "vocab_size", None)
    if not _is_dtensor(head.weight) and rows is not None and head.weight.shape[0] != rows:
        raise ValueError(
            f"the lm_head weight holds {head.weight.shape[0]} of the vocab's {rows} rows: a vocab-sharded lm_head "
            "must be a DTensor Shard(0) (HF's tp_plan), whose mesh gives the group")
    loss = vparallel_ce.linear_cross_entropy(
        hidden, head.weight, shift_labels, getattr(head, "bias", None),
        ignore_index=ignore_index, num_valid_tokens=num_items, **op_options)

    from transformers.modeling_outputs import CausalLMOutputWithPast

    rest = {k: v for k, v in out.items() if k != "last_hidden_state"} if hasattr(out, "items") else {}
    result = CausalLMOutputWithPast(loss=loss, logits=None, **rest)
    if return_dict is False or (return_dict is None and getattr(model.config, "return_dict", True) is False):
        return result.to_tuple()
    return result
