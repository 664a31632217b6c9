"""The chunk policy: which schedule, how many chunks, and whether gradients are made in forward.

Pure functions of their arguments -- no device queries, no clocks, no RNG -- so every rank of a
group computes the same answer (ranks that disagree on the chunk count would deadlock in the
per-chunk collectives). The ops call :meth:`ChunkPolicy.plan` with their own arguments, and
:func:`explain` formats the same :class:`Plan`, so what ``explain`` prints is what the call runs.

Precedence (``docs/api.md``), each knob deciding one thing:

1. ``schedule``: ``"token"`` or ``"vocab"`` is used as given. ``"auto"`` with an integer ``chunks``
   means token chunks (``chunks=1``: no chunking, 3 matmuls). ``"auto"`` with ``chunks="auto"``: the
   memory model below picks.
2. ``chunks``: an integer is the token-chunk or vocab-block count (capped by the tokens / the
   128-column block rounding); ``"auto"`` sizes chunks from the budget, or, for
   ``linear_cross_entropy`` with ``ChunkPolicy.memory_bytes``, from that target for the whole peak
   (:func:`peak_bytes`: one token chunk if it fits, else the fewest vocab blocks that do).
3. ``recompute``: ``True`` recomputes the logits in backward, ``False`` makes the gradients in
   forward (mean/sum only); ``None``: with one token chunk and at most one microbatch in flight the
   chunk's logits are kept for the backward (3 matmuls, ``Plan.keep_logits``); with several token
   chunks the gradients are made in forward (mean/sum); else recompute.

The memory models the policy sizes chunks with (:func:`peak_bytes`, :func:`distillation_chunk_bytes`)
are :mod:`vparallel_ce.plan`'s; the budget bounds one chunk's fp32 logits (4 bytes a logit), or a
distillation op's whole working set of one chunk.

Speed model: every chunk costs two small all-reduces and a few kernel launches, and chunks below
``min_chunk_tokens`` rows make the lm_head matmuls inefficient; so with the default budget the count
is capped at ``ceil(tokens / min_chunk_tokens)``. ``docs/policy.md`` has the measurements behind the
defaults.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from .chunk_policy import ChunkPolicy
# the defaults docs/policy.md names, read here as before
from .chunk_policy import COMPACT_MIN_DROP, COMPACT_READ_MIN_WORK, COMPACT_ROW_ALIGN, DEFAULT_BUDGET_BYTES  # noqa: F401
from .plan import GiB, DistillShape, GradMode, Plan, WeightGrad, distillation_chunk_bytes, peak_bytes

__all__ = ["ChunkPolicy", "GradMode", "WeightGrad", "Plan", "DistillShape", "choose_chunks", "choose_plan", "explain", "peak_bytes",
           "distillation_chunk_bytes", "DEFAULT_POLICY"]


DEFAULT_POLICY = ChunkPolicy()


def choose_chunks(num_tokens: int, vocab_size: int, tp_degree: int = 1, *, dtype: torch.dtype = torch.bfloat16,
                  budget_bytes: int | None = None) -> int:
    """Chunk count of ``cross_entropy(..., chunks="auto")``: the fewest chunks whose fp32 logits fit
    the budget.

    Args:
        num_tokens: tokens in one microbatch on this rank.
        vocab_size: the GLOBAL vocab size (the local shard is ``ceil(V / tp_degree)``).
        dtype: the logits' dtype (kept for the signature; fp32 statistics cost the same for all).
        budget_bytes: hard bound on ``tokens/chunk * ceil(V/tp) * 4`` whenever one row fits.

    Returns an int in ``[1, num_tokens]``: non-increasing in ``tp_degree``, non-decreasing in
    ``num_tokens`` and ``vocab_size``, 1 when the whole microbatch fits.
    """
    del dtype
    return replace(DEFAULT_POLICY, budget_bytes=budget_bytes).chunks(num_tokens, vocab_size, tp_degree)


def choose_plan(num_tokens: int, vocab_size: int, tp_degree: int = 1, *, hidden_size: int | None = None,
                reduction: str = "mean", policy: ChunkPolicy | None = None, chunks: int | str = "auto",
                schedule: str = "auto", recompute: bool | None = None, fused: bool = False,
                logits_dtype: torch.dtype | None = None, distillation: DistillShape | None = None,
                heads: int = 1) -> Plan:
    """The :class:`Plan` a call with these arguments runs (``hidden_size=None``: ``cross_entropy``;
    ``distillation``: a distillation op; ``heads``: ``linear_mtp_loss`` over ``num_tokens`` rows
    of that many heads stacked)."""
    return (policy or DEFAULT_POLICY).plan(num_tokens, vocab_size, tp_degree, hidden_size=hidden_size,
                                           reduction=reduction, chunks=chunks, schedule=schedule,
                                           recompute=recompute, fused=fused, logits_dtype=logits_dtype,
                                           distillation=distillation, heads=heads)


def explain(num_tokens: int, vocab_size: int, tp_degree: int = 1, *, hidden_size: int | None = None,
            reduction: str = "mean", policy: ChunkPolicy | None = None, chunks: int | str = "auto",
            schedule: str = "auto", recompute: bool | None = None, fused: bool = False,
            dtype: torch.dtype = torch.bfloat16, logits_dtype: torch.dtype | None = None,
            distillation: DistillShape | None = None, heads: int = 1) -> str:
    """One paragraph: the plan a call with these arguments runs, why, and (``linear_cross_entropy``)
    its peak memory by :func:`peak_bytes` for ``dtype`` operands. The arguments are the call's own
    (``num_tokens`` over the whole group with sequence parallelism); ``hidden_size=None`` explains
    ``cross_entropy``, a hidden size ``linear_cross_entropy``. ``fused``: whether the call runs the
    fused GEMM kernels -- ``vparallel_ce.kernels.fused_applies(weight.device, dtype)``, True for
    bf16/fp16 on a GPU with Triton. ``logits_dtype``: the call's (``torch.float32`` for fp32 logits of
    ``dtype`` operands). ``distillation``: explains ``distillation_loss`` (``hidden_sizes=None``) or
    ``linear_distillation_loss`` instead, with one chunk's working set by
    :func:`distillation_chunk_bytes`. ``heads``: explains ``linear_mtp_loss`` instead, ``num_tokens``
    being the rows of that many heads stacked (``(D + 1) N``)."""
    policy = policy or DEFAULT_POLICY
    if distillation is not None:
        return _explain_distillation(num_tokens, vocab_size, tp_degree, distillation, policy=policy,
                                     reduction=reduction, chunks=chunks)
    wide = logits_dtype if logits_dtype is not None and logits_dtype.itemsize > dtype.itemsize else None
    p = policy.plan(num_tokens, vocab_size, tp_degree, hidden_size=hidden_size, reduction=reduction,
                    chunks=chunks, schedule=schedule, recompute=recompute, fused=fused, logits_dtype=wide,
                    heads=heads)
    op = "cross_entropy" if hidden_size is None else "linear_cross_entropy" if heads <= 1 else \
        f"linear_mtp_loss ({heads} heads' rows stacked)"
    unit = "token chunk" if p.schedule == "token" else "vocab block"
    grads = "in backward" if hidden_size is None else p.grad_mode.value
    matmuls, memory = "", ""
    if hidden_size is not None:
        matmuls = f", {_matmuls(p)} matmuls of 2*N*H*V_loc FLOPs"
        peak = peak_bytes(p, num_tokens, vocab_size, tp_degree, hidden_size=hidden_size, dtype=dtype,
                          logits_dtype=wide)
        memory = f" Peak memory over the inputs, dh and dW included: {peak / GiB:.2f} GiB (policy.peak_bytes)."
    return (f"{op} (V={vocab_size} over tp={tp_degree}, {policy.microbatches_in_flight} microbatch(es) in flight): "
            f"{p.schedule} schedule, {p.chunks} {unit}{'s' if p.chunks != 1 else ''}, gradients {grads}{matmuls}. "
            f"Why: {'; '.join(p.why)}.{memory}")


def _explain_distillation(num_tokens: int, vocab_size: int, tp_degree: int, shape: DistillShape, *,
                          policy: ChunkPolicy, reduction: str, chunks: int | str) -> str:
    p = policy.plan(num_tokens, vocab_size, tp_degree, reduction=reduction, chunks=chunks, distillation=shape)
    linear = shape.hidden_sizes is not None
    op = "linear_distillation_loss" if linear else "distillation_loss"
    matmuls = ""
    if linear:  # the teacher's and the student's logits, then dh and dW; recomputing adds both logits again
        matmuls = f", {4 if p.grad_in_forward else 6} matmuls of 2*N*H*V_loc FLOPs"
    per = math.ceil(max(num_tokens, 1) / p.chunks)
    work = distillation_chunk_bytes(per, vocab_size, tp_degree, shape=shape)
    return (f"{op} ({shape.divergence}, V={vocab_size} over tp={tp_degree}, {policy.microbatches_in_flight} "
            f"microbatch(es) in flight): {p.chunks} token chunk{'s' if p.chunks != 1 else ''}, gradients "
            f"{p.grad_mode.value if linear else 'in backward'}{matmuls}. Why: {'; '.join(p.why)}. One chunk's "
            f"working set: {work / GiB:.2f} GiB (policy.distillation_chunk_bytes).")


def _matmuls(p: Plan) -> int:
    return 3 if p.schedule == "token" and (p.grad_in_forward or p.keep_logits) else 4
