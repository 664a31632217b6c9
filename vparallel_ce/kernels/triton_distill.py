r"""Triton kernels for the distillation ops' local passes over a dense teacher's and the student's
logits (:class:`vparallel_ce.divergence.DistillSteps`): one program per token row walks the row of
both ``[c, V_loc]`` logits in ``BLOCK``-wide tiles, all arithmetic in fp32.

* :func:`maxima` -- one read of both rows: ``[max a, max b (, max s)]``;
* :func:`sums` -- one read: ``[S_a, S_b (, F or R) (, S_s)]`` relative to the global maxima;
* :func:`mixture_sums` -- one read (JSD only): ``[P, Q]``;
* :func:`grad` -- one read, one write of the student logits' gradient in the requested dtype.

The torch versions in :mod:`vparallel_ce.divergence` are the specification: the same formulas in
the same order (on a GPU the compiler may fuse a product and a difference into one FMA, so with
``T != 1`` and logits near 1e4 a sum can differ from torch's by ~1e-4 relative, within the fp32
rounding of ``z / T`` itself), the same special values -- a masked (-inf) logit adds exactly 0, a nan logit makes
its row's maximum and sums nan, a row whose weight is exactly 0 gets an exact 0 gradient. Eager torch runs each formula as its own pass over an fp32
copy of the chunk (about 25 passes for the forward KL's statistics and gradient); here each step
is one pass over the 16-bit logits. Inputs the kernels do not cover (fp64, CPU tensors outside
the Triton interpreter, empty chunks or shards) run the torch versions.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .. import divergence
from ..divergence import Divergence, DistillSteps
from .config import interpreting

__all__ = ["STEPS", "maxima", "sums", "mixture_sums", "grad"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_KIND = {Divergence.FORWARD_KL: 0, Divergence.REVERSE_KL: 1, Divergence.JSD: 2}


def _covered(*xs: torch.Tensor) -> bool:
    return all(x.dtype in _DTYPES and x.dim() == 2 and (x.is_cuda or interpreting()) for x in xs) \
        and xs[0].shape[0] > 0 and xs[0].shape[1] > 0


def _rowwise(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _f32(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float32).contiguous()


def _block(width: int, cap: int) -> tuple[int, int]:
    block = min(triton.next_power_of_2(max(width, 16)), cap)
    return block, (8 if block >= 2048 else 4 if block >= 512 else 2)


def _log_weights(beta: float) -> tuple[float, float]:
    """``log beta``, ``log (1 - beta)`` of the JSD's mixture (-inf at the ends), as divergence's."""
    return (math.log(beta) if beta > 0 else float("-inf"), math.log1p(-beta) if beta < 1 else float("-inf"))


@triton.jit
def _scaled(x, inv_t, HAS_T: tl.constexpr):
    """``x / T`` in fp32, as a product (divergence's ``_scaled``)."""
    x = x.to(tl.float32)
    if HAS_T:
        x = x * inv_t
    return x


@triton.jit
def _shift(m):
    """``finite_shift``: the max, or 0 where it is -inf (every logit masked)."""
    return tl.where(m == float("-inf"), 0.0, m)


@triton.jit
def _logaddexp(x, y):
    """``log(e^x + e^y)``: exactly the larger where the smaller is -inf (both -inf: -inf), nan where
    either is nan (``tl.maximum`` may drop a nan operand, so it is put back)."""
    hi = tl.maximum(x, y)
    lo = tl.minimum(x, y)
    r = tl.where(lo == float("-inf"), hi, hi + tl.log(1.0 + tl.exp(lo - hi)))
    return tl.where((x != x) | (y != y), x + y, r)


@triton.jit
def _nan_max(acc, x):
    """Elementwise running max that keeps a nan (as ``amax``; ``tl.maximum`` may drop one)."""
    return tl.where((acc != acc) | (x != x), float("nan"), tl.maximum(acc, x))


@triton.jit
def _row_max(acc):
    return tl.where(tl.max(tl.where(acc != acc, 1, 0), axis=0) > 0, float("nan"), tl.max(acc, axis=0))


@triton.jit
def _maxima_kernel(S, stride_s, T, stride_t, OUT, c, W, inv_t, HAS_T: tl.constexpr, HARD_APART: tl.constexpr,
                   BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ma = tl.full([BLOCK], float("-inf"), tl.float32)
    mb = tl.full([BLOCK], float("-inf"), tl.float32)
    mh = tl.full([BLOCK], float("-inf"), tl.float32)
    for start in range(0, W, BLOCK):
        idx = start + cols
        mask = idx < W
        x = tl.load(S + row * stride_s + idx, mask=mask, other=float("-inf")).to(tl.float32)
        a = _scaled(tl.load(T + row * stride_t + idx, mask=mask, other=float("-inf")), inv_t, HAS_T)
        ma = _nan_max(ma, a)
        mb = _nan_max(mb, _scaled(x, inv_t, HAS_T))
        if HARD_APART:
            mh = _nan_max(mh, x)
    tl.store(OUT + row, _row_max(ma))
    tl.store(OUT + c + row, _row_max(mb))
    if HARD_APART:
        tl.store(OUT + 2 * c + row, _row_max(mh))


@triton.jit
def _sums_kernel(S, stride_s, T, stride_t, M, OUT, c, W, inv_t, HAS_T: tl.constexpr, KIND: tl.constexpr,
                 HARD_APART: tl.constexpr, H_ROW: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    sa = _shift(tl.load(M + row))
    sb = _shift(tl.load(M + c + row))
    acc_a = tl.zeros([BLOCK], dtype=tl.float32)
    acc_b = tl.zeros([BLOCK], dtype=tl.float32)
    acc_d = tl.zeros([BLOCK], dtype=tl.float32)
    acc_h = tl.zeros([BLOCK], dtype=tl.float32)
    if HARD_APART:
        sh = _shift(tl.load(M + 2 * c + row))
    for start in range(0, W, BLOCK):
        idx = start + cols
        mask = idx < W
        x = tl.load(S + row * stride_s + idx, mask=mask, other=0.0).to(tl.float32)
        u = _scaled(tl.load(T + row * stride_t + idx, mask=mask, other=0.0), inv_t, HAS_T) - sa
        v = _scaled(x, inv_t, HAS_T) - sb
        eu = tl.where(mask, tl.exp(u), 0.0)
        ev = tl.where(mask, tl.exp(v), 0.0)
        acc_a += eu
        acc_b += ev
        # a zero weight's term is exactly 0 (a masked logit: 0 * -inf); a nan weight stays nan
        if KIND == 0:
            acc_d += tl.where(eu == 0, 0.0, eu * (u - v))
        elif KIND == 1:
            acc_d += tl.where(ev == 0, 0.0, ev * (v - u))
        if HARD_APART:
            acc_h += tl.where(mask, tl.exp(x - sh), 0.0)
    tl.store(OUT + row, tl.sum(acc_a, axis=0))
    tl.store(OUT + c + row, tl.sum(acc_b, axis=0))
    if KIND != 2:
        tl.store(OUT + 2 * c + row, tl.sum(acc_d, axis=0))
    if HARD_APART:
        tl.store(OUT + H_ROW * c + row, tl.sum(acc_h, axis=0))


@triton.jit
def _mixture_kernel(S, stride_s, T, stride_t, TMAX, TLOGS, SMAX, SLOGS, OUT, c, W, inv_t, log_beta, log_1mb,
                    HAS_T: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    sa, la = _shift(tl.load(TMAX + row)), tl.load(TLOGS + row)
    sb, lb = _shift(tl.load(SMAX + row)), tl.load(SLOGS + row)
    acc_p = tl.zeros([BLOCK], dtype=tl.float32)
    acc_q = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, W, BLOCK):
        idx = start + cols
        mask = idx < W
        log_p = (_scaled(tl.load(T + row * stride_t + idx, mask=mask, other=0.0), inv_t, HAS_T) - sa) - la
        log_q = (_scaled(tl.load(S + row * stride_s + idx, mask=mask, other=0.0), inv_t, HAS_T) - sb) - lb
        log_m = _logaddexp(log_p + log_beta, log_q + log_1mb)
        p = tl.where(mask, tl.exp(log_p), 0.0)
        q = tl.where(mask, tl.exp(log_q), 0.0)
        acc_p += tl.where(p == 0, 0.0, p * (log_p - log_m))
        acc_q += tl.where(q == 0, 0.0, q * (log_q - log_m))
    tl.store(OUT + row, tl.sum(acc_p, axis=0))
    tl.store(OUT + c + row, tl.sum(acc_q, axis=0))


@triton.jit
def _grad_kernel(S, stride_s, T, stride_t, D, stride_d, TMAX, TLOGS, SMAX, SLOGS, INNER, HMAX, HLOGS, WGT, TGT, W,
                 inv_t, temp, coef, hard_weight, log_beta, log_1mb, HAS_T: tl.constexpr, KIND: tl.constexpr,
                 HARD: tl.constexpr, HARD_APART: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    sa, la = _shift(tl.load(TMAX + row)), tl.load(TLOGS + row)
    sb, lb = _shift(tl.load(SMAX + row)), tl.load(SLOGS + row)
    w = tl.load(WGT + row)
    inner = 0.0
    if KIND != 0:
        inner = tl.load(INNER + row)
    sh = 0.0
    lh = 0.0
    if HARD_APART:
        sh, lh = _shift(tl.load(HMAX + row)), tl.load(HLOGS + row)
    tgt = tl.load(TGT + row)  # -1 where this rank does not own the target
    for start in range(0, W, BLOCK):
        idx = start + cols
        mask = idx < W
        x = tl.load(S + row * stride_s + idx, mask=mask, other=0.0).to(tl.float32)
        log_p = (_scaled(tl.load(T + row * stride_t + idx, mask=mask, other=0.0), inv_t, HAS_T) - sa) - la
        log_q = (_scaled(x, inv_t, HAS_T) - sb) - lb
        q = tl.exp(log_q)
        if KIND == 0:
            g = (q - tl.exp(log_p)) * temp
        elif KIND == 1:
            g = tl.where(q == 0, 0.0, q * (log_q - log_p - inner)) * temp
        else:
            log_m = _logaddexp(log_p + log_beta, log_q + log_1mb)
            g = tl.where(q == 0, 0.0, q * (log_q - log_m - inner)) * coef
        if HARD:
            if HARD_APART:
                g = g + hard_weight * tl.exp((x - sh) - lh)
            else:
                g = g + hard_weight * q
            g = tl.where(idx == tgt, g - hard_weight, g)
        d = tl.where(w == 0, 0.0, g * w)  # an ignored row: exactly 0, whatever its logits hold
        tl.store(D + row * stride_d + idx, d.to(D.dtype.element_ty), mask=mask)


def maxima(s: torch.Tensor, t: torch.Tensor, spec) -> torch.Tensor:
    """Drop-in for :func:`vparallel_ce.divergence.local_maxima`."""
    if not _covered(s, t):
        return divergence.local_maxima(s, t, spec)
    s, t = _rowwise(s), _rowwise(t)
    c, width = s.shape
    out = torch.empty(3 if spec.hard_apart else 2, c, dtype=torch.float32, device=s.device)
    block, warps = _block(width, 2048)
    _maxima_kernel[(c,)](s, s.stride(0), t, t.stride(0), out, c, width, 1.0 / spec.temperature,
                         HAS_T=spec.temperature != 1.0, HARD_APART=spec.hard_apart, BLOCK=block, num_warps=warps)
    return out


def sums(s: torch.Tensor, t: torch.Tensor, m: torch.Tensor, spec) -> torch.Tensor:
    """Drop-in for :func:`vparallel_ce.divergence.local_sums`."""
    if not _covered(s, t):
        return divergence.local_sums(s, t, m, spec)
    s, t = _rowwise(s), _rowwise(t)
    c, width = s.shape
    kind = _KIND[spec.divergence]
    h_row = 2 if spec.divergence is Divergence.JSD else 3
    out = torch.empty(h_row + spec.hard_apart, c, dtype=torch.float32, device=s.device)
    block, warps = _block(width, 2048)
    _sums_kernel[(c,)](s, s.stride(0), t, t.stride(0), _f32(m), out, c, width, 1.0 / spec.temperature,
                       HAS_T=spec.temperature != 1.0, KIND=kind, HARD_APART=spec.hard_apart, H_ROW=h_row, BLOCK=block,
                       num_warps=warps)
    return out


def mixture_sums(s: torch.Tensor, t: torch.Tensor, st, spec) -> torch.Tensor:
    """Drop-in for :func:`vparallel_ce.divergence.local_mixture_sums`."""
    if not _covered(s, t):
        return divergence.local_mixture_sums(s, t, st, spec)
    s, t = _rowwise(s), _rowwise(t)
    c, width = s.shape
    out = torch.empty(2, c, dtype=torch.float32, device=s.device)
    block, warps = _block(width, 2048)
    _mixture_kernel[(c,)](s, s.stride(0), t, t.stride(0), _f32(st.t_max), _f32(st.t_log_s), _f32(st.s_max),
                          _f32(st.s_log_s), out, c, width, 1.0 / spec.temperature, *_log_weights(spec.beta),
                          HAS_T=spec.temperature != 1.0, BLOCK=block, num_warps=warps)
    return out


def grad(s: torch.Tensor, t: torch.Tensor, local_t: torch.Tensor, owned: torch.Tensor, st, weight: torch.Tensor,
         spec, out_dtype: torch.dtype | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Drop-in for :func:`vparallel_ce.divergence.grad_student`."""
    out_dtype = out.dtype if out is not None else out_dtype or s.dtype
    if not _covered(s, t) or out_dtype not in _DTYPES or (out is not None and out.stride(-1) != 1):
        return divergence.grad_student(s, t, local_t, owned, st, weight, spec, out_dtype, out)
    s, t = _rowwise(s), _rowwise(t)
    c, width = s.shape
    if out is None:
        out = torch.empty(s.shape, dtype=out_dtype, device=s.device)
    t_max = _f32(st.t_max)
    inner = t_max if st.inner is None else _f32(st.inner)  # dummy pointers where a kind has none
    h_max = t_max if st.hard_max is None else _f32(st.hard_max)
    h_log = t_max if st.hard_log_s is None else _f32(st.hard_log_s)
    tgt = torch.where(owned, local_t, -1).to(torch.int64).contiguous()
    temp = float(spec.temperature)
    block, warps = _block(width, 1024)
    _grad_kernel[(c,)](s, s.stride(0), t, t.stride(0), out, out.stride(0), t_max, _f32(st.t_log_s), _f32(st.s_max),
                       _f32(st.s_log_s), inner, h_max, h_log, _f32(weight), tgt, width, 1.0 / temp, temp,
                       (1.0 - spec.beta) * temp, float(spec.hard_weight), *_log_weights(spec.beta),
                       HAS_T=temp != 1.0, KIND=_KIND[spec.divergence], HARD=spec.hard, HARD_APART=spec.hard_apart,
                       BLOCK=block, num_warps=warps)
    return out


#: The Triton local passes (the ``distill`` of the Triton :class:`~vparallel_ce.kernels.KernelBackend`).
STEPS = DistillSteps(maxima, sums, mixture_sums, grad)
