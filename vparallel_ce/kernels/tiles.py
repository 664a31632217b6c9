"""The fused lm_head kernels' launch parameters (:class:`TileConfig`, :data:`DEFAULT_CONFIGS`),
which inputs they take (:func:`covered`), and the device facts a launch reads, asked once per device.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .triton_ce import _DTYPES, _interpreting

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


@functools.lru_cache(maxsize=64)  # as _capability
def _sm_count(device) -> int:
    if _interpreting() or device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count
