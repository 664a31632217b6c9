r"""Triton kernels for the two per-chunk steps of :mod:`vparallel_ce.stats`.

* :func:`local_stats` -- ONE read of a ``[c, W]`` block of logits (bf16/fp16/fp32) per call: one
  program per row walks the row in ``BLOCK``-wide tiles with an online max / sum-exp in fp32, and
  also returns the target logit (one scalar load) and, with label smoothing, ``sum_j z_j``.
* :func:`grad_logits` -- one read of the logits, one write of the gradient in the logits' dtype.
* :func:`grad_logits_` -- the same, written over the logits (the op must own that buffer: the
  ``linear_cross_entropy`` schedules' per-chunk logits are temporaries). Each element is read and
  then written by the same program at the same address, so in place is race-free.
* :func:`loss_stats_grad_` -- both, for a rank holding the whole vocab (no exchange between them):
  one kernel maps a row's target, reads the row for its statistics and loss and writes the loss'
  gradient over it (for an upstream gradient of 1), re-reading the row mostly from L2.
* :func:`scale_rows` -- ``g * x`` with the product in fp32 (the upstream gradient applied to a
  gradient made for 1).

Same signatures and semantics as the torch reference (softcap, label smoothing, z-loss, ignored
rows via ``gscale == 0``, empty shards of width 0). Inputs the kernels do not cover (fp64, CPU
tensors outside the Triton interpreter) fall back to the torch versions.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import stats, top1
from . import block_merge, gathered_rows, triton_distill
from .backend import KernelBackend
from .config import interpreting

__all__ = ["OPS", "local_stats", "grad_logits", "grad_logits_", "loss_stats_grad_", "scale_rows"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


_interpreting = interpreting  # the one definition is the dispatcher's (kernels/__init__.py)


def _covered(x: torch.Tensor) -> bool:
    return x.dtype in _DTYPES and x.dim() == 2 and (x.is_cuda or _interpreting())


@triton.jit
def _tanh(y):
    # tanh(y) = 1 - 2 / (exp(2y) + 1): exact limits at +-inf, no libdevice (runs in the interpreter)
    return 1.0 - 2.0 / (tl.exp(2.0 * y) + 1.0)


@triton.jit
def _z(x, cap, inv_cap, inv_t, HAS_CAP: tl.constexpr, HAS_T: tl.constexpr):
    """The transformed logits ``z = s tanh(x / s) / T`` of :mod:`vparallel_ce.stats`."""
    if HAS_CAP:
        x = cap * _tanh(x * inv_cap)
    if HAS_T:
        x = x * inv_t
    return x


@triton.jit
def _row_stats(base, W, cap, inv_cap, inv_t, HAS_CAP: tl.constexpr, HAS_T: tl.constexpr, SMOOTH: tl.constexpr,
               ENTROPY: tl.constexpr, TOP1: tl.constexpr, BLOCK: tl.constexpr):
    """One row's ``(max, sum exp(z - max), sum exp(z - max) (z - max), sum z, largest logit, its
    column)`` in one read (online softmax in fp32; the sums are 0 unless ``ENTROPY`` / ``SMOOTH``;
    the last two, of the logits as loaded, unless ``TOP1``: -inf and 0, a nan for a row holding
    one, the first column among equal ones as ``torch.max``)."""
    cols = tl.arange(0, BLOCK)
    m = float("-inf")
    s = 0.0
    e = 0.0  # sum_j exp(z_j - m) (z_j - m), kept relative to the running max
    tot = tl.zeros([BLOCK], dtype=tl.float32)
    best = float("-inf")
    arg = 0
    nans = 0
    for start in range(0, W, BLOCK):
        idx = start + cols
        mask = idx < W
        raw = tl.load(base + idx, mask=mask, other=0.0).to(tl.float32)
        if TOP1:  # a later tile wins only with a strictly larger logit: ties go to the first column
            shown = tl.where(mask, raw, float("-inf"))
            tile_best = tl.max(shown, axis=0)
            take = tile_best > best
            arg = tl.where(take, start + tl.argmax(shown, axis=0, tie_break_left=True), arg)
            best = tl.where(take, tile_best, best)
            nans += tl.sum(tl.where(mask & (raw != raw), 1, 0), axis=0)
        x = _z(raw, cap, inv_cap, inv_t, HAS_CAP, HAS_T)
        if SMOOTH:
            tot += tl.where(mask, x, 0.0)
        z = tl.where(mask, x, float("-inf"))
        m_new = tl.maximum(m, tl.max(z, axis=0))
        # shift by 0 while every logit so far is -inf (masked): exp(-inf) = 0, not exp(-inf + inf) = nan;
        # a nan or +inf logit makes s nan (exp(nan), exp(inf - inf)) whatever the max made of it
        m_ref = tl.where(m_new > float("-inf"), m_new, 0.0)
        alpha = tl.exp(m - m_ref)
        p = tl.exp(z - m_ref)
        if ENTROPY:
            # shift the old sum to the new max first (guard: nothing seen yet, -inf * 0)
            e = tl.where(s > 0, alpha * (e + (m - m_new) * s), 0.0)
            e += tl.sum(tl.where(p > 0, p * (z - m_new), 0.0), axis=0)  # padding / -inf logits: 0
        s = s * alpha + tl.sum(p, axis=0)
        m = m_new
    return m, s, e, tl.sum(tot, axis=0), tl.where(nans > 0, float("nan"), best), arg


@triton.jit
def _row_grad(xb, db, W, t, shift, a, b, sub, hit, cap, inv_cap, inv_t, t_over_cap, HAS_CAP: tl.constexpr,
              HAS_T: tl.constexpr, HAS_B: tl.constexpr, HAS_D: tl.constexpr, BLOCK: tl.constexpr,
              REVERSE: tl.constexpr):
    """One row's ``d obj/d x``: ``d obj/d z_j = e^{u_j} (a + b u_j) - hit [j == t] - sub`` with
    ``u_j = z_j - shift``, then the softcap / temperature chain (:class:`stats.GradCoefs`).
    ``REVERSE``: walk the row from its end (right after a statistics walk, its last tiles are the
    ones still in cache)."""
    cols = tl.arange(0, BLOCK)
    n_tiles = tl.cdiv(W, BLOCK)
    for i in range(0, n_tiles):
        if REVERSE:
            idx = (n_tiles - 1 - i) * BLOCK + cols
        else:
            idx = i * BLOCK + cols
        mask = idx < W
        z = _z(tl.load(xb + idx, mask=mask, other=0.0).to(tl.float32), cap, inv_cap, inv_t, HAS_CAP, HAS_T)
        u = z - shift
        # a -inf logit (p = 0) and a nan one (u nan) give 0 * a: nan on a valid row whose
        # statistics are nan, 0 on an ignored row (a = 0), 0 otherwise -- as stats.grad_logits
        if HAS_B:
            d = tl.where(u > float("-inf"), tl.exp(u) * (a + b * u), a * 0.0)
        else:
            d = tl.where(u > float("-inf"), tl.exp(u) * a, a * 0.0)
        if HAS_D:
            d = d - sub
        d = tl.where(idx == t, d - hit, d)
        if HAS_CAP:  # an exact 0 (an ignored row's) stays 0 where z is nan
            r = z * t_over_cap
            d = tl.where(d == 0.0, d, d * (1.0 - r * r))
        if HAS_T:
            d = d * inv_t
        tl.store(db + idx, d.to(db.dtype.element_ty), mask=mask)


@triton.jit
def _block_target(T, OWN, row, col0, W):
    """A row's target relative to a block of ``W`` columns starting at column ``col0`` of its shard:
    ``(index clamped into the block, owned by the block)`` (:func:`stats.block_targets`)."""
    t = tl.load(T + row).to(tl.int64) - col0
    own = (tl.load(OWN + row) != 0) & (t >= 0) & (t < W)
    return tl.minimum(tl.maximum(t, 0), W - 1), own


@triton.jit
def _store_row_stats(base, row, T, OWN, MAX, SUMEXP, TGT, SUM, ZEXP, W, col0, cap, inv_cap, inv_t,
                     HAS_CAP: tl.constexpr, HAS_T: tl.constexpr, SMOOTH: tl.constexpr, ENTROPY: tl.constexpr,
                     BLOCK: tl.constexpr):
    """A row's :class:`stats.ChunkStats` stored (the target logit read where the row owns it)."""
    m, s, e, tot, _, _ = _row_stats(base, W, cap, inv_cap, inv_t, HAS_CAP, HAS_T, SMOOTH, ENTROPY, False, BLOCK)
    t, own = _block_target(T, OWN, row, col0, W)
    xt = _z(tl.load(base + t).to(tl.float32), cap, inv_cap, inv_t, HAS_CAP, HAS_T)
    tl.store(MAX + row, m)
    tl.store(SUMEXP + row, s)
    tl.store(TGT + row, tl.where(own, xt, 0.0))
    tl.store(SUM + row, tot)
    if ENTROPY:
        tl.store(ZEXP + row, e)


@triton.jit
def _stats_kernel(
    X, stride_x, T, OWN, MAX, SUMEXP, TGT, SUM, ZEXP, W, col0, cap, inv_cap, inv_t,
    HAS_CAP: tl.constexpr, HAS_T: tl.constexpr, SMOOTH: tl.constexpr, ENTROPY: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    _store_row_stats(X + row * stride_x, row, T, OWN, MAX, SUMEXP, TGT, SUM, ZEXP, W, col0, cap, inv_cap, inv_t,
                     HAS_CAP, HAS_T, SMOOTH, ENTROPY, BLOCK)


@triton.jit
def _grad_kernel(
    X, stride_x, D, stride_d, T, OWN, SHIFT, CA, CB, CC, CD, W, col0, cap, inv_cap, inv_t, t_over_cap,
    HAS_CAP: tl.constexpr, HAS_T: tl.constexpr, HAS_B: tl.constexpr, HAS_D: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    b = 0.0
    if HAS_B:
        b = tl.load(CB + row).to(tl.float32)
    sub = 0.0
    if HAS_D:
        sub = tl.load(CD + row).to(tl.float32)
    t, own = _block_target(T, OWN, row, col0, W)
    hit = tl.where(own, tl.load(CC + row).to(tl.float32), 0.0)
    _row_grad(X + row * stride_x, D + row * stride_d, W, t, tl.load(SHIFT + row).to(tl.float32),
              tl.load(CA + row).to(tl.float32), b, sub, hit, cap, inv_cap, inv_t, t_over_cap, HAS_CAP, HAS_T, HAS_B,
              HAS_D, BLOCK, False)


@triton.jit
def _loss_grad_kernel(
    X, stride_x, T, ignore_index, NV, MAX, SUMEXP, TGT, SUM, LOSS, BEST, ARG, W, cap, inv_cap, inv_t, t_over_cap, zl,
    keep_t, eps, vocab, eps_v,
    HAS_CAP: tl.constexpr, HAS_T: tl.constexpr, SMOOTH: tl.constexpr, ZLOSS: tl.constexpr, MEAN: tl.constexpr,
    TOP1: tl.constexpr, BLOCK: tl.constexpr,
):
    # stats.loss_stats_grad_, a row per program: its target maps and weight r (stats.local_targets,
    # stats.token_weights), statistics and loss (stats.token_loss), then the loss coefficients for
    # r (stats.loss_grad_coefs: a = r (1 + 2 zl lse) / S, c = r (1 - eps), d = r eps / V) and the
    # gradient written over the row -- its target logit read before that
    row = tl.program_id(0).to(tl.int64)
    base = X + row * stride_x
    t = tl.load(T + row).to(tl.int64)
    valid = t != ignore_index
    own = valid & (t >= 0) & (t < W)  # an unchecked id outside the vocab owns nothing
    t = tl.minimum(tl.maximum(t, 0), W - 1)
    m, s, _, tot, best, arg = _row_stats(base, W, cap, inv_cap, inv_t, HAS_CAP, HAS_T, SMOOTH, False, TOP1, BLOCK)
    if TOP1:  # (the row's greedy token, read before its gradient is written over it)
        tl.store(BEST + row, best)
        tl.store(ARG + row, arg.to(tl.int64))
    xt = tl.where(own, _z(tl.load(base + t).to(tl.float32), cap, inv_cap, inv_t, HAS_CAP, HAS_T), 0.0)
    log_s = tl.log(s)
    # each term relative to the max, as token_loss
    loss = log_s - keep_t * (xt - m)
    if SMOOTH:
        loss = loss - eps * (tl.div_rn(tot, vocab) - m)
    if ZLOSS:
        lse = m + log_s
        loss = loss + zl * (lse * lse)
    tl.store(MAX + row, m)
    tl.store(SUMEXP + row, s)
    tl.store(TGT + row, xt)
    tl.store(SUM + row, tot)
    tl.store(LOSS + row, tl.where(valid, loss, 0.0))
    r = tl.where(valid, 1.0, 0.0)
    if MEAN:  # 1 / n_valid, rounded as torch's division, on valid rows (all ignored: the gradient 0;
        # a given count of 0 with valid rows: inf, as the mean's derivative)
        r = tl.where(valid, tl.div_rn(1.0, tl.load(NV).to(tl.float32)), 0.0)
    a = r
    if ZLOSS:
        a = r * (1.0 + 2.0 * zl * (m + log_s))
    a = tl.where(valid, a / s, 0.0)  # exactly 0 on an ignored row, whose s may be nan or 0
    _row_grad(base, base, W, t, m, a, 0.0, r * eps_v, tl.where(own, r * keep_t, 0.0), cap, inv_cap, inv_t,
              t_over_cap, HAS_CAP, HAS_T, False, SMOOTH, BLOCK, True)


@triton.jit
def _scale_rows_kernel(X, stride_x, O, stride_o, G, n, T, ignore_index, PER_ROW: tl.constexpr, MASKED: tl.constexpr,
                       BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    if PER_ROW:
        g = tl.load(G + row).to(tl.float32)
    else:
        g = tl.load(G).to(tl.float32)
    if MASKED:  # an ignored token's row keeps its value (x * 1: exact, nan stays nan)
        g = tl.where(tl.load(T + row) == ignore_index, 1.0, g)
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(O + row * stride_o + cols, (x * g).to(O.dtype.element_ty), mask=mask)


# the most tokens one program sums (4 tiles of 4096): beyond, torch's multi-block sum is faster than
# one program's loop, and two launches weigh nothing against a call's GEMMs
_MEAN_BLOCK = 4096
_MEAN_MAX = 4 * _MEAN_BLOCK


@triton.jit
def _mean_kernel(X, n, NV, OUT, BLOCK: tl.constexpr):
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n, BLOCK):
        idx = start + tl.arange(0, BLOCK)
        acc += tl.load(X + idx, mask=idx < n, other=0.0)
    # the divisor rounded to fp32 first and an IEEE division, as torch's total / n_valid.to(fp32)
    mean = tl.div_rn(tl.sum(acc, axis=0), tl.load(NV).to(tl.float32))
    slot = tl.arange(0, 2)  # a vector store (the interpreter would not store a reduced scalar alone)
    tl.store(OUT + slot, tl.where(slot == 0, mean, 0.0), mask=slot < 1)


def _launch_cfg(width: int, elt: int):
    block = min(triton.next_power_of_2(max(width, 16)), 4096 if elt <= 2 else 2048)
    warps = 8 if block >= 2048 else (4 if block >= 512 else 2)
    return block, warps


def _stats_launch_cfg(width: int, elt: int):
    """The statistics pass reduces every tile (max, sum): 4 warps per row keep those reductions
    short; 2048-wide tiles below ~100k columns (the fastest of a sweep on an H200: 3.5 TB/s at
    128256 columns, 2.1 TB/s at 16032 and 32777)."""
    block, warps = _launch_cfg(width, elt)
    if block >= 2048:
        block, warps = (block if width >= 100_000 else 2048), 4
    return block, warps


def _int8(owned: torch.Tensor) -> torch.Tensor:
    """The owned mask as the kernels read it (bool viewed as int8, contiguous)."""
    owned = owned.contiguous()
    return owned.view(torch.int8) if owned.dtype == torch.bool else owned


def _rowwise(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _transform_args(spec):
    cap = float(spec.softcap) if spec.softcap is not None else 1.0
    temp = float(spec.temperature)
    return dict(cap=cap, inv_cap=1.0 / cap, inv_t=1.0 / temp), dict(HAS_CAP=spec.softcap is not None,
                                                                     HAS_T=temp != 1.0)


def local_stats(x: torch.Tensor, local_target: torch.Tensor, owned: torch.Tensor, spec, *,
                col_offset: int | None = None, out: torch.Tensor | None = None) -> stats.ChunkStats:
    """Drop-in for :func:`vparallel_ce.stats.local_stats` (the block's targets mapped in the
    kernel, the statistics written into ``out``'s rows: one launch, no allocation; the blocks'
    statistics are then merged by :func:`.block_merge.merge_blocks`)."""
    c, width = x.shape if x.dim() == 2 else (0, 0)
    if not _covered(x) or width == 0 or c == 0 or (out is not None and not _rows_out(out, c)):
        return stats.local_stats(x, local_target, owned, spec, col_offset=col_offset, out=out)
    x = _rowwise(x)
    if out is None:
        out = torch.empty((5 if spec.entropy else 4, c), dtype=torch.float32, device=x.device)
    m, se, tg, sm = out[:4]
    zexp = out[4] if spec.entropy else sm  # a dummy pointer without entropy
    own = _int8(owned)
    block, warps = _stats_launch_cfg(width, x.element_size())
    args, flags = _transform_args(spec)
    _stats_kernel[(c,)](
        x, x.stride(0), local_target.contiguous(), own, m, se, tg, sm, zexp, width, col_offset or 0, args["cap"],
        args["inv_cap"], args["inv_t"], SMOOTH=spec.label_smoothing > 0, ENTROPY=spec.entropy, BLOCK=block,
        num_warps=warps, **flags,
    )
    return stats.ChunkStats(m, se, tg, sm, zexp if spec.entropy else None)


def _rows_out(out: torch.Tensor, c: int) -> bool:
    """Whether the kernels can write statistics into ``out``: fp32 ``[5, c]``, contiguous."""
    return out.dtype == torch.float32 and out.shape == (5, c) and out.is_contiguous()


def _grad(x, out, local_target, owned, shift, coefs, spec, col_offset):
    c, width = x.shape
    own = _int8(owned)
    block, warps = _launch_cfg(width, x.element_size())
    args, flags = _transform_args(spec)

    def f32(t):
        return t.to(torch.float32).contiguous()

    a = f32(coefs.a)
    _grad_kernel[(c,)](
        x, x.stride(0), out, out.stride(0), local_target.contiguous(), own, f32(shift), a,
        a if coefs.b is None else f32(coefs.b), f32(coefs.c), a if coefs.d is None else f32(coefs.d), width,
        col_offset or 0, args["cap"], args["inv_cap"], args["inv_t"], float(spec.temperature) / args["cap"],
        HAS_B=coefs.b is not None, HAS_D=coefs.d is not None, BLOCK=block, num_warps=warps, **flags,
    )
    return out


def grad_logits(x, local_target, owned, shift, coefs, spec, out_dtype=None, *,
                col_offset: int | None = None) -> torch.Tensor:
    """Drop-in for :func:`vparallel_ce.stats.grad_logits` (the block's targets mapped in the kernel)."""
    out_dtype = out_dtype or x.dtype
    if not _covered(x) or out_dtype not in _DTYPES or x.shape[0] == 0 or x.shape[1] == 0:
        return stats.grad_logits(x, local_target, owned, shift, coefs, spec, out_dtype, col_offset=col_offset)
    x = _rowwise(x)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    return _grad(x, out, local_target, owned, shift, coefs, spec, col_offset)


def grad_logits_(x, local_target, owned, shift, coefs, spec, *, col_offset: int | None = None) -> torch.Tensor:
    """:func:`grad_logits` written over ``x`` (in the logits' dtype); returns ``x``."""
    if not _covered(x) or x.stride(-1) != 1 or x.shape[0] == 0 or x.shape[1] == 0:
        return x.copy_(stats.grad_logits(x, local_target, owned, shift, coefs, spec, col_offset=col_offset))
    return _grad(x, x, local_target, owned, shift, coefs, spec, col_offset)


def loss_stats_grad_(x, target, n_valid, reduction, spec, *, with_top1: bool = False, block: int | None = None,
                     warps: int | None = None):
    """Drop-in for :func:`vparallel_ce.stats.loss_stats_grad_`, in ONE launch: a program per row
    maps its target, reads the row for the statistics and the loss (and with ``with_top1`` its
    largest logit and first column), then walks it back from its end (the tiles last read are the
    ones most likely still in L2) writing the gradient over it. ``block`` / ``warps``: the launch
    (default: the gradient pass's, 4096 x 8 warps in 16-bit, the fastest of a sweep on an H200 at
    all four benchmark shapes but the odd vocab's)."""
    c, width = x.shape if x.dim() == 2 else (0, 0)
    if not _covered(x) or spec.entropy or x.stride(-1) != 1 or width == 0 or c == 0:
        return stats.loss_stats_grad_(x, target, n_valid, reduction, spec, with_top1=with_top1)
    m, se, tg, sm, loss, best = torch.empty(6, c, dtype=torch.float32, device=x.device).unbind(0)  # one allocation
    arg = torch.empty(c, dtype=torch.int64, device=x.device) if with_top1 else target
    args, flags = _transform_args(spec)
    eps = float(spec.label_smoothing)
    mean = reduction == "mean"
    target = target.contiguous()
    dflt_block, dflt_warps = _launch_cfg(width, x.element_size())
    _loss_grad_kernel[(c,)](
        x, x.stride(0), target, spec.ignore_index, n_valid if mean else target, m, se, tg, sm, loss, best, arg,
        width, args["cap"], args["inv_cap"], args["inv_t"], float(spec.temperature) / args["cap"], float(spec.z_loss),
        1.0 - eps, eps, float(spec.vocab_size), eps / spec.vocab_size, SMOOTH=eps > 0, ZLOSS=spec.z_loss > 0,
        MEAN=mean, TOP1=with_top1, BLOCK=block or dflt_block, num_warps=warps or dflt_warps, **flags,
    )
    if with_top1:
        return stats.ChunkStats(m, se, tg, sm, None), loss, top1.Top1(best.double(), arg.double())
    return stats.ChunkStats(m, se, tg, sm, None), loss


def scale_rows(x: torch.Tensor, g: torch.Tensor, out: torch.Tensor | None = None, *,
               target: torch.Tensor | None = None, ignore_index: int = -100) -> torch.Tensor:
    """Drop-in for :func:`vparallel_ce.stats.scale_rows` (one launch, the product in fp32; the
    ignored rows found from ``target`` in the same launch)."""
    out = torch.empty_like(x) if out is None else out
    if not (_covered(x) and _covered(out)) or x.stride(-1) != 1 or out.stride(-1) != 1 or x.numel() == 0 \
            or g.device != x.device or g.numel() not in (1, x.shape[0]) \
            or (target is not None and (target.device != x.device or target.numel() != x.shape[0])):
        return stats.scale_rows(x, g, out, target=target, ignore_index=ignore_index)
    block = min(triton.next_power_of_2(max(x.shape[1], 16)), 2048)
    masked = target is not None
    _scale_rows_kernel[(x.shape[0], triton.cdiv(x.shape[1], block))](
        x, x.stride(0), out, out.stride(0), g.contiguous(), x.shape[1], target.contiguous() if masked else g,
        int(ignore_index), PER_ROW=g.dim() > 0, MASKED=masked, BLOCK=block, num_warps=4,
    )
    return out


def reduce(per_token: torch.Tensor, n_valid: torch.Tensor | None, reduction: str) -> torch.Tensor:
    """Drop-in for :func:`vparallel_ce.stats.reduce`: the ``"mean"`` of up to 16384 fp32 losses in
    ONE launch (torch's sum and division are two, where a small microbatch's loss is a few
    dozen microseconds of kernels); other reductions and sizes as torch does them."""
    n = per_token.numel()
    if reduction != "mean" or per_token.dtype != torch.float32 or not (per_token.is_cuda or _interpreting()) \
            or n > _MEAN_MAX or per_token.dim() != 1 or not per_token.is_contiguous() or n_valid.numel() != 1 \
            or n_valid.device != per_token.device:
        return stats.reduce(per_token, n_valid, reduction)
    out = torch.empty((), dtype=torch.float32, device=per_token.device)
    _mean_kernel[(1,)](per_token, n, n_valid, out, BLOCK=_MEAN_BLOCK, num_warps=8)
    return out


OPS = KernelBackend("triton", local_stats, grad_logits, loss_stats_grad_, scale_rows, grad_logits_=grad_logits_,
                    distill=triton_distill.STEPS, reduce=reduce, gathered=gathered_rows.GATHERED,
                    merge_blocks=block_merge.merge_blocks)
