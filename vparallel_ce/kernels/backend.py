"""The kernel backends' shape: :class:`KernelBackend`, one implementation of the per-chunk steps
(:data:`TORCH_OPS`: the torch reference of :mod:`vparallel_ce.stats`), :class:`FusedLinear`,
the lm_head GEMM fused with a row pass, and :class:`GatheredRows`, the lm_head over each token's
own weight rows (:mod:`vparallel_ce.kernels` hands these on).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .. import gathered_rows, stats
from ..divergence import TORCH_STEPS, DistillSteps

__all__ = ["FusedLinear", "RowGemm", "GatheredRows", "KernelBackend", "TORCH_OPS", "TORCH_GATHERED"]


@dataclass(frozen=True)
class FusedLinear:
    """The lm_head GEMM fused with a row pass (:mod:`.fused_linear`): ``covers(h, w, spec)`` says
    where it takes the inputs; ``stats(h, w, b, local_t, owned, spec)`` is the statistics of the
    logits ``h w^T + b`` (never written); ``grad_logits_for(h, local_t, owned, shift, coefs,
    spec)`` makes a chunk's ``(w_block, b_block, col_offset) -> dx`` of recomputed logits."""

    covers: Callable
    stats: Callable
    grad_logits_for: Callable


@dataclass(frozen=True)
class RowGemm:
    """GEMMs whose output row ``i`` depends on input row ``i`` alone, whatever the row count
    (:mod:`.row_gemm`, the batch-invariant mode's): ``logits(h, w, b, wide)`` is ``h w^T + b`` in
    ``h``'s dtype or ``wide`` (fp32); ``add_rows_mm_(out, a, b, accumulate=True)`` adds ``a @ b``
    to fp32 ``out`` (``accumulate=False``: writes it, rounded once into ``out``'s dtype)."""

    logits: Callable
    add_rows_mm_: Callable


@dataclass(frozen=True)
class GatheredRows:
    """The lm_head over each token's own weight rows (the sampling set's gather mode,
    :mod:`vparallel_ce.gathered_rows` for the math), over chunks with ``cols [c, K]`` local weight
    rows per token (``-1``: none): ``logits(parts, w, b, out_dtype) -> [x [c, K]]`` of the chunks
    ``(cols, h)``, all at once; ``hidden_grad(d, cols, w, out=None) -> dh [c, H]`` of one chunk (fp32
    for fp32 ``d``; written into ``out`` if given); ``weight_grad(parts, w, out_dtype, base, db) -> dW`` of the chunks ``(d, cols, h)``,
    all at once, its fp32 sums rounded once (``db`` added to). ``pairs(cols_list, w)``: what
    ``logits`` and ``weight_grad`` both make of the chunks' ``cols`` (the kernels' sort of the
    pairs by weight row; None: nothing), made once per call and passed to both as ``by_row=``."""

    name: str
    logits: Callable
    hidden_grad: Callable
    weight_grad: Callable
    pairs: Callable = lambda cols, w: None


TORCH_GATHERED = GatheredRows("torch", gathered_rows.logits, gathered_rows.hidden_grad,
                              gathered_rows.weight_grad)


@dataclass
class KernelBackend:
    """One implementation of the per-chunk steps, chosen once per call (:func:`ops_for`), with what
    it can do as fields. ``grad_logits_``: the gradient written over logits the op owns (None:
    out of place); ``fused``: the lm_head GEMM fused with the row passes (None: cuBLAS + them);
    ``distill``: the distillation ops' local passes over a dense teacher's and the student's logits
    (:class:`vparallel_ce.divergence.DistillSteps`); ``reduce``: the per-token losses to the
    call's output (:func:`vparallel_ce.stats.reduce`); ``row_gemm``: the batch-invariant mode's
    lm_head GEMMs (:class:`RowGemm`; None: that mode's torch GEMMs one tile at a time);
    ``gathered``: the lm_head over each token's own weight rows (:class:`GatheredRows`);
    ``merge_blocks``: the statistics of a chunk's vocab blocks merged, ``[k, 5, c]`` -> one
    :class:`~vparallel_ce.stats.ChunkStats` (:func:`vparallel_ce.stats.merge_blocks`: a few
    launches per chunk in the Triton version rather than a dozen per block)."""

    name: str
    local_stats: Callable
    grad_logits: Callable
    loss_stats_grad_: Callable
    scale_rows: Callable
    grad_logits_: Callable | None = None
    fused: FusedLinear | None = None
    distill: DistillSteps = TORCH_STEPS
    reduce: Callable = stats.reduce
    row_gemm: RowGemm | None = None
    gathered: GatheredRows = TORCH_GATHERED
    merge_blocks: Callable = stats.merge_blocks


TORCH_OPS = KernelBackend("torch", stats.local_stats, stats.grad_logits, stats.loss_stats_grad_, stats.scale_rows)
