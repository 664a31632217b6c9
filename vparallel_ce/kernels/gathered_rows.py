r"""The lm_head over each token's own weight rows (Triton): the gather mode of
``linear_token_logprobs(..., support=ids)`` (:mod:`vparallel_ce.sampling_set`), where a token needs
the logits of its ``K`` kept ids only. ``cols [c, K]`` holds, per token, the local weight rows of its
kept ids and ``-1`` where none (padding, ids of other shards); a ``-1`` entry reads and adds nothing.

* :func:`logits` -- ``x[n, k] = h[n] . w[cols[n, k]] (+ b[cols[n, k]])`` for all the chunks of a
  call at once, over the pairs sorted by weight row (as for ``dW`` below): one program per block of
  consecutive sorted pairs dots each pair's weight row with its hidden row, in fp32, rounded once
  to the output dtype (the bias added in fp32 first). A weight row's run of pairs shares its blocks,
  so the row is read from memory about once per call instead of once per pair (at ``K = 512`` of
  ``V = 151936`` each row serves ~28 tokens); the grid follows the pairs, not ``V``;
* :func:`hidden_grad` -- ``dh[n] = sum_k d[n, k] w[cols[n, k]]`` in fp32: one program per (token,
  block of ``H``) walks the token's ``K`` rows;
* :func:`weight_grad` -- ``dW[v] = sum_{(n, k): cols[n, k] = v} d[n, k] h[n]`` (and ``db[v] +=
  sum d[n, k]``) over ALL the call's chunks at once, after the last: their ``(row, pair)`` list
  sorted by row once (a stable ``torch.sort``) and cut into runs of one row (found by a cumulative
  sum, no host read); programs stride over the runs (their count read on the device) and over the
  blocks of ``H``, each run summed in fp32 in sorted order and its row written once, rounded once to
  ``dW``'s dtype. Rows without pairs launch nothing: ``dW`` starts as one zero fill (or the base,
  rounded once). No atomics, no fp32 ``[V, H]`` buffer read and written per chunk, the same bits on
  every run.

None of them makes the ``[c, K, H]`` gathered rows: each gathered row is read once per pass and
used at once; only :func:`hidden_grad` reads a weight row from memory once per pair. What they
cost and when they beat the shard's GEMM: the rule in :mod:`vparallel_ce.sampling_set`.
Operands: bf16 / fp16 / fp32 (one dtype for ``h`` and ``w``), on a CUDA GPU or under
``TRITON_INTERPRET=1``; anything else runs the torch version (:mod:`vparallel_ce.gathered_rows`),
which is also the reference the tests hold these to.
"""

from __future__ import annotations

from itertools import accumulate

import torch
import triton
import triton.language as tl

from .. import gathered_rows as torch_rows
from .backend import GatheredRows
from .config import interpreting, sm_count

__all__ = ["GATHERED", "logits", "hidden_grad", "weight_grad"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# Tiles. A program holds a [rows, BLOCK_H] tile of gathered rows and an fp32 accumulator of the same
# shape (summed across its rows or columns once, at the end: no cross-thread reduction per step);
# the loads of one row are BLOCK_H contiguous elements. 16 x 256 at 4 warps and 16 x 512 / 8 x 1024
# at 8 warps: 32 fp32 accumulator registers a thread.
_LOGITS_BP, _LOGITS_BH, _LOGITS_WARPS = 16, 256, 4
_DH_BK, _DH_BH, _DH_WARPS = 16, 512, 8
_DW_BP, _DW_BH, _DW_WARPS = 8, 1024, 8  # wide: at small K most weight rows have one pair or none
_DW_PER_SM = 16  # dW programs per SM, each striding over the runs (several resident at a time)


@triton.jit(do_not_specialize=["P", "V"])
def _logits_kernel(KEYS, ORDER, ROWS_S, H_, W_, B_, X_, P, V, HD, s_h, s_w,
                   HAS_BIAS: tl.constexpr, BP: tl.constexpr, BH: tl.constexpr):
    # BP consecutive pairs of the row-sorted list: a weight row's run of pairs is read from memory
    # once and from cache by its next pairs; a pad (row V) stores 0
    p = tl.program_id(0).to(tl.int64) * BP + tl.arange(0, BP)
    pin = p < P
    v = tl.load(KEYS + p, mask=pin, other=V).to(tl.int64)
    ok = pin & (v < V)
    n = tl.load(ROWS_S + p, mask=ok, other=0)
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
    pair = tl.load(ORDER + p, mask=pin, other=0)
    tl.store(X_ + pair, x.to(X_.dtype.element_ty), mask=pin)


@triton.jit(do_not_specialize=["c", "K"])
def _dh_kernel(D_, COLS, W_, DH, c, K, HD, s_d, s_c, s_w, s_dh, BK: tl.constexpr, BH: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    hs = tl.program_id(1) * BH + tl.arange(0, BH)
    hin = hs < HD
    kk = tl.arange(0, BK)
    acc2 = tl.zeros((BK, BH), dtype=tl.float32)
    for k0 in range(0, K, BK):
        kin = k0 + kk < K
        cols = tl.load(COLS + n * s_c + k0 + kk, mask=kin, other=-1)
        ok = cols >= 0
        d = tl.load(D_ + n * s_d + k0 + kk, mask=ok, other=0.0).to(tl.float32)  # (a pad's d is never read)
        wt = tl.load(W_ + cols[:, None] * s_w + hs[None, :], mask=ok[:, None] & hin[None, :], other=0.0)
        acc2 += wt.to(tl.float32) * d[:, None]
    tl.store(DH + n * s_dh + hs, tl.sum(acc2, axis=0), mask=hin)


@triton.jit(do_not_specialize=["G"])
def _dw_kernel(RUNS, RUN_ROW, NRUNS, D_S, ROWS_S, H_, BASE, OUT, DB, G, HD, s_h, s_base, s_out,
               HAS_BASE: tl.constexpr, HAS_DW: tl.constexpr, HAS_DB: tl.constexpr, BP: tl.constexpr,
               BH: tl.constexpr):
    # programs stride over the runs of the row-sorted pairs (one run: one weight row's pairs), their
    # count read here: rows without pairs launch nothing (dW's zeros or base come from the host)
    hs = tl.program_id(1) * BH + tl.arange(0, BH)
    hin = hs < HD
    pp = tl.arange(0, BP)
    n_runs = tl.load(NRUNS)
    for r in range(tl.program_id(0), n_runs, tl.num_programs(0)):
        start = tl.load(RUNS + r)
        end = tl.load(RUNS + r + 1)
        v = tl.load(RUN_ROW + r).to(tl.int64)
        acc2 = tl.zeros((BP, BH), dtype=tl.float32)
        dsum = tl.zeros((BP,), dtype=tl.float32)
        for p0 in range(start, end, BP):
            pin = p0 + pp < end
            d = tl.load(D_S + p0 + pp, mask=pin, other=0.0)
            dsum += d
            if HAS_DW:
                n = tl.load(ROWS_S + p0 + pp, mask=pin, other=0)
                hv = tl.load(H_ + n[:, None] * s_h + hs[None, :], mask=pin[:, None] & hin[None, :], other=0.0)
                acc2 += hv.to(tl.float32) * d[:, None]
        if HAS_DW:
            acc = tl.sum(acc2, axis=0)
            if HAS_BASE:
                acc += tl.load(BASE + v * s_base + hs, mask=hin, other=0.0)
            tl.store(OUT + v * s_out + hs, acc.to(OUT.dtype.element_ty), mask=hin)
        if HAS_DB:
            if tl.program_id(1) == 0:
                tl.store(DB + v, tl.load(DB + v) + tl.sum(dsum, axis=0))


# --------------------------------------------------------------------------------------------- host


def _covered(*ts: torch.Tensor) -> bool:
    """Operands these kernels take: one 16-bit or fp32 dtype, on CUDA or under the interpreter."""
    first = ts[0]
    return (first.dtype in _DTYPES and all(t.dtype == first.dtype for t in ts)
            and all(t.is_cuda or interpreting() for t in ts))


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


class _ByRow:
    """The chunks' ``(token, id)`` pairs in weight-row order: ``keys`` (each sorted pair's weight
    row, ``V`` for a pad: pads sort last), ``order`` (its flat pair index, the chunks' ``cols``
    concatenated, sorted by row, stably), ``rows`` (its row of ``h``, the chunks' hidden rows stacked;
    one chunk: its own rows, no copy) and ``count`` (the pairs, pads included). With ``runs``: the
    runs of equal rows, found without a host read -- ``run_row [G]`` the row of run ``r`` and
    ``run_start [G + 1]`` its first pair (``run_start[r + 1]`` its end), ``n_runs`` their count
    (a device scalar), ``G = min(V, count)`` bounding it; entries past ``n_runs`` are empty runs."""

    def __init__(self, cols: list[torch.Tensor], hs: list[torch.Tensor], v: int, *, runs: bool = False):
        dev = hs[0].device
        self.h = _rows(hs[0]) if len(hs) == 1 else torch.cat(hs)
        starts = accumulate([h.shape[0] for h in hs[:-1]], initial=0)
        rows = torch.cat([(torch.arange(c.shape[0], device=dev) + off).repeat_interleave(c.shape[1])
                          for c, off in zip(cols, starts)])
        keys = torch.cat([torch.where(c >= 0, c, v).reshape(-1) for c in cols]).to(torch.int32)  # (radix: 4 bytes)
        self.keys, self.order = torch.sort(keys, stable=True)
        self.rows = rows[self.order]
        self.count = keys.numel()
        if runs:
            g = min(v, self.count)
            real = self.keys < v
            first = real.clone()
            first[1:] &= self.keys[1:] != self.keys[:-1]
            run = first.cumsum(0) - 1
            at = torch.where(first, run, g + 1)  # (the last slot: not a run's first pair; never read)
            self.n_runs = first.sum(dtype=torch.int32).reshape(1)
            self.run_start = real.sum(dtype=torch.int64).reshape(1).repeat(g + 2)  # empty runs end where pads begin
            self.run_start.scatter_(0, at, torch.arange(self.count, device=dev))
            self.run_row = torch.zeros(g + 2, dtype=torch.int32, device=dev).scatter_(0, at, self.keys)
            self.g = g


def logits(parts, w: torch.Tensor, b: torch.Tensor | None, out_dtype: torch.dtype) -> list[torch.Tensor]:
    """Each chunk's ``[c, K]`` logits ``h[n] . w[cols[n, k]] (+ b)`` in ``out_dtype`` for the chunks
    ``(cols [c, K] int64, h [c, H])`` of ``parts``, all in one launch; entries with ``cols = -1``
    are 0. ``w [V, H]``, ``b [V]`` or None."""
    hs = [h for _, h in parts]
    if not parts or not _covered(w, *hs) or w.shape[0] == 0 or w.shape[1] == 0:
        return torch_rows.logits(parts, w, b, out_dtype)
    w = _rows(w)
    by_row = _ByRow([cols for cols, _ in parts], hs, w.shape[0])
    x = torch.empty(by_row.count, dtype=out_dtype, device=w.device)  # (every pair stored, a pad's as 0)
    if by_row.count:
        _logits_kernel[(triton.cdiv(by_row.count, _LOGITS_BP),)](
            by_row.keys, by_row.order, by_row.rows, by_row.h, w, b if b is not None else w, x, by_row.count,
            w.shape[0], w.shape[1], by_row.h.stride(0), w.stride(0), HAS_BIAS=b is not None, BP=_LOGITS_BP,
            BH=_LOGITS_BH, num_warps=_LOGITS_WARPS)
    return [part.view(cols.shape) for part, (cols, _) in zip(x.split([cols.numel() for cols, _ in parts]), parts)]


def hidden_grad(d: torch.Tensor, cols: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``dh [c, H]`` fp32: ``sum_k d[n, k] w[cols[n, k]]`` over the entries with ``cols >= 0``;
    ``d [c, K]`` fp32."""
    c, k = cols.shape
    hd = w.shape[1]
    if not _covered(w) or d.dtype != torch.float32 or c == 0 or k == 0 or hd == 0:
        return torch_rows.hidden_grad(d, cols, w)
    d, cols, w = _rows(d), _rows(cols), _rows(w)
    dh = torch.empty((c, hd), dtype=torch.float32, device=w.device)
    _dh_kernel[(c, triton.cdiv(hd, _DH_BH))](d, cols, w, dh, c, k, hd, d.stride(0), cols.stride(0), w.stride(0),
                                             dh.stride(0), BK=_DH_BK, BH=_DH_BH, num_warps=_DH_WARPS)
    return dh


def weight_grad(parts, w: torch.Tensor, out_dtype: torch.dtype | None, base: torch.Tensor | None = None,
                db: torch.Tensor | None = None) -> torch.Tensor | None:
    """``dW`` (``w [V, H]``'s shape and device; its values unread) in ``out_dtype`` (None: no ``dW``,
    only ``db``): ``base`` (fp32, or 0) plus, per weight row ``v``, ``sum d[n, k] h[n]`` over the
    entries with ``cols[n, k] = v`` of every chunk ``(d [c, K] fp32, cols [c, K], h [c, H])`` in
    ``parts`` -- one fp32 sum per row over all the chunks, rounded once; ``db [V]`` (fp32) gets ``sum
    d[n, k]`` added. Entries with ``cols = -1`` add nothing. ``base`` may be overwritten."""
    shape = tuple(w.shape)
    v, hd = shape
    hs = [h for _, _, h in parts]
    if (not parts or not _covered(*hs) or any(d.dtype != torch.float32 for d, _, _ in parts) or v == 0 or hd == 0
            or (base is not None and (base.dtype != torch.float32 or not base.is_contiguous()))
            or (db is not None and (db.dtype != torch.float32 or not db.is_contiguous()))):
        return torch_rows.weight_grad(parts, w, out_dtype, base, db)
    d = torch.cat([d.reshape(-1) for d, _, _ in parts])
    by_row = _ByRow([cols for _, cols, _ in parts], hs, v, runs=True)
    d = d[by_row.order]
    # rows without pairs: 0 (one fill) or the base, rounded once; the kernel writes the others
    out = None
    if out_dtype is not None:
        out = base.to(out_dtype) if base is not None else torch.zeros(shape, dtype=out_dtype, device=d.device)
    n_h = 1 if out is None else triton.cdiv(hd, _DW_BH)
    if by_row.g:
        grid = (max(1, min(by_row.g, _DW_PER_SM * sm_count(d.device))), n_h)
        _dw_kernel[grid](by_row.run_start, by_row.run_row, by_row.n_runs, d, by_row.rows, by_row.h,
                         base if base is not None else d, out if out is not None else d, db if db is not None else d,
                         by_row.g, hd, by_row.h.stride(0), 0 if base is None else base.stride(0),
                         0 if out is None else out.stride(0), HAS_BASE=base is not None, HAS_DW=out is not None,
                         HAS_DB=db is not None, BP=_DW_BP, BH=_DW_BH, num_warps=_DW_WARPS)
    return out


GATHERED = GatheredRows("triton", logits, hidden_grad, weight_grad)
