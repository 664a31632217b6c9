r"""The GEMM mode's backward of ``linear_token_logprobs(..., support=ids)``
(:mod:`vparallel_ce.sampling_set`) for the set's columns: the kept entries' gradients of all its
chunks, ``d [n, K]`` at the local columns ``cols [n, K]`` (``-1``: none), turned into ``dh`` and
``dW`` by the full op's two GEMMs per vocab block of the shard::

    d_blk[n, j] = d[n, k] where cols[n, k] = blk.start + j, else 0      (rounded once to the matmul dtype)
    dh[n]      += d_blk W[blk]          (fp32)
    dW[blk]    (+)= d_blk^T h           (one GEMM over all the tokens: written once, or added to an fp32 sum)

so ``dW`` is made once per block from every token, never summed over token chunks in a
``[V_loc, H]`` buffer, and no ``[n, V_loc]`` tensor exists at once.
"""

from __future__ import annotations

import torch

from .chunk_walk import cat_parts
from .gemm import mm_into
from .layout import vocab_blocks

__all__ = ["gemm_set_grads"]


def gemm_set_grads(gemm_parts: list, w, dw, db, budget: int, *, accumulate: bool):
    """The GEMM mode's gradients of the set columns, all its chunks at once. ``gemm_parts``: per
    chunk ``(d [c, K_c] fp32, cols [c, K_c] local columns or -1, h [c, H], dh rows [c, H] fp32 or
    None)``. Per vocab block of the shard (``budget`` bytes of ``[n, block]`` fp32 gradient and its
    matmul-dtype copy): the kept entries' gradients added into the block's zero columns (an id twice
    in a row, unchecked, adds twice; the entries sorted by column once, one host read of the blocks'
    bounds), rounded once to the matmul dtype, and the full op's two GEMMs: ``dh rows += d_blk
    W_blk`` (fp32) and ``dW[blk] (+)= d_blk^T h`` -- written in ``dw``'s dtype (rounded once) or
    added to its fp32 sum (``accumulate``); ``db[blk] += sum d_blk``. No ``[n, V_loc]`` buffer, no
    per-chunk ``[V_loc, H]`` sum."""
    width = w.shape[0]
    if width == 0:
        return
    k = max(cols.shape[1] for _, cols, _, _ in gemm_parts)
    acc = gemm_parts[0][0].dtype

    def padded(t, fill):
        return t if t.shape[1] == k else torch.cat([t, t.new_full((t.shape[0], k - t.shape[1]), fill)], 1)

    d = cat_parts([padded(p[0], 0) for p in gemm_parts])
    cols = cat_parts([padded(p[1], -1) for p in gemm_parts])
    h = cat_parts([p[2] for p in gemm_parts])
    dhs = [p[3] for p in gemm_parts]
    n = h.shape[0]
    dh = None
    if dhs[0] is not None:
        dh = dhs[0] if len(dhs) == 1 else torch.zeros((n, w.shape[1]), dtype=acc, device=h.device)
    per = max(1, min(width, budget // max(1, 6 * n)))
    blocks = vocab_blocks(width, -(-width // per))
    # the entries sorted by column once (pads last), each block's a contiguous run: one host read of
    # the runs' bounds, then per block only its own entries are written (no pass over all n K)
    key = cols.reshape(-1)
    key, order = torch.sort(torch.where(key >= 0, key, width).to(torch.int32))
    row = order // max(k, 1)
    val = d.reshape(-1)[order]
    starts = torch.tensor([blk.start for blk in blocks] + [width], dtype=torch.int32, device=key.device)
    bounds = torch.searchsorted(key, starts).tolist()
    for blk, lo, hi in zip(blocks, bounds[:-1], bounds[1:]):
        s, e = blk.start, blk.stop
        d_blk = torch.zeros((n, e - s), dtype=acc, device=h.device)
        # added, not assigned: a checked set's (n, col) pairs are distinct (each adds once to 0, exactly);
        # with check=False an id twice in a row is two entries of its sum, and adds twice
        d_blk.view(-1).index_add_(0, row[lo:hi] * (e - s) + (key[lo:hi] - s), val[lo:hi])
        if db is not None:
            db[blk] += d_blk.sum(0)
        dm = d_blk.to(w.dtype)
        if dh is not None:
            mm_into(dh, dm, w[blk], accumulate=True)
        if dw is not None:
            mm_into(dw[blk], dm.t(), h, accumulate=accumulate)
    if dh is not None and len(dhs) > 1:
        for dh_c, part in zip(dhs, dh.split([p[2].shape[0] for p in gemm_parts])):
            dh_c += part
