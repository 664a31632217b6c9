r"""The lm_head GEMM fused with the per-chunk steps of :mod:`vparallel_ce.stats` (Triton).

For one block ``x = h w^T + b`` (``h [c, H]``, ``w [Vb, H]``, ``x [c, Vb]``) the kernels compute the
logits tile by tile in registers (fp32 accumulate) and consume each tile in the GEMM's epilogue:

* :func:`linear_stats` -- ``stats.local_stats(F.linear(h, w, b), ...)`` without writing the logits:
  each ``BLOCK_M x BLOCK_N`` tile writes per-row partial ``max`` / ``sumexp`` (and ``sum_j z_j`` with
  label smoothing) for its column tile, and the target logit where the row owns a target inside the
  tile; a small fp32 kernel then merges the ``[ceil(Vb / BLOCK_N), c]`` partials (online softmax).
* :func:`linear_stats_keep` -- the same, and the GEMM also stores the logits (``h``'s dtype), for a
  schedule that makes the gradients from them right away (saves the separate statistics pass).
* :func:`linear_grad_logits` -- ``stats.grad_logits(F.linear(h, w, b), ...)``: recomputes each logits
  tile and writes ``d total / d x`` from the epilogue; the logits never reach memory.

Statistics and gradients are computed from the fp32 accumulator (the torch reference rounds the
logits to ``h``'s dtype first, so bf16 results agree to bf16 rounding of the logits, not bitwise).

On Hopper the operands are loaded with TMA (host-side tensor descriptors) where the strides allow
(16-byte aligned base and row stride); otherwise, and on pre-Hopper GPUs, with plain masked loads.
Logits and gradients are returned as ``[c, Vb]`` views of buffers whose row stride is ``Vb`` rounded
up to 16 elements (TMA can store them, cuBLAS gets an aligned leading dimension for ``dx @ w`` and
``dx^T h`` even at an odd ``Vb``, and one compiled kernel serves every width). Three tile schedules
(:class:`TileConfig`): one program per tile, a persistent grid with a flattened tile loop, and a
persistent warp-specialised loop (Triton's Hopper producer / consumer warp groups).

Inputs the kernels do not take (:func:`covered` is False: CPU tensors outside the Triton
interpreter, fp64, mixed dtypes, pre-Ampere GPUs, ``H == 0``) and empty blocks go through the torch
reference, so every function here is always a drop-in.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .. import stats
from .config import settings
from .tiles import DEFAULT_CONFIGS, TileConfig, covered
from .tiles import _capability, _sm_count  # asked once per device
from .triton_ce import _int8, _interpreting, _tanh

try:  # Triton >= 3.3
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover
    TensorDescriptor = None

__all__ = ["TileConfig", "DEFAULT_CONFIGS", "SCHEDULE_DTYPES", "covered", "takes_options", "schedule_covers",
           "linear_stats", "linear_stats_keep", "linear_grad_logits", "GradLogits"]

_LOG2E = tl.constexpr(1.4426950408889634)


# ------------------------------------------------------------------------------------------ kernels


@triton.jit
def _tile_coords(tile, num_m, num_n, GROUP_M: tl.constexpr):
    """Grouped order: ``GROUP_M`` row tiles share each column tile while it is in L2."""
    per_group = GROUP_M * num_n
    first = (tile // per_group) * GROUP_M
    size = tl.minimum(num_m - first, GROUP_M)
    return first + (tile % per_group) % size, (tile % per_group) // size


@triton.jit
def _logits_tile(H_, W_, off_m, off_n, c, V, K, s_hm, s_wn,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, TMA: tl.constexpr, PREC: tl.constexpr):
    """fp32 ``h[off_m:+BM] @ w[off_n:+BN]^T``; out-of-range rows / columns come out 0."""
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    if TMA:
        for k in range(0, tl.cdiv(K, BK)):
            a = H_.load([off_m, k * BK])
            b = W_.load([off_n, k * BK])
            acc = tl.dot(a, b.T, acc, input_precision=PREC)
    else:
        # int32 offsets inside the tile from 64-bit scalar bases: pointer tensors stay small
        rm = tl.arange(0, BM)
        rn = tl.arange(0, BN)
        rk = tl.arange(0, BK)
        rm = tl.where(rm < c - off_m, rm, 0)  # clamp instead of masking rows / columns
        rn = tl.where(rn < V - off_n, rn, 0)
        a_base = H_ + off_m.to(tl.int64) * s_hm
        b_base = W_ + off_n.to(tl.int64) * s_wn
        a_off = rm[:, None] * s_hm + rk[None, :]
        b_off = rn[:, None] * s_wn + rk[None, :]
        for k in range(0, tl.cdiv(K, BK)):
            kmask = (rk < K - k * BK)[None, :]
            a = tl.load(a_base + k * BK + a_off, mask=kmask, other=0.0)
            b = tl.load(b_base + k * BK + b_off, mask=kmask, other=0.0)
            acc = tl.dot(a, b.T, acc, input_precision=PREC)
    return acc


@triton.jit
def _tile_logits(H_, W_, B, off_m, off_n, c, V, K, s_hm, s_wn,
                 HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                 TMA: tl.constexpr, PREC: tl.constexpr):
    x = _logits_tile(H_, W_, off_m, off_n, c, V, K, s_hm, s_wn, BM, BN, BK, TMA, PREC)
    if HAS_BIAS:
        cols = off_n + tl.arange(0, BN)
        x += tl.load(B + cols, mask=cols < V, other=0.0).to(tl.float32)[None, :]
    return x


@triton.jit
def _loop_tile(H_, W_, B, tile, tile_e, n_prog, c, V, K, s_hm, s_wn, HAS_BIAS: tl.constexpr, BM: tl.constexpr,
               BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, TMA: tl.constexpr, PREC: tl.constexpr):
    """One iteration of the tile loop: the logits of ``tile``, then the epilogue's counter advanced
    and the offsets of its tile (the same tile: a separate value keeps Triton's pipeliner from
    sharing one between the loop's prologue and epilogue, its persistent-matmul pattern)."""
    num_m = tl.cdiv(c, BM)
    num_n = tl.cdiv(V, BN)
    pm, pn = _tile_coords(tile, num_m, num_n, GROUP_M)
    x = _tile_logits(H_, W_, B, pm * BM, pn * BN, c, V, K, s_hm, s_wn, HAS_BIAS, BM, BN, BK, TMA, PREC)
    tile_e += n_prog
    pm, pn = _tile_coords(tile_e, num_m, num_n, GROUP_M)
    return x, tile_e, pm * BM, pn * BN, pn


@triton.jit
def _store_tile(O_, val, off_m, off_n, c, V, s_om,
                BM: tl.constexpr, BN: tl.constexpr, TMA: tl.constexpr, SPLIT: tl.constexpr):
    """Store an fp32 tile in ``O_``'s dtype (TMA clips what lies outside ``[c, V]``)."""
    if TMA:
        if SPLIT:
            halves = tl.permute(tl.reshape(val, (BM, 2, BN // 2)), (0, 2, 1))
            left, right = tl.split(halves)
            O_.store([off_m, off_n], left.to(O_.dtype))
            O_.store([off_m, off_n + BN // 2], right.to(O_.dtype))
        else:
            O_.store([off_m, off_n], val.to(O_.dtype))
    else:
        rows = tl.arange(0, BM)
        cols = tl.arange(0, BN)
        ptr = O_ + off_m.to(tl.int64) * s_om + off_n + (rows[:, None] * s_om + cols[None, :])
        mask = (rows < c - off_m)[:, None] & (cols < V - off_n)[None, :]
        tl.store(ptr, val.to(O_.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["c", "V", "n_prog"])  # one binary per config for every shape
def _stats_kernel(
    H_, W_, X_, B, T, OWN, PMAX, PSUM, PTOT, TGT, c, V, K, s_hm, s_wn, s_xm, n_prog, cap, inv_cap,
    HAS_BIAS: tl.constexpr, HAS_CAP: tl.constexpr, SMOOTH: tl.constexpr, KEEP: tl.constexpr,
    TMA: tl.constexpr, TMA_STORE: tl.constexpr, PREC: tl.constexpr, SPLIT: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    FLATTEN: tl.constexpr, WS: tl.constexpr,
):
    pid = tl.program_id(0)
    tile_e = pid - n_prog
    num_tiles = tl.cdiv(c, BM) * tl.cdiv(V, BN)
    for tile in tl.range(pid, num_tiles, n_prog, flatten=FLATTEN, warp_specialize=WS):
        x, tile_e, off_m, off_n, pn = _loop_tile(H_, W_, B, tile, tile_e, n_prog, c, V, K, s_hm, s_wn, HAS_BIAS,
                                                 BM, BN, BK, GROUP_M, TMA, PREC)
        if KEEP:
            _store_tile(X_, x, off_m, off_n, c, V, s_xm, BM, BN, TMA_STORE, SPLIT)
        rows = off_m + tl.arange(0, BM)
        cols = off_n + tl.arange(0, BN)
        rmask = rows < c
        cmask = (cols < V)[None, :]
        z = x
        if HAS_CAP:
            z = cap * _tanh(z * inv_cap)
        z = tl.where(cmask, z, float("-inf"))  # one live tile: everything below reads z
        part = pn.to(tl.int64) * c + rows
        t = tl.load(T + rows, mask=rmask, other=-1).to(tl.int32)  # int32 compares: fewer registers
        hit = rmask & (tl.load(OWN + rows, mask=rmask, other=0) != 0) & (t >= off_n) & (t < off_n + BN)
        zt = tl.sum(tl.where(cols[None, :] == t[:, None], z, 0.0), axis=1)
        tl.store(TGT + rows, zt, mask=hit)  # exactly one column tile holds a row's target
        if SMOOTH:
            tl.store(PTOT + part, tl.sum(tl.where(cmask, z, 0.0), axis=1), mask=rmask)
        m = tl.max(z, axis=1)
        m_ref = tl.where(m > float("-inf"), m, 0.0)  # a tile of -inf logits (a masking bias): sum 0, not nan
        s = tl.sum(tl.exp2(z * _LOG2E - (m_ref * _LOG2E)[:, None]), axis=1)
        tl.store(PMAX + part, m, mask=rmask)
        tl.store(PSUM + part, s, mask=rmask)


@triton.jit(do_not_specialize=["c", "n_parts"])
def _merge_kernel(PMAX, PSUM, PTOT, MAX, SUMEXP, SUM, c, n_parts, SMOOTH: tl.constexpr, BLOCK: tl.constexpr):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = rows < c
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK], dtype=tl.float32)
    tot = tl.zeros([BLOCK], dtype=tl.float32)
    for j in range(0, n_parts):
        off = j * c + rows  # a part's max is -inf (sum 0) where all its logits are -inf
        pm = tl.load(PMAX + off, mask=mask, other=0.0)
        ps = tl.load(PSUM + off, mask=mask, other=0.0)
        m_new = tl.maximum(m, pm)
        m_ref = tl.where(m_new > float("-inf"), m_new, 0.0)  # -inf - -inf would be nan
        s = s * tl.exp2((m - m_ref) * _LOG2E) + ps * tl.exp2((pm - m_ref) * _LOG2E)
        m = m_new
        if SMOOTH:
            tot += tl.load(PTOT + off, mask=mask, other=0.0)
    tl.store(MAX + rows, m, mask=mask)
    tl.store(SUMEXP + rows, s, mask=mask)
    tl.store(SUM + rows, tot, mask=mask)


@triton.jit(do_not_specialize=["c", "V", "n_prog", "col0"])
def _grad_kernel(
    H_, W_, D_, B, T, OWN, SHIFT, CA, CB, CC, CD, c, V, K, s_hm, s_wn, s_dm, n_prog, col0,
    cap, inv_cap, inv_t, t_over_cap,
    HAS_BIAS: tl.constexpr, HAS_CAP: tl.constexpr, HAS_T: tl.constexpr, HAS_B: tl.constexpr, HAS_D: tl.constexpr,
    TMA: tl.constexpr, TMA_STORE: tl.constexpr, PREC: tl.constexpr, SPLIT: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    FLATTEN: tl.constexpr, WS: tl.constexpr,
):
    # the epilogue is stats.grad_logits: d obj/d z = e^{u} (a + b u) - c [j == t] - d, u = z - shift,
    # then the softcap / temperature chain
    pid = tl.program_id(0)
    tile_e = pid - n_prog
    num_tiles = tl.cdiv(c, BM) * tl.cdiv(V, BN)
    for tile in tl.range(pid, num_tiles, n_prog, flatten=FLATTEN, warp_specialize=WS):
        x, tile_e, off_m, off_n, _ = _loop_tile(H_, W_, B, tile, tile_e, n_prog, c, V, K, s_hm, s_wn, HAS_BIAS,
                                                BM, BN, BK, GROUP_M, TMA, PREC)
        rows = off_m + tl.arange(0, BM)
        cols = off_n + tl.arange(0, BN)
        rmask = rows < c
        shift = tl.load(SHIFT + rows, mask=rmask, other=0.0)
        a = tl.load(CA + rows, mask=rmask, other=0.0)
        # the target's column in this block (a shard target outside the block matches no column)
        t = (tl.load(T + rows, mask=rmask, other=-1) - col0).to(tl.int32)  # int32 compares: fewer registers
        hit = tl.where(tl.load(OWN + rows, mask=rmask, other=0) != 0, tl.load(CC + rows, mask=rmask, other=0.0), 0.0)
        z = x
        if HAS_CAP:
            z = cap * _tanh(z * inv_cap)
        if HAS_T:
            z = z * inv_t
        u = z - shift[:, None]
        # -inf and nan logits give 0 * a, as stats.grad_logits: nan on a valid row with nan
        # statistics, exactly 0 on an ignored one (a = 0), never 0 * -inf
        live = u > float("-inf")
        if HAS_B:
            d = tl.exp2(u * _LOG2E) * (a[:, None] + tl.load(CB + rows, mask=rmask, other=0.0)[:, None] * u)
        else:
            d = tl.exp2(u * _LOG2E) * a[:, None]
        d = tl.where(live, d, a[:, None] * 0.0)
        if HAS_D:
            d = d - tl.load(CD + rows, mask=rmask, other=0.0)[:, None]
        d = tl.where(cols[None, :] == t[:, None], d - hit[:, None], d)
        if HAS_CAP:  # an exact 0 (an ignored row's) stays 0 where z is nan
            r = z * t_over_cap
            d = tl.where(d == 0.0, d, d * (1.0 - r * r))
        if HAS_T:
            d = d * inv_t
        _store_tile(D_, d, off_m, off_n, c, V, s_dm, BM, BN, TMA_STORE, SPLIT)


# --------------------------------------------------------------------------------------------- host


def _tma_ok(t: torch.Tensor) -> bool:
    return (t.data_ptr() % 16 == 0 and t.stride(1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0
            and t.shape[0] > 0)


def loads(cfg: TileConfig, *operands: torch.Tensor) -> tuple[TileConfig, bool]:
    """``cfg`` as a launch over these operands (one dtype, unit column stride) runs it, and whether
    it loads them with TMA: fp32 operands take half the K tile (the same bytes per pipeline stage);
    TMA on Hopper (or the interpreter) where every operand's base and row stride are 16-byte
    aligned, else masked loads, whose address registers leave room for N tiles of 128 at most."""
    a = operands[0]
    if a.element_size() == 4 and cfg.block_k > 32:
        cfg = replace(cfg, block_k=cfg.block_k // 2)
    on_hopper = _interpreting() or (a.is_cuda and _capability(a.device) >= (9, 0))
    tma = bool(cfg.tma and TensorDescriptor is not None and on_hopper and all(_tma_ok(t) for t in operands))
    if not tma:
        cfg = replace(cfg, block_n=min(cfg.block_n, 128))
    return cfg, tma


def precision(a: torch.Tensor) -> str:
    """``tl.dot``'s input precision for operands like ``a``: fp32 as torch's matmuls take it (TF32
    where ``torch.backends.cuda.matmul.allow_tf32``, else IEEE); unused for 16-bit operands."""
    if a.dtype == torch.float32:
        return "tf32" if (a.is_cuda and torch.backends.cuda.matmul.allow_tf32) else "ieee"
    return "tf32"


class _Launch:
    """What the two GEMM kernels share: operand descriptors or pointers, grid, compile options."""

    def __init__(self, h, w, cfg: TileConfig, h_descs: dict | None = None):
        if h.stride(1) != 1:
            h = h.contiguous()
        if w.stride(1) != 1:
            w = w.contiguous()
        device = h.device
        cfg, self.tma = loads(cfg, h, w)
        if cfg.schedule == "ws" and not _interpreting() and not settings().warp_specialized:
            raise ValueError("schedule='ws' made an illegal memory access with Triton 3.6 on an H200 "
                             "(docs/kernels.md); run it inside vparallel_ce.kernels.use(warp_specialized=True) "
                             "or start the process with VPARALLEL_CE_FUSED_WS=1 to try it anyway")
        if cfg.schedule == "ws" and not self.tma:
            cfg = replace(cfg, schedule="persistent")
        self.tma_store = self.tma and cfg.tma_store
        self.cfg = cfg
        self.h, self.w = h, w
        self.c, self.V, self.K = h.shape[0], w.shape[0], h.shape[1]
        bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
        if self.tma:
            # h's descriptor: one per box shape, shared by the blocks of a chunk (h_descs)
            key = (bm, bk)
            self.h_arg = None if h_descs is None else h_descs.get(key)
            if self.h_arg is None:
                self.h_arg = TensorDescriptor(h, [self.c, self.K], [h.stride(0), 1], [bm, bk])
                if h_descs is not None:
                    h_descs[key] = self.h_arg
            self.w_arg = TensorDescriptor(w, [self.V, self.K], [w.stride(0), 1], [bn, bk])
        else:
            self.h_arg, self.w_arg = h, w
        tiles = triton.cdiv(self.c, bm) * triton.cdiv(self.V, bn)
        if cfg.schedule == "tiles":
            self.n_prog = tiles
        else:
            self.n_prog = max(1, min(tiles, cfg.ctas_per_sm * _sm_count(device)))
        self.meta = dict(
            TMA=self.tma, TMA_STORE=self.tma_store, PREC=precision(h), SPLIT=bool(cfg.split_store and self.tma_store),
            BM=bm, BN=bn, BK=bk, GROUP_M=cfg.group_m, FLATTEN=cfg.schedule == "persistent", WS=cfg.schedule == "ws",
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )

    def output(self, dtype):
        """A ``[c, V]`` output (view of a buffer whose row stride is ``V`` rounded up to 16 elements)
        and its kernel argument (a tensor descriptor under TMA)."""
        ld = -(-self.V // 16) * 16  # >= 16 bytes and divisible by 16: the same compiled kernel for every V
        base = torch.empty((self.c, ld), dtype=dtype, device=self.h.device)
        out = base[:, : self.V]
        if not self.tma_store:
            return out, out, ld
        box = [self.cfg.block_m, self.cfg.block_n // 2 if self.meta["SPLIT"] else self.cfg.block_n]
        return out, TensorDescriptor(base, [self.c, self.V], [ld, 1], box), ld


def _cap(spec):
    cap = float(spec.softcap) if spec.softcap is not None else 1.0
    return cap, 1.0 / cap


def _fused(h, w) -> bool:
    return covered(h, w) and h.shape[0] > 0 and w.shape[0] > 0


def _stats(h, w, b, local_t, owned, spec, keep: bool, config):
    cfg = config or DEFAULT_CONFIGS["keep" if keep else "stats"]
    L = _Launch(h, w, cfg)
    c, V = L.c, L.V
    f32 = dict(dtype=torch.float32, device=h.device)
    n_parts = triton.cdiv(V, L.cfg.block_n)
    smooth = spec.label_smoothing > 0
    pmax = torch.empty((n_parts, c), **f32)
    psum = torch.empty((n_parts, c), **f32)
    ptot = torch.empty((n_parts, c), **f32) if smooth else psum
    tgt = torch.zeros(c, **f32)
    logits, x_arg, ld = L.output(h.dtype) if keep else (None, pmax, 0)
    cap, inv_cap = _cap(spec)
    _stats_kernel[(L.n_prog,)](
        L.h_arg, L.w_arg, x_arg, b if b is not None else pmax, local_t.contiguous(), _int8(owned),
        pmax, psum, ptot, tgt, c, V, L.K, L.h.stride(0), L.w.stride(0), ld, L.n_prog, cap, inv_cap,
        HAS_BIAS=b is not None, HAS_CAP=spec.softcap is not None, SMOOTH=smooth, KEEP=keep, **L.meta,
    )
    m, se, tot = (torch.empty(c, **f32) for _ in range(3))
    block = 128
    _merge_kernel[(triton.cdiv(c, block),)](pmax, psum, ptot, m, se, tot, c, n_parts, SMOOTH=smooth, BLOCK=block,
                                            num_warps=4)
    return stats.ChunkStats(m, se, tgt, tot), logits


def _check_bias(b, w):
    if b is not None and (b.dim() != 1 or b.shape[0] != w.shape[0]):
        raise ValueError(f"bias must be [{w.shape[0]}], got {tuple(b.shape)}")
    return None if b is None else b.contiguous()


# On a GPU the schedules take the fused kernels for 16-bit operands only: an fp32 GEMM stays with cuBLAS.
SCHEDULE_DTYPES = (torch.bfloat16, torch.float16)


def takes_options(*, entropy: bool, temperature: float) -> bool:
    """Whether the statistics epilogue carries a call's options: softcap, smoothing and z-loss do;
    the log-prob ops' temperature and entropy statistic take the reference path for now."""
    return temperature == 1.0 and not entropy


def _stats_fused(h, w, spec) -> bool:
    return _fused(h, w) and takes_options(entropy=spec.entropy, temperature=spec.temperature)


def schedule_covers(h, w, spec) -> bool:
    """Whether ``linear_cross_entropy``'s schedules should take these kernels for ``h``, ``w``: both
    of them fused (no reference fallback that would materialise the logits of the whole shard),
    and on a GPU only :data:`SCHEDULE_DTYPES` (:func:`vparallel_ce.kernels.fused_applies` is the
    same rule before the tensors exist)."""
    if not _stats_fused(h, w, spec):
        return False
    return _interpreting() or h.dtype in SCHEDULE_DTYPES


def linear_stats(h, w, b, local_t, owned, spec, *, config: TileConfig | None = None) -> stats.ChunkStats:
    """``stats.local_stats(F.linear(h, w, b), local_t, owned, spec)`` without writing the logits."""
    if not _stats_fused(h, w, spec):
        return stats.local_stats(F.linear(h, w, b), local_t, owned, spec)
    return _stats(h, w, _check_bias(b, w), local_t, owned, spec, False, config)[0]


def linear_stats_keep(h, w, b, local_t, owned, spec, *, config: TileConfig | None = None):
    """``(stats.local_stats(x, ...), x)`` with ``x = F.linear(h, w, b)`` written by the same GEMM
    (``h``'s dtype; a ``[c, Vb]`` view whose row stride is rounded up to 16 elements)."""
    if not _stats_fused(h, w, spec):
        x = F.linear(h, w, b)
        return stats.local_stats(x, local_t, owned, spec), x
    return _stats(h, w, _check_bias(b, w), local_t, owned, spec, True, config)


class GradLogits:
    """:func:`linear_grad_logits` for the vocab blocks of one chunk: ``grad(w_b, b_b, col_offset)``
    per block. What depends only on the chunk -- its rows' targets and coefficients in the
    kernel's dtypes, ``h``'s tensor descriptor -- is made once, so each block costs the host little
    more than its launch (a schedule of narrow blocks is host-bound)."""

    def __init__(self, h, local_t, owned, shift, coefs, spec, *, config: TileConfig | None = None):
        self.h = h if h.dim() != 2 or h.stride(1) == 1 else h.contiguous()
        self.local_t, self.owned, self.shift, self.coefs, self.spec = local_t, owned, shift, coefs, spec
        self.cfg = config or DEFAULT_CONFIGS["grad"]
        self.args = None  # the kernel's per-row arguments, made with the first fused block
        self.h_descs: dict = {}

    def _row_args(self) -> tuple:
        if self.args is None:
            def f32(t):
                return t.to(torch.float32).contiguous()

            co = self.coefs
            a = f32(co.a)
            self.args = (self.local_t.contiguous(), _int8(self.owned), f32(self.shift), a,
                         a if co.b is None else f32(co.b), f32(co.c), a if co.d is None else f32(co.d))
        return self.args

    def __call__(self, w, b=None, col_offset: int = 0):
        h, spec, co = self.h, self.spec, self.coefs
        if not _fused(h, w):  # the reference takes block-relative targets
            local_t, owned = stats.block_targets(self.local_t, self.owned, col_offset, col_offset + w.shape[0])
            return stats.grad_logits(F.linear(h, w, b), local_t, owned, self.shift, co, spec)
        b = _check_bias(b, w)
        L = _Launch(h, w, self.cfg, self.h_descs)
        out, d_arg, ld = L.output(h.dtype)
        cap, inv_cap = _cap(spec)
        temp = float(spec.temperature)
        t, own, shift, a, cb, cc, cd = self._row_args()
        _grad_kernel[(L.n_prog,)](
            L.h_arg, L.w_arg, d_arg, b if b is not None else a, t, own, shift, a, cb, cc, cd,
            L.c, L.V, L.K, L.h.stride(0), L.w.stride(0), ld, L.n_prog, int(col_offset), cap, inv_cap, 1.0 / temp,
            temp / cap,
            HAS_BIAS=b is not None, HAS_CAP=spec.softcap is not None, HAS_T=temp != 1.0, HAS_B=co.b is not None,
            HAS_D=co.d is not None, **L.meta,
        )
        return out


def linear_grad_logits(h, w, b, local_t, owned, shift, coefs, spec, *, col_offset: int = 0,
                       config: TileConfig | None = None):
    """``stats.grad_logits(F.linear(h, w, b), local_t, owned, shift, coefs, spec)`` in ``h``'s dtype,
    the logits recomputed tile by tile and never stored (a ``[c, Vb]`` view, row stride rounded up
    to 16 elements). ``col_offset``: ``w`` is the block of a shard that starts at that column, and
    ``local_t``/``owned`` are relative to the shard (a target outside the block is no hit): a
    schedule walking vocab blocks passes its chunk's targets unchanged (through
    :class:`GradLogits`, which makes the per-chunk arguments once)."""
    return GradLogits(h, local_t, owned, shift, coefs, spec, config=config)(w, b, col_offset)
