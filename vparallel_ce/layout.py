"""Who holds which vocabulary rows: the shard arithmetic, and nothing else.

The vocabulary of size ``V`` is split over a tensor-parallel group of ``W`` ranks in the
``torch.chunk`` layout (the same as DTensor ``Shard``): with ``s = ceil(V / W)``, rank ``r`` holds
ids ``[min(r*s, V), min((r+1)*s, V))`` -- trailing ranks may hold an empty shard. The same layout
splits a sequence over the ranks of a sequence-parallel group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["VocabLayout", "shard_range", "shard_sizes", "shard_of", "aligned_parts", "vocab_blocks"]


def shard_range(size: int, world: int, rank: int) -> tuple[int, int]:
    """``(offset, length)`` of rank ``rank``'s piece of ``size`` items in the torch.chunk layout."""
    step = math.ceil(size / world) if size > 0 else 0
    start = min(rank * step, size)
    stop = min((rank + 1) * step, size)
    return start, stop - start


def shard_sizes(size: int, world: int) -> list[int]:
    """Every rank's piece length, in rank order."""
    return [shard_range(size, world, r)[1] for r in range(world)]


def shard_of(t: torch.Tensor, world: int, rank: int, dim: int) -> torch.Tensor:
    """Rank ``rank``'s torch.chunk piece of ``t`` along ``dim`` (a view; empty for trailing ranks)."""
    start, length = shard_range(t.shape[dim], world, rank)
    return t.narrow(dim, start, length)


@dataclass(frozen=True)
class VocabLayout:
    """This rank's place in the vocab-sharded group.

    ``group`` is None when unsharded. ``offset``/``local_size`` locate the local shard in the
    global vocab ``[0, vocab_size)``.
    """

    group: object
    world: int
    rank: int
    vocab_size: int
    offset: int
    local_size: int

    @property
    def sharded(self) -> bool:
        return self.world > 1

    @classmethod
    def of_rank(cls, group, world: int, rank: int, vocab_size: int) -> "VocabLayout":
        offset, size = shard_range(vocab_size, world, rank)
        return cls(group if world > 1 else None, world, rank, vocab_size, offset, size)

    def sizes(self) -> list[int]:
        return shard_sizes(self.vocab_size, self.world)


# ---------------------------------------------------------------------------------------------
# Column blocks of one rank's shard, for the lm_head matmuls. Blocks need no agreement across ranks.


def aligned_parts(local_size: int) -> list[slice]:
    """The token schedule's vocab parts: the whole shard, or -- when its width is not a multiple of
    8 -- a 128-aligned main part and a narrow tail. cuBLAS runs GEMMs whose leading dimension is
    odd on slow kernels (~120 TFLOP/s at V=32777 on an H200); the split keeps the main part's three
    GEMMs aligned without copying or padding the weight."""
    main = local_size - local_size % 128
    if local_size % 8 == 0 or main == 0:
        return [slice(0, local_size)]
    return [slice(0, main), slice(main, local_size)]


def vocab_blocks(local_size: int, blocks: int) -> list[slice]:
    """About ``blocks`` contiguous blocks of the local vocab, their starts and widths multiples of
    128 where the shard is wide enough (aligned leading dimensions keep cuBLAS on its fast
    kernels); the count may come out lower than asked."""
    if not local_size:
        return [slice(0, 0)]
    k = max(1, min(int(blocks), local_size))
    unit = 128 if local_size >= 128 * k else 1
    per = -(-(-(-local_size // k)) // unit) * unit
    return [slice(s, min(s + per, local_size)) for s in range(0, local_size, per)]
