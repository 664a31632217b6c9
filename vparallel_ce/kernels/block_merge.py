"""The statistics of a chunk's vocab blocks merged (:func:`vparallel_ce.stats.merge_blocks`) on the
Triton path: the per-block merge of the torch steps is a dozen or more small launches per block
(two exponentials, rescalings, masks); here it is five per chunk, whatever the block count, and
bitwise the same.

The blocks' statistics lie in one ``[k, 5, c]`` buffer (each block's
:func:`.triton_ce.local_stats` ``out``). The running max over the blocks is a cumulative max
(exact, nan kept as ``torch.maximum`` keeps it); the differences to it and their exponentials are
torch's ops on the same values as the block-by-block merge's; one kernel then folds the sums over
the blocks, left to right, with the reference's operations in its order and fp contraction off
(a fused multiply-add would round once where the reference rounds twice).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import stats
from .config import interpreting

__all__ = ["merge_blocks"]


@triton.jit
def _merge_blocks_kernel(P, stride_p, D, E, stride_d, OUT, c, k, ENTROPY: tl.constexpr, BLOCK: tl.constexpr):
    # stats.merge folded over the blocks, a row per lane: the same operations in the same order (the
    # launch turns off fp contraction), the exponentials torch's (stats.merge_blocks, E = exp(D))
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = rows < c
    s = tl.load(P + c + rows, mask=mask, other=0.0)
    tgt = tl.load(P + 2 * c + rows, mask=mask, other=0.0)
    tot = tl.load(P + 3 * c + rows, mask=mask, other=0.0)
    z = 0.0
    if ENTROPY:
        z = tl.load(P + 4 * c + rows, mask=mask, other=0.0)
    for b in range(1, k):
        base = P + b * stride_p
        sb = tl.load(base + c + rows, mask=mask, other=0.0)
        da = tl.load(D + (b - 1) * c + rows, mask=mask, other=0.0)  # M_{b-1} - M_b
        db = tl.load(D + stride_d + (b - 1) * c + rows, mask=mask, other=0.0)  # m_b - M_b
        ea = tl.load(E + (b - 1) * c + rows, mask=mask, other=0.0)
        eb = tl.load(E + stride_d + (b - 1) * c + rows, mask=mask, other=0.0)
        if ENTROPY:
            zb = tl.load(base + 4 * c + rows, mask=mask, other=0.0)
            za = tl.where(s == 0, 0.0, (z + tl.where(s == 0, 0.0, da) * s) * ea)
            z = za + tl.where(sb == 0, 0.0, (zb + tl.where(sb == 0, 0.0, db) * sb) * eb)
        s = tl.where(s == 0, s, s * ea) + tl.where(sb == 0, sb, sb * eb)
        tgt = tgt + tl.load(base + 2 * c + rows, mask=mask, other=0.0)
        tot = tot + tl.load(base + 3 * c + rows, mask=mask, other=0.0)
    tl.store(OUT + c + rows, s, mask=mask)
    tl.store(OUT + 2 * c + rows, tgt, mask=mask)
    tl.store(OUT + 3 * c + rows, tot, mask=mask)
    if ENTROPY:
        tl.store(OUT + 4 * c + rows, z, mask=mask)


def merge_blocks(parts: torch.Tensor, spec) -> stats.ChunkStats:
    """Drop-in for :func:`vparallel_ce.stats.merge_blocks`: the running max, the differences to it
    and their exponentials (torch), one fold kernel."""
    k, _, c = parts.shape
    if k == 1 or not (parts.is_cuda or interpreting()) or parts.dtype != torch.float32 \
            or not parts.is_contiguous() or c == 0:
        return stats.merge_blocks(parts, spec)
    running = torch.cummax(parts[:, 0], dim=0).values
    diffs = torch.empty((2, k - 1, c), dtype=parts.dtype, device=parts.device)
    torch.sub(running[:-1], running[1:], out=diffs[0])
    torch.sub(parts[1:, 0], running[1:], out=diffs[1])
    exps = torch.exp(diffs)
    out = torch.empty((5, c), dtype=parts.dtype, device=parts.device)
    block = 128
    _merge_blocks_kernel[(triton.cdiv(c, block),)](
        parts, parts.stride(0), diffs, exps, diffs.stride(0), out, c, k, ENTROPY=spec.entropy, BLOCK=block,
        num_warps=4, enable_fp_fusion=False,
    )
    return stats.ChunkStats(running[-1], out[1], out[2], out[3], out[4] if spec.entropy else None)
