"""String-configurable losses (torchtitan ``TrainSpec`` style) and their ``nn.Module`` wrappers.

``build_loss_fn(name, **options)`` returns a module holding the options:

============================  =====================================  ============================
name (aliases)                module                                 call
============================  =====================================  ============================
``naive`` (``plain``)         :class:`PlainCrossEntropy`             ``fn(logits, target)``
``chunked`` (``vocab_parallel``, ``cross_entropy``)  :class:`VocabParallelCrossEntropy`  ``fn(logits, target)``
``fused`` (``linear``, ``linear_cross_entropy``)     :class:`LinearCrossEntropy`  ``fn(hidden, weight, target, bias=None)``
============================  =====================================  ============================

``naive`` is the reference users compare against: gather the vocab-sharded logits, upcast to fp32,
``F.cross_entropy`` (+ z-loss/softcap with the same definitions), which costs the full fp32 logits.

Options are checked when the module is built, not at its first call: an unknown keyword raises a
``TypeError`` naming it, a bad value the ``ValueError`` the op itself would raise
(:func:`vparallel_ce.validate.check_options`).
"""

from __future__ import annotations

import difflib
import inspect

import torch
import torch.nn.functional as F
from torch import nn

from . import comm
from .dtensor import is_dtensor
from .cross_entropy import cross_entropy
from .layout import VocabLayout, shard_sizes
from .linear import linear_cross_entropy
from .options import Options
from .stats import compute_dtype
from .validate import check_call_options, check_options

__all__ = ["build_loss_fn", "PlainCrossEntropy", "VocabParallelCrossEntropy", "LinearCrossEntropy", "LOSSES"]




def _keyword_options(op) -> frozenset:
    """The keyword-only parameters of ``op``: read from its signature, so that an option added to
    the op is accepted here without a second list to keep in step."""
    params = inspect.signature(op).parameters.values()
    return frozenset(p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY)


class _LossModule(nn.Module):
    """Holds keyword options, checked here (see the module docstring); ``group`` may be a
    ProcessGroup, a 1-D DeviceMesh or None."""

    OPTIONS: frozenset = frozenset()  # the keywords this loss takes

    def __init__(self, **options):
        super().__init__()
        name = type(self).__name__
        for key in options:
            if key not in self.OPTIONS:
                close = difflib.get_close_matches(key, self.OPTIONS, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise TypeError(f"{name} got an unexpected keyword {key!r}{hint}; it takes "
                                f"{', '.join(sorted(self.OPTIONS))}")
        problem = check_options(**{k: v for k, v in options.items() if k != "group"})
        if problem is not None:
            raise problem.exc(f"{name}: {problem.message}")
        try:  # where the shards live: checked now, resolved at each call (a mesh's group may change)
            comm.resolve_group(options.get("group"))
        except (TypeError, ValueError) as e:
            raise type(e)(f"{name}: {e}") from None
        self.options = options

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.options.items() if k != "group")


class VocabParallelCrossEntropy(_LossModule):
    """``forward(logits, target, *, num_valid_tokens=None)`` = :func:`vparallel_ce.cross_entropy`
    with the stored options (``num_valid_tokens``: this step's divisor of the mean, if given)."""

    OPTIONS = _keyword_options(cross_entropy)

    def forward(self, logits: torch.Tensor, target: torch.Tensor, *, num_valid_tokens=None) -> torch.Tensor:
        return cross_entropy(logits, target, **_with_count(self.options, num_valid_tokens))


class LinearCrossEntropy(_LossModule):
    """``forward(hidden, weight, target, bias=None, *, num_valid_tokens=None)`` =
    :func:`vparallel_ce.linear_cross_entropy`. The lm_head keeps owning its weight; pass
    ``lm_head.weight`` (a shard or a DTensor)."""

    OPTIONS = _keyword_options(linear_cross_entropy)

    def forward(self, hidden, weight, target, bias=None, *, num_valid_tokens=None) -> torch.Tensor:
        return linear_cross_entropy(hidden, weight, target, bias, **_with_count(self.options, num_valid_tokens))


def _with_count(options: dict, num_valid_tokens) -> dict:
    """The stored options with a call's own ``num_valid_tokens`` (which changes every step)."""
    return options if num_valid_tokens is None else {**options, "num_valid_tokens": num_valid_tokens}


class PlainCrossEntropy(_LossModule):
    """The unfused reference: full fp32 logits, then ``F.cross_entropy``. Sharded input (a DTensor,
    or a local shard with ``group=``) is all-gathered first. Options: ``group``, ``ignore_index``,
    ``reduction``, ``label_smoothing``, ``z_loss``, ``softcap``."""

    OPTIONS = frozenset({"group", "ignore_index", "reduction", "label_smoothing", "z_loss", "softcap"})

    def forward(self, logits: torch.Tensor, target: torch.Tensor, *, num_valid_tokens=None) -> torch.Tensor:
        o = Options(**{k: v for k, v in _with_count(self.options, num_valid_tokens).items() if k != "group"})
        problem = check_call_options(o)  # the count is a per-call value: checked here, not at construction
        if problem is not None:
            problem.raise_()
        group = comm.resolve_group(self.options.get("group"))
        if is_dtensor(logits):
            logits = logits.full_tensor()
        elif comm.is_sharded(group):
            logits = _gather_vocab(logits, group)
        if is_dtensor(target):
            target = target.full_tensor()
        z = logits.to(compute_dtype(logits.dtype)).reshape(-1, logits.shape[-1])
        if o.softcap is not None:
            z = o.softcap * torch.tanh(z / o.softcap)
        t = target.reshape(-1)
        per = F.cross_entropy(z, t, reduction="none", ignore_index=o.ignore_index, label_smoothing=o.label_smoothing)
        valid = t != o.ignore_index
        if o.z_loss:
            per = per + o.z_loss * torch.logsumexp(z, -1).square() * valid
        if o.reduction == "none":
            return per.reshape(target.shape)
        if o.reduction == "sum":
            return per.sum()
        if o.num_valid_tokens is None:
            return per.sum() / valid.sum()
        n = torch.as_tensor(o.num_valid_tokens).to(per.device, torch.float64).reshape(())
        return per.sum() / torch.where(n >= 0, n, float("nan"))  # as the ops: a negative count is nan


def _gather_vocab(x: torch.Tensor, group) -> torch.Tensor:
    # the reference needs only the shard sizes (not the ops' agreement on options and targets):
    # one small all-gather, and the same error on every rank when they are not torch.chunk's
    world, me = comm.world_size(group), comm.rank(group)
    sizes = [row[0] for row in comm.all_gather_ints([x.shape[-1]], group, x.device)]
    if sizes != shard_sizes(sum(sizes), world):
        raise ValueError(f"vocab shard sizes over the group are {sizes}, not the torch.chunk layout of "
                         f"V={sum(sizes)} over {world} ranks {shard_sizes(sum(sizes), world)}")
    return _GatherVocab.apply(x, VocabLayout.of_rank(group, world, me, sum(sizes)))


class _GatherVocab(torch.autograd.Function):
    """Full logits from vocab shards. Every rank then computes the same loss from the same full
    tensor, so the backward takes this rank's slice of the gradient -- summing the ranks'
    identical gradients (all_gather's usual backward) would scale it by the world size."""

    @staticmethod
    def forward(ctx, x, lay):
        ctx.lay = lay
        return comm.all_gather_last_dim(x, lay.group, lay.sizes())

    @staticmethod
    def backward(ctx, grad):
        lay = ctx.lay
        return grad[..., lay.offset : lay.offset + lay.local_size], None


LOSSES = {
    "naive": PlainCrossEntropy,
    "chunked": VocabParallelCrossEntropy,
    "fused": LinearCrossEntropy,
}
_ALIASES = {
    "plain": "naive",
    "vocab_parallel": "chunked",
    "cross_entropy": "chunked",
    "linear": "fused",
    "linear_cross_entropy": "fused",
}


def build_loss_fn(name: str, **options) -> nn.Module:
    """The loss registered under ``name`` (case-insensitive), holding ``options`` (the keyword
    options of the op it wraps). Unknown names raise a ``ValueError`` listing the known ones; an
    unknown option a ``TypeError`` and a bad option value a ``ValueError``, both naming it, here
    rather than at the first call."""
    key = _ALIASES.get(name.lower(), name.lower())
    if key not in LOSSES:
        known = sorted(set(LOSSES) | set(_ALIASES))
        raise ValueError(f"unknown loss {name!r}; known: {', '.join(known)}")
    return LOSSES[key](**options)
