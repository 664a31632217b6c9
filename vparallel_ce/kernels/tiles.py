"""The fused lm_head kernels' launch parameters (:class:`TileConfig`, :data:`DEFAULT_CONFIGS`),
which inputs they take (:func:`covered`), the device facts a launch reads, asked once per device,
and what one launch of a GEMM kernel is made of (:class:`_Launch`: operand descriptors or pointers,
grid, compile options).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import triton

from .config import settings, sm_count as _sm_count
from .triton_ce import _DTYPES, _interpreting

try:  # Triton >= 3.3
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover
    TensorDescriptor = None

__all__ = ["SCHEDULES", "TileConfig", "DEFAULT_CONFIGS", "covered"]

SCHEDULES = ("tiles", "persistent", "ws")


@dataclass(frozen=True)
class TileConfig:
    """Launch parameters of one fused kernel.

    ``schedule``: ``"tiles"`` (one program per output tile, grouped order), ``"persistent"``
    (``ctas_per_sm`` programs per multiprocessor walk the tiles, loop flattened so the next tile's
    loads overlap this tile's epilogue), ``"ws"`` (persistent, warp-specialised: Triton splits the
    loop into a TMA producer and MMA consumer warp groups; needs TMA and, in Triton 3.6,
    ``num_warps=4`` and ``tma_store=False``; it made an illegal memory access on an H200 with
    Triton 3.6, so on a GPU it runs only where the kernel settings allow it:
    ``vparallel_ce.kernels.use(warp_specialized=True)`` or ``VPARALLEL_CE_FUSED_WS=1``). ``tma``: tensor
    descriptors where the strides allow. ``split_store``: store an output tile as two half-width TMA
    boxes (less shared memory for the epilogue). ``tma_store=False``: plain stores for the outputs,
    TMA for the loads only."""

    block_m: int = 128
    block_n: int = 256
    block_k: int = 64
    num_stages: int = 3
    num_warps: int = 8
    group_m: int = 8
    schedule: str = "tiles"
    tma: bool = True
    split_store: bool = False
    tma_store: bool = True
    ctas_per_sm: int = 1

    def __post_init__(self):
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")


# Per kernel kind: the fastest candidates of the H200 run in docs/kernels.md (bf16; fp32 operands take
# half the K tile, the same bytes per pipeline stage).
DEFAULT_CONFIGS = {
    "stats": TileConfig(schedule="persistent"),
    "keep": TileConfig(),
    "grad": TileConfig(schedule="persistent", num_stages=4, split_store=True),
}


def covered(h: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether the fused kernels take ``h [c, H]`` and ``w [Vb, H]`` (else the functions here run the
    torch reference): same float dtype (bf16 / fp16 / fp32), same device, CUDA with tensor cores
    (sm80+) or any device under ``TRITON_INTERPRET=1``, ``H > 0``. Strides are free (TMA where they
    are 16-byte aligned, masked loads otherwise; a non-unit column stride is copied)."""
    if not (isinstance(h, torch.Tensor) and isinstance(w, torch.Tensor)):
        return False
    if h.dim() != 2 or w.dim() != 2 or h.shape[1] != w.shape[1] or h.shape[1] == 0:
        return False
    if h.dtype != w.dtype or h.dtype not in _DTYPES or h.device != w.device:
        return False
    if _interpreting():
        return True
    return h.is_cuda and _capability(h.device) >= (8, 0)


# Per device (a process has few: bounded all the same): a CUDA property query took 10 us of host
# time on an H100 (torch 2.11), and these are asked on every launch.
@functools.lru_cache(maxsize=64)
def _capability(device) -> tuple:
    return torch.cuda.get_device_capability(device)


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
