r"""The lm_head over each token's own weight rows (Triton): the gather mode of
``linear_token_logprobs(..., support=ids)`` (:mod:`vparallel_ce.sampling_set`), where a token needs
the logits of its ``K`` kept ids only. ``cols [c, K]`` holds, per token, the local weight rows of its
kept ids and ``-1`` where none (padding, ids of other shards); a ``-1`` entry reads and adds nothing.

The pairs of all the chunks are sorted by weight row once per call (:class:`Pairs`: a stable
``torch.sort`` of their int32 rows, made in forward and kept for ``dW``), so both passes over them
follow ``w``'s rows and need no index building beside it.

* :func:`logits` -- ``x[n, k] = h[n] . w[cols[n, k]] (+ b[cols[n, k]])`` for all the chunks of a
  call at once: one program per block of consecutive sorted pairs dots each pair's weight row with
  its hidden row, in fp32, rounded once to the output dtype (the bias added in fp32 first). A
  weight row's run of pairs shares its blocks, so the row is read from memory about once per call
  instead of once per pair (at ``K = 512`` of ``V = 151936`` each row serves ~28 tokens); the grid
  follows the pairs, not ``V``;
* :func:`hidden_grad` -- ``dh[n] = sum_k d[n, k] w[cols[n, k]]`` in fp32: one program per (token,
  block of ``H``) walks the token's ``K`` rows a block of them at a time, all of a block's loads in
  flight together;
* :func:`weight_grad` -- ``dW[v] = sum_{(n, k): cols[n, k] = v} d[n, k] h[n]`` (and ``db[v] +=
  sum d[n, k]``) over ALL the call's chunks at once, after the last: one program per (weight row,
  block of ``H``), its pairs the sorted ones between its first and the next row's first (one
  ``searchsorted`` of all the rows, no host read), summed in fp32 in sorted order, a block of hidden
  rows in flight at a time, and the row written once, rounded once to ``dW``'s dtype. A row
  without pairs is written too (0, or its base rounded once): ``dW`` takes no fill of its own, and
  every program's work is one row, so they all run at once (no program walks several rows in turn).
  No atomics, no fp32 ``[V, H]`` buffer read and written per chunk, the same bits on every run.

None of them makes the ``[c, K, H]`` gathered rows: each gathered row is read once per pass and
used at once; only :func:`hidden_grad` reads a weight row from memory once per pair. What they
cost and when they beat the shard's GEMM: the rule in :mod:`vparallel_ce.sampling_set`.
Operands: bf16 / fp16 / fp32 (one dtype for ``h`` and ``w``), on a CUDA GPU or under
``TRITON_INTERPRET=1``; anything else runs the torch version (:mod:`vparallel_ce.gathered_rows`),
which is also the reference the tests hold these to.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import gathered_rows as torch_rows
from .backend import GatheredRows
from .config import interpreting

__all__ = ["GATHERED", "Pairs", "pairs", "logits", "hidden_grad", "weight_grad"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# Tiles. A program holds a [rows, BLOCK_H] tile of gathered rows, loaded at once (rows of memory in
# flight together); the loads of one row are BLOCK_H contiguous elements. logits: 16 x 256 at 4
# warps, an fp32 accumulator of the tile's shape summed across its columns once, at the end. dh / dW:
# 8 x 1024 at 4 warps / 4 x 2048 at 8 warps, 256 elements a warp, so a thread holds 8 consecutive
# elements of each row (16-byte loads of bf16) and sums the tile's rows in its own registers into a
# [BLOCK_H] fp32 accumulator. dW's programs are one per weight row and block of H, most of them
# with one pair or none at small K: wide blocks keep their count (and the launch's) down.
_LOGITS_BP, _LOGITS_BH, _LOGITS_WARPS = 16, 256, 4
_DH_BK, _DH_BH, _DH_WARPS = 8, 1024, 4
_DW_BP, _DW_BH, _DW_WARPS = 4, 2048, 8


@triton.jit(do_not_specialize=["P"])
def _logits_kernel(KEYS, ORDER, H_, W_, B_, X_, P, K, HD, s_h, s_w,
                   HAS_BIAS: tl.constexpr, BP: tl.constexpr, BH: tl.constexpr):
    # BP consecutive pairs of the row-sorted list: a weight row's run of pairs is read from memory
    # once and from cache by its next pairs; a pad (row -1) stores 0
    p = tl.program_id(0).to(tl.int64) * BP + tl.arange(0, BP)
    pin = p < P
    v = tl.load(KEYS + p, mask=pin, other=-1).to(tl.int64)
    ok = v >= 0
    pair = tl.load(ORDER + p, mask=pin, other=0)  # its flat index in the [n, K] pairs: token pair // K
    n = pair // K
    hs = tl.arange(0, BH)
    acc2 = tl.zeros((BP, BH), dtype=tl.float32)
    for h0 in range(0, HD, BH):
        m = ok[:, None] & (h0 + hs < HD)[None, :]
        wt = tl.load(W_ + v[:, None] * s_w + (h0 + hs)[None, :], mask=m, other=0.0)
        hv = tl.load(H_ + n[:, None] * s_h + (h0 + hs)[None, :], mask=m, other=0.0)
        acc2 += hv.to(tl.float32) * wt.to(tl.float32)
    x = tl.sum(acc2, axis=1)
    if HAS_BIAS:
        x += tl.load(B_ + v, mask=ok, other=0.0).to(tl.float32)
    tl.store(X_ + pair, x.to(X_.dtype.element_ty), mask=pin)


@triton.jit(do_not_specialize=["c", "K"])
def _dh_kernel(D_, COLS, W_, DH, c, K, HD, s_d, s_c, s_w, s_dh, BK: tl.constexpr, BH: tl.constexpr):
    # one (token, H tile): BK weight rows in flight per step, each thread a 16-byte slice of each
    n = tl.program_id(0).to(tl.int64)
    hs = tl.program_id(1) * BH + tl.arange(0, BH)
    hin = hs < HD
    kk = tl.arange(0, BK)
    acc = tl.zeros((BH,), dtype=tl.float32)
    for k0 in range(0, K, BK):
        kin = k0 + kk < K
        cols = tl.load(COLS + n * s_c + k0 + kk, mask=kin, other=-1)
        ok = cols >= 0
        d = tl.load(D_ + n * s_d + k0 + kk, mask=ok, other=0.0).to(tl.float32)  # (a pad's d is never read)
        wt = tl.load(W_ + cols[:, None] * s_w + hs[None, :], mask=ok[:, None] & hin[None, :], other=0.0)
        acc += tl.sum(wt.to(tl.float32) * d[:, None], axis=0)  # (within a thread: BK is not split)
    tl.store(DH + n * s_dh + hs, acc, mask=hin)


@triton.jit
def _dw_kernel(STARTS, ORDER, D_, H_, BASE, OUT, DB, K, HD, s_h, s_base, s_out, HAS_BASE: tl.constexpr,
               HAS_DW: tl.constexpr, HAS_DB: tl.constexpr, BP: tl.constexpr, BH: tl.constexpr):
    # one (weight row, H tile) of dW: the row's pairs are sorted pairs STARTS[v] .. STARTS[v + 1],
    # summed in fp32 in sorted order, BP hidden rows in flight per step; the row written once,
    # rounded once (a row without pairs: 0 or its base, so dW needs no fill of its own)
    v = tl.program_id(0).to(tl.int64)
    hs = tl.program_id(1) * BH + tl.arange(0, BH)
    hin = hs < HD
    pp = tl.arange(0, BP)
    start = tl.load(STARTS + v)
    end = tl.load(STARTS + v + 1)
    acc = tl.zeros((BH,), dtype=tl.float32)
    dsum = tl.zeros((BP,), dtype=tl.float32)
    for p0 in range(start, end, BP):
        pin = p0 + pp < end
        pair = tl.load(ORDER + p0 + pp, mask=pin, other=0)  # its flat index in the [n, K] pairs
        d = tl.load(D_ + pair, mask=pin, other=0.0)
        dsum += d
        if HAS_DW:
            n = pair // K
            hv = tl.load(H_ + n[:, None] * s_h + hs[None, :], mask=pin[:, None] & hin[None, :], other=0.0)
            acc += tl.sum(hv.to(tl.float32) * d[:, None], axis=0)  # (within a thread: BP is not split)
    if HAS_DW:
        if HAS_BASE:
            acc += tl.load(BASE + v * s_base + hs, mask=hin, other=0.0)
        tl.store(OUT + v * s_out + hs, acc.to(OUT.dtype.element_ty), mask=hin)
    if HAS_DB:
        if (tl.program_id(1) == 0) & (end > start):
            tl.store(DB + v, tl.load(DB + v) + tl.sum(dsum, axis=0))


# --------------------------------------------------------------------------------------------- host


def _covered(*ts: torch.Tensor) -> bool:
    """Operands these kernels take: one 16-bit or fp32 dtype, on CUDA or under the interpreter."""
    first = ts[0]
    return (first.dtype in _DTYPES and all(t.dtype == first.dtype for t in ts)
            and all(t.is_cuda or interpreting() for t in ts))


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _stacked(hs: list[torch.Tensor]) -> torch.Tensor:
    """The chunks' hidden rows as one ``[n, H]`` matrix of unit last stride: a view where they are
    consecutive rows of one tensor (the chunks of replicated hidden states), else a copy."""
    first = hs[0]
    if first.stride(-1) == 1 and all(h.stride() == first.stride() for h in hs):
        at, size = first.data_ptr(), first.element_size() * first.stride(0)
        rows = 0
        for h in hs:
            if h.data_ptr() != at + rows * size or h.untyped_storage().data_ptr() != first.untyped_storage().data_ptr():
                break
            rows += h.shape[0]
        else:
            return first.as_strided((rows, first.shape[1]), first.stride())
    return torch.cat(hs)


def _flat(parts: list[torch.Tensor], k: int, fill) -> torch.Tensor:
    """The chunks' ``[c, K_c]`` entries as one flat ``[n k]``, each row padded to ``k`` with ``fill``."""
    if all(t.shape[1] == k for t in parts):
        return parts[0].reshape(-1) if len(parts) == 1 else torch.cat([t.reshape(-1) for t in parts])
    out = parts[0].new_full((sum(t.shape[0] for t in parts), k), fill)
    row = 0
    for t in parts:
        out[row:row + t.shape[0], :t.shape[1]] = t
        row += t.shape[0]
    return out.reshape(-1)


class Pairs:
    """The chunks' ``(token, id)`` pairs in weight-row order, made once per call and read by both
    :func:`logits` and :func:`weight_grad`: the chunks' ``cols`` stacked as one ``[n, k]`` matrix
    (``k`` their widest; narrower rows padded with ``-1``), ``keys`` each sorted pair's weight row
    (``-1`` pads sort first), ``order`` its flat index in that matrix (sorted by row, stably) and
    its token ``order // k`` (the row of the stacked hidden states). Two small steps (the sort and
    an int32 copy of its keys): no host read, no per-chunk index building."""

    def __init__(self, cols: list[torch.Tensor]):
        self.k = max(c.shape[1] for c in cols)
        self.count = sum(c.shape[0] for c in cols) * self.k
        self.keys, self.order = torch.sort(_flat(cols, self.k, -1).to(torch.int32), stable=True)  # (radix: 4 bytes)


def pairs(cols: list[torch.Tensor], w: torch.Tensor) -> Pairs | None:
    """The sorted pairs of the chunks' ``cols`` (:class:`Pairs`) where these kernels take ``w``, else None."""
    return Pairs(cols) if cols and _covered(w) and w.shape[0] and w.shape[1] else None


def logits(parts, w: torch.Tensor, b: torch.Tensor | None, out_dtype: torch.dtype, *,
           by_row: Pairs | None = None) -> list[torch.Tensor]:
    """Each chunk's ``[c, K]`` logits ``h[n] . w[cols[n, k]] (+ b)`` in ``out_dtype`` for the chunks
    ``(cols [c, K] int64, h [c, H])`` of ``parts``, all in one launch; entries with ``cols = -1``
    are 0. ``w [V, H]``, ``b [V]`` or None; ``by_row``: the chunks' :func:`pairs`, if made."""
    hs = [h for _, h in parts]
    if not parts or not _covered(w, *hs) or w.shape[0] == 0 or w.shape[1] == 0:
        return torch_rows.logits(parts, w, b, out_dtype)
    w = _rows(w)
    by_row = by_row or Pairs([cols for cols, _ in parts])
    h = _stacked(hs)
    x = torch.empty(by_row.count, dtype=out_dtype, device=w.device)  # (every pair stored, a pad's as 0)
    if by_row.count:
        _logits_kernel[(triton.cdiv(by_row.count, _LOGITS_BP),)](
            by_row.keys, by_row.order, h, w, b if b is not None else w, x, by_row.count, max(by_row.k, 1),
            w.shape[1], h.stride(0), w.stride(0), HAS_BIAS=b is not None, BP=_LOGITS_BP,
            BH=_LOGITS_BH, num_warps=_LOGITS_WARPS)
    if len(parts) == 1:
        return [x.view(parts[0][0].shape)]
    x = x.view(sum(cols.shape[0] for cols, _ in parts), by_row.k)
    out, row = [], 0
    for cols, _ in parts:
        out.append(x[row:row + cols.shape[0], :cols.shape[1]])
        row += cols.shape[0]
    return out


def hidden_grad(d: torch.Tensor, cols: torch.Tensor, w: torch.Tensor, *,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """``dh [c, H]`` fp32: ``sum_k d[n, k] w[cols[n, k]]`` over the entries with ``cols >= 0``;
    ``d [c, K]`` fp32. ``out``: written there (fp32 ``[c, H]``, rows of unit stride) and returned."""
    c, k = cols.shape
    hd = w.shape[1]
    if (not _covered(w) or d.dtype != torch.float32 or c == 0 or k == 0 or hd == 0
            or (out is not None and (out.dtype != torch.float32 or out.stride(-1) != 1))):
        return torch_rows.hidden_grad(d, cols, w, out=out)
    d, cols, w = _rows(d), _rows(cols), _rows(w)
    dh = torch.empty((c, hd), dtype=torch.float32, device=w.device) if out is None else out
    _dh_kernel[(c, triton.cdiv(hd, _DH_BH))](d, cols, w, dh, c, k, hd, d.stride(0), cols.stride(0), w.stride(0),
                                             dh.stride(0), BK=_DH_BK, BH=_DH_BH, num_warps=_DH_WARPS)
    return dh


def weight_grad(parts, w: torch.Tensor, out_dtype: torch.dtype | None, base: torch.Tensor | None = None,
                db: torch.Tensor | None = None, *, by_row: Pairs | None = None) -> torch.Tensor | None:
    """``dW`` (``w [V, H]``'s shape and device; its values unread) in ``out_dtype`` (None: no ``dW``,
    only ``db``): ``base`` (fp32, or 0) plus, per weight row ``v``, ``sum d[n, k] h[n]`` over the
    entries with ``cols[n, k] = v`` of every chunk ``(d [c, K] fp32, cols [c, K], h [c, H])`` in
    ``parts`` -- one fp32 sum per row over all the chunks, rounded once; ``db [V]`` (fp32) gets ``sum
    d[n, k]`` added. Entries with ``cols = -1`` add nothing. ``by_row``: the chunks' :func:`pairs`,
    if made (the forward's). One launch writes every row of ``dW``, those without pairs too (0 or
    their base): no fill of its own."""
    shape = tuple(w.shape)
    v, hd = shape
    hs = [h for _, _, h in parts]
    if (not parts or not _covered(*hs) or any(d.dtype != torch.float32 for d, _, _ in parts) or v == 0 or hd == 0
            or (base is not None and (base.dtype != torch.float32 or not base.is_contiguous()))
            or (db is not None and (db.dtype != torch.float32 or not db.is_contiguous()))):
        return torch_rows.weight_grad(parts, w, out_dtype, base, db)
    by_row = by_row or Pairs([cols for _, cols, _ in parts])
    h = _stacked(hs)
    d = _flat([d for d, _, _ in parts], by_row.k, 0.0)
    # each row's first sorted pair (pads, -1, sort first); row v's pairs end where row v + 1's begin
    starts = torch.searchsorted(by_row.keys, torch.arange(v + 1, dtype=torch.int32, device=d.device))
    out = None if out_dtype is None else torch.empty(shape, dtype=out_dtype, device=d.device)
    n_h = 1 if out is None else triton.cdiv(hd, _DW_BH)
    _dw_kernel[(v, n_h)](starts, by_row.order, d, h, base if base is not None else d, out if out is not None else d,
                         db if db is not None else d, max(by_row.k, 1), hd, h.stride(0),
                         0 if base is None else base.stride(0), 0 if out is None else out.stride(0),
                         HAS_BASE=base is not None, HAS_DW=out is not None, HAS_DB=db is not None, BP=_DW_BP,
                         BH=_DW_BH, num_warps=_DW_WARPS)
    return out


GATHERED = GatheredRows("triton", logits, hidden_grad, weight_grad, pairs)
