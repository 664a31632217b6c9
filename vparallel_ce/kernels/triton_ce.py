r"""Triton kernels for the two per-chunk steps of :mod:`vparallel_ce.stats`.

* :func:`local_stats` -- ONE read of a ``[c, W]`` block of logits (bf16/fp16/fp32) per call: one
  program per row walks the row in ``BLOCK``-wide tiles with an online max / sum-exp in fp32, and
  also returns the target logit (one scalar load) and, with label smoothing, ``sum_j z_j``.
* :func:`grad_logits` -- one read of the logits, one write of the gradient in the logits' dtype.
* :func:`grad_logits_` -- the same, written over the logits (the op must own that buffer: the
  ``linear_cross_entropy`` schedules' per-chunk logits are temporaries). Each element is read and
  then written by the same program at the same address, so in place is race-free.

Same signatures and semantics as the torch reference (softcap, label smoothing, z-loss, ignored
rows via ``gscale == 0``, empty shards of width 0). Inputs the kernels do not cover (fp64, CPU
tensors outside the Triton interpreter) fall back to the torch versions.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import torch
import triton
import triton.language as tl

from .. import stats

__all__ = ["OPS", "local_stats", "grad_logits", "grad_logits_"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _covered(x: torch.Tensor) -> bool:
    return x.dtype in _DTYPES and x.dim() == 2 and (x.is_cuda or _interpreting())


@triton.jit
def _tanh(y):
    # tanh(y) = 1 - 2 / (exp(2y) + 1): exact limits at +-inf, no libdevice (runs in the interpreter)
    return 1.0 - 2.0 / (tl.exp(2.0 * y) + 1.0)


@triton.jit
def _stats_kernel(
    X, stride_x, T, OWN, MAX, SUMEXP, TGT, SUM, W, cap, inv_cap,
    HAS_CAP: tl.constexpr, SMOOTH: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = X + row * stride_x
    cols = tl.arange(0, BLOCK)
    m = float("-inf")
    s = 0.0
    tot = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, W, BLOCK):
        idx = start + cols
        mask = idx < W
        x = tl.load(base + idx, mask=mask, other=0.0).to(tl.float32)
        if HAS_CAP:
            x = cap * _tanh(x * inv_cap)
        if SMOOTH:
            tot += tl.where(mask, x, 0.0)
        z = tl.where(mask, x, float("-inf"))
        m_new = tl.maximum(m, tl.max(z, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), axis=0)
        m = m_new
    t = tl.load(T + row)
    own = tl.load(OWN + row) != 0
    xt = tl.load(base + t).to(tl.float32)
    if HAS_CAP:
        xt = cap * _tanh(xt * inv_cap)
    tl.store(MAX + row, m)
    tl.store(SUMEXP + row, s)
    tl.store(TGT + row, tl.where(own, xt, 0.0))
    if SMOOTH:
        tl.store(SUM + row, tl.sum(tot, axis=0))
    else:
        tl.store(SUM + row, 0.0)


@triton.jit
def _grad_kernel(
    X, stride_x, D, stride_d, T, OWN, LSE, G, W, cap, inv_cap, zl2, smooth_term, one_minus_eps,
    HAS_CAP: tl.constexpr, ZLOSS: tl.constexpr, SMOOTH: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    xb = X + row * stride_x
    db = D + row * stride_d
    cols = tl.arange(0, BLOCK)
    lse = tl.load(LSE + row).to(tl.float32)
    g = tl.load(G + row).to(tl.float32)
    coef = g
    if ZLOSS:
        coef = g * (1.0 + zl2 * lse)
    t = tl.load(T + row)
    hit = tl.where(tl.load(OWN + row) != 0, g * one_minus_eps, 0.0)
    sub = g * smooth_term
    for start in range(0, W, BLOCK):
        idx = start + cols
        mask = idx < W
        x = tl.load(xb + idx, mask=mask, other=0.0).to(tl.float32)
        z = x
        if HAS_CAP:
            z = cap * _tanh(x * inv_cap)
        d = tl.exp(z - lse) * coef
        if SMOOTH:
            d = d - sub
        d = tl.where(idx == t, d - hit, d)
        if HAS_CAP:
            r = z * inv_cap
            d = d * (1.0 - r * r)
        tl.store(db + idx, d.to(D.dtype.element_ty), mask=mask)


def _launch_cfg(width: int, elt: int):
    block = min(triton.next_power_of_2(max(width, 16)), 4096 if elt <= 2 else 2048)
    warps = 8 if block >= 2048 else (4 if block >= 512 else 2)
    return block, warps


def _rowwise(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def local_stats(x: torch.Tensor, local_target: torch.Tensor, owned: torch.Tensor, spec) -> stats.ChunkStats:
    """Drop-in for :func:`vparallel_ce.stats.local_stats`."""
    c, width = x.shape if x.dim() == 2 else (0, 0)
    if not _covered(x) or width == 0 or c == 0:
        return stats.local_stats(x, local_target, owned, spec)
    x = _rowwise(x)
    f32 = dict(dtype=torch.float32, device=x.device)
    m, se, tg, sm = (torch.empty(c, **f32) for _ in range(4))
    own = owned.contiguous().view(torch.int8) if owned.dtype == torch.bool else owned.contiguous()
    block, warps = _launch_cfg(width, x.element_size())
    cap = float(spec.softcap) if spec.softcap is not None else 1.0
    _stats_kernel[(c,)](
        x, x.stride(0), local_target.contiguous(), own, m, se, tg, sm, width, cap, 1.0 / cap,
        HAS_CAP=spec.softcap is not None, SMOOTH=spec.label_smoothing > 0, BLOCK=block, num_warps=warps,
    )
    return stats.ChunkStats(m, se, tg, sm, owned.to(torch.float32))


def _grad(x, out, local_target, owned, lse, gscale, spec):
    c, width = x.shape
    own = owned.contiguous().view(torch.int8) if owned.dtype == torch.bool else owned.contiguous()
    block, warps = _launch_cfg(width, x.element_size())
    cap = float(spec.softcap) if spec.softcap is not None else 1.0
    eps = float(spec.label_smoothing)
    _grad_kernel[(c,)](
        x, x.stride(0), out, out.stride(0), local_target.contiguous(), own,
        lse.to(torch.float32).contiguous(), gscale.to(torch.float32).contiguous(), width, cap, 1.0 / cap,
        2.0 * float(spec.z_loss), eps / spec.vocab_size, 1.0 - eps,
        HAS_CAP=spec.softcap is not None, ZLOSS=spec.z_loss > 0, SMOOTH=eps > 0, BLOCK=block, num_warps=warps,
    )
    return out


def grad_logits(x, local_target, owned, lse, gscale, spec, out_dtype=None) -> torch.Tensor:
    """Drop-in for :func:`vparallel_ce.stats.grad_logits`."""
    out_dtype = out_dtype or x.dtype
    if not _covered(x) or out_dtype not in _DTYPES or x.shape[0] == 0 or x.shape[1] == 0:
        return stats.grad_logits(x, local_target, owned, lse, gscale, spec, out_dtype)
    x = _rowwise(x)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    return _grad(x, out, local_target, owned, lse, gscale, spec)


def grad_logits_(x, local_target, owned, lse, gscale, spec) -> torch.Tensor:
    """:func:`grad_logits` written over ``x`` (in the logits' dtype); returns ``x``."""
    if not _covered(x) or x.stride(-1) != 1 or x.shape[0] == 0 or x.shape[1] == 0:
        return x.copy_(stats.grad_logits(x, local_target, owned, lse, gscale, spec))
    return _grad(x, x, local_target, owned, lse, gscale, spec)


OPS = SimpleNamespace(name="triton", local_stats=local_stats, grad_logits=grad_logits, grad_logits_=grad_logits_)
