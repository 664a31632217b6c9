r"""GEMMs whose every output row depends on its own input row alone (Triton): what
``batch_invariant=True`` runs its lm_head GEMMs with on a GPU (:mod:`vparallel_ce.invariant`).

* :func:`logits` -- ``x = h w^T (+ b)``, ``h [c, H]``, ``w [V, H]``: the logits, in ``h``'s dtype or
  fp32 (the accumulator as it is, over two halves of ``H`` as :func:`vparallel_ce.gemm.logits`
  makes fp32 logits);
* :func:`add_rows_mm_` -- ``out += a b``, ``a [c, V]``, ``b [V, H]``, ``out`` fp32 (or ``out = a b``
  rounded once into ``out``'s dtype): the hidden gradient ``dh += dx W``, a sum over the vocab.

A GEMM library picks its kernel by shape: the tile sizes, and split-K (the sum over ``K`` cut into
pieces added afterwards) for few rows, so the order of a row's sum can change with the number of
rows. Here one fixed :class:`~.tiles.TileConfig` serves every shape: each ``BLOCK_M x BLOCK_N``
output tile is one program's fp32 accumulator over the whole of ``K`` in ``BLOCK_K`` steps, in
order, with no split-K and no atomics. An output element is then the same sequence of MMA
instructions over the same ``K`` steps wherever its row sits -- in which tile, at which position in
it, in which program -- and the kernels compile once per config (``c`` is not specialised on).

The one input that could change the config is how the operands are loaded: TMA (tensor
descriptors, 16-byte aligned base and row stride) or masked loads, which take narrower tiles. A row
block of the hidden states that is not aligned is copied (:func:`aligned`), so which loads run
depends only on ``H``, ``V`` and the weight, never on where a chunk's rows start.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import triton
import triton.language as tl

from .fused_linear import _loop_tile, _store_tile, _tile_coords
from .tiles import TensorDescriptor, TileConfig, _capability, _Launch, _tma_ok, covered, loads, precision
from .triton_ce import _interpreting

__all__ = ["CONFIGS", "aligned", "covers", "logits", "add_rows_mm_"]

#: The one config of each kernel. ``logits``: the fused kernels' "keep" config (one program per
#: tile; the logits stored with TMA in 16-bit, with plain stores in fp32, whose 128 x 256 tile would
#: not fit the shared memory beside the operands'). ``rows``: ``dh`` tiles of 128 rows x 256 of
#: ``H``, each a long sum over the vocab.
CONFIGS = {"logits": TileConfig(), "rows": TileConfig(num_stages=3, num_warps=8)}

# fp32 logits: H split in two halves from this length on (gemm._SPLIT_K, the same reason)
_SPLIT_K = 2048


@triton.jit(do_not_specialize=["c", "V", "n_prog"])  # one binary per config for every shape
def _logits_kernel(
    H_, W_, X_, B, c, V, K, s_hm, s_wn, s_xm, n_prog,
    HAS_BIAS: tl.constexpr, ACC: tl.constexpr, TMA: tl.constexpr, TMA_STORE: tl.constexpr, PREC: tl.constexpr,
    SPLIT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    FLATTEN: tl.constexpr, WS: tl.constexpr,
):
    pid = tl.program_id(0)
    tile_e = pid - n_prog
    num_tiles = tl.cdiv(c, BM) * tl.cdiv(V, BN)
    for tile in tl.range(pid, num_tiles, n_prog, flatten=FLATTEN, warp_specialize=WS):
        x, tile_e, off_m, off_n, _ = _loop_tile(H_, W_, B, tile, tile_e, n_prog, c, V, K, s_hm, s_wn, HAS_BIAS,
                                                BM, BN, BK, GROUP_M, TMA, PREC)
        if ACC:  # the earlier half of K's sum, added with round-to-nearest (plain stores: no TMA store)
            rows = tl.arange(0, BM)
            cols = tl.arange(0, BN)
            ptr = X_ + off_m.to(tl.int64) * s_xm + off_n + (rows[:, None] * s_xm + cols[None, :])
            mask = (rows < c - off_m)[:, None] & (cols < V - off_n)[None, :]
            x += tl.load(ptr, mask=mask, other=0.0)
        _store_tile(X_, x, off_m, off_n, c, V, s_xm, BM, BN, TMA_STORE, SPLIT)


@triton.jit
def _rows_tile(A_, B_, off_m, off_n, M, N, K, s_am, s_bk,
               BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, TMA: tl.constexpr, PREC: tl.constexpr):
    """fp32 ``a[off_m:+BM] @ b[:, off_n:+BN]`` with ``b`` ``[K, N]`` row-major; out-of-range rows /
    columns come out as garbage that is never stored (clamped), out-of-range ``K`` as 0."""
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    if TMA:
        for k in range(0, tl.cdiv(K, BK)):
            a = A_.load([off_m, k * BK])
            b = B_.load([k * BK, off_n])
            acc = tl.dot(a, b, acc, input_precision=PREC)
    else:
        rm = tl.arange(0, BM)
        rn = tl.arange(0, BN)
        rk = tl.arange(0, BK)
        rm = tl.where(rm < M - off_m, rm, 0)
        rn = tl.where(rn < N - off_n, rn, 0)
        a_ptr = A_ + off_m.to(tl.int64) * s_am + (rm[:, None] * s_am + rk[None, :])
        b_ptr = B_ + off_n + (rk[:, None] * s_bk + rn[None, :])
        for k in range(0, tl.cdiv(K, BK)):
            left = K - k * BK
            a = tl.load(a_ptr, mask=(rk < left)[None, :], other=0.0)
            b = tl.load(b_ptr, mask=(rk < left)[:, None], other=0.0)
            acc = tl.dot(a, b, acc, input_precision=PREC)
            a_ptr += BK
            b_ptr += BK * s_bk
    return acc


@triton.jit(do_not_specialize=["M"])
def _add_rows_kernel(A_, B_, O_, M, N, K, s_am, s_bk, s_om, ACC: tl.constexpr, TMA: tl.constexpr,
                     PREC: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                     GROUP_M: tl.constexpr):
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    pm, pn = _tile_coords(tl.program_id(0), num_m, num_n, GROUP_M)
    off_m = pm * BM
    off_n = pn * BN
    acc = _rows_tile(A_, B_, off_m, off_n, M, N, K, s_am, s_bk, BM, BN, BK, TMA, PREC)
    rows = tl.arange(0, BM)
    cols = tl.arange(0, BN)
    ptr = O_ + off_m.to(tl.int64) * s_om + off_n + (rows[:, None] * s_om + cols[None, :])
    mask = (rows < M - off_m)[:, None] & (cols < N - off_n)[None, :]
    if ACC:  # the sum so far, in fp32
        acc += tl.load(ptr, mask=mask, other=0.0)
    tl.store(ptr, acc.to(O_.dtype.element_ty), mask=mask)  # (else rounded once into out's dtype)


# --------------------------------------------------------------------------------------------- host


def covers(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether these kernels take operands of this device and dtype: bf16/fp16 on a CUDA GPU with
    tensor cores (sm80+; an fp32 GEMM stays with cuBLAS tile by tile), any of bf16/fp16/fp32 under
    ``TRITON_INTERPRET=1``."""
    if _interpreting():
        return dtype in (torch.bfloat16, torch.float16, torch.float32)
    return device.type == "cuda" and dtype in (torch.bfloat16, torch.float16) and _capability(device) >= (8, 0)


def aligned(x: torch.Tensor) -> torch.Tensor:
    """``x`` [rows, K], or a contiguous copy where its base or row stride is not 16-byte aligned
    (a chunk's rows at an odd offset): TMA then applies to every block of rows alike, or, where no
    copy can be aligned (``K`` times the element size not a multiple of 16), to none."""
    if x.shape[0] == 0 or _tma_ok(x):
        return x
    return x.clone(memory_format=torch.contiguous_format)


def _launch_logits(h, w, b, out_dtype, add_to=None):
    """One logits kernel: a new ``[c, V]`` output in ``out_dtype`` (row stride rounded up to 16
    elements), or the product added to ``add_to`` (fp32)."""
    cfg = CONFIGS["logits"]
    if add_to is not None or out_dtype == torch.float32:
        cfg = replace(cfg, tma_store=False)
    L = _Launch(h, w, cfg)
    if add_to is None:
        out, x_arg, ld = L.output(out_dtype)
    else:
        out = x_arg = add_to
        ld = add_to.stride(0)
    _logits_kernel[(L.n_prog,)](
        L.h_arg, L.w_arg, x_arg, b if b is not None else out, L.c, L.V, L.K, L.h.stride(0), L.w.stride(0), ld,
        L.n_prog, HAS_BIAS=b is not None, ACC=add_to is not None, **L.meta,
    )
    return out


def logits(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, wide: torch.dtype | None = None) -> torch.Tensor:
    """``h w^T + b`` (``[c, V]``, a view whose row stride is ``V`` rounded up to 16 elements) in
    ``h``'s dtype, or (``wide``: fp32 for 16-bit operands) the GEMM's fp32 accumulator, summed over
    two halves of ``H`` from :data:`_SPLIT_K` on (the second half added to the first with
    round-to-nearest, as :func:`vparallel_ce.gemm.logits` does with cuBLAS) and the bias added in
    fp32 after. Row ``i`` depends on ``h[i]``, ``w`` and ``b`` alone."""
    c, k, v = h.shape[0], h.shape[1], w.shape[0]
    if c == 0 or v == 0 or k == 0 or not covered(h, w):  # nothing to sum, or not these kernels' inputs
        out = wide or h.dtype
        x = torch.mm(h.to(out), w.to(out).t()) if k else h.new_zeros((c, v), dtype=out)
        return x if b is None else x + b.to(out)
    h = aligned(h)
    b = None if b is None else b.contiguous()
    if wide is None or wide == h.dtype:
        return _launch_logits(h, w, b, h.dtype)
    if k < _SPLIT_K:
        x = _launch_logits(h, w, None, wide)
    else:
        half = k // 2
        x = _launch_logits(h[:, :half], w[:, :half], None, wide)
        _launch_logits(aligned(h[:, half:]), w[:, half:], None, wide, add_to=x)
    if b is not None:
        x += b.to(wide)
    return x


def add_rows_mm_(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, accumulate: bool = True) -> None:
    """``out += a @ b`` for fp32 ``out [M, N]``, ``a [M, K]`` and ``b [K, N]`` (row-major) of one
    16-bit or fp32 dtype: each output tile one program's fp32 sum over all of ``K`` in order, added
    to ``out`` once; ``accumulate=False``: ``out = a @ b`` in ``out``'s dtype (16-bit too), rounded
    once -- the bits of the fp32 product cast after. Row ``i`` of the product depends on ``a[i]``
    and ``b`` alone."""
    m, k = a.shape
    n = b.shape[1]
    if m == 0 or n == 0 or k == 0:
        if not accumulate:
            out.zero_()
        return
    if not covered(a, b.t()):
        prod = torch.mm(a.to(torch.float32), b.to(torch.float32))
        out.copy_(out + prod if accumulate else prod)
        return
    if a.stride(1) != 1:
        a = a.contiguous()
    if b.stride(1) != 1:
        b = b.contiguous()
    if not _tma_ok(a) and (a.stride(0) * a.element_size()) % 16 != 0:
        # an odd-width gradient of a fresh buffer: into one whose row stride is rounded up to 16
        # elements, as the kernels' own outputs are, so TMA applies to it as to theirs
        ld = -(-k // 16) * 16
        a = torch.empty((m, ld), dtype=a.dtype, device=a.device)[:, :k].copy_(a)
    a = aligned(a)
    cfg, tma = loads(CONFIGS["rows"], a, b)
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    if tma:
        a_arg = TensorDescriptor(a, [m, k], [a.stride(0), 1], [bm, bk])
        b_arg = TensorDescriptor(b, [k, n], [b.stride(0), 1], [bk, bn])
    else:
        a_arg, b_arg = a, b
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    _add_rows_kernel[grid](a_arg, b_arg, out, m, n, k, a.stride(0), b.stride(0), out.stride(0), ACC=accumulate, TMA=tma,
                           PREC=precision(a), BM=bm, BN=bn, BK=bk, GROUP_M=cfg.group_m,
                           num_warps=cfg.num_warps, num_stages=cfg.num_stages)

