r"""The global top-``k`` of logits sharded along the vocab, under one fixed tie rule.

**Tie rule.** Entries are ordered by value, largest first, and equal values by GLOBAL id, lowest
first; the top-``k`` are the first ``k`` of that order. (``torch.topk`` leaves the order of ties
unspecified; ``torch.sort(stable=True, descending=True)`` of the gathered row gives this one.) A
nan counts as larger than every number, so a row holding one is selected as it would be and its
log-probs come out nan. Slots beyond the vocabulary (``k > V``) hold the value ``-inf`` and the id
``-1``, after every real entry.

**What crosses ranks.** The union of the ranks' local top-``k`` holds the global top-``k``: each
rank selects its own ``k`` under the same rule (ids ascending among ties at its ``k``-th value),
and ONE all-gather of ``[c, k]`` (value, id) pairs per rank -- packed as float64, exact for fp32
values and ids below ``2**53`` -- gives every rank the same ``[c, world k]`` candidates, of which
the first ``k`` in the order above are the global top-``k``. Nothing of size ``V`` crosses.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import comm
from .layout import VocabLayout

__all__ = ["TopK", "global_topk", "local_topk"]


class TopK(NamedTuple):
    """``[c, k]`` values (the compute dtype) and GLOBAL ids (int64), in the order of the tie rule."""

    values: torch.Tensor
    ids: torch.Tensor


def _selectable(z: torch.Tensor) -> torch.Tensor:
    """``z`` with nan as ``+inf`` (selected first; the log-probs then read the nan itself)."""
    return torch.where(torch.isnan(z), float("inf"), z)


def local_topk(z: torch.Tensor, k: int, offset: int) -> TopK:
    """This shard's top-``k`` of ``z [c, V_loc]`` (ids ``offset + column``) under the tie rule, padded
    to ``k`` with ``(-inf, -1)``. No host read: the ``k``-th value is found by ``topk``, then the
    entries above it and the lowest-id ties at it are written to their rank by a scatter."""
    c, width = z.shape
    values = torch.full((c, k), float("-inf"), dtype=z.dtype, device=z.device)
    ids = torch.full((c, k), -1, dtype=torch.int64, device=z.device)
    kk = min(k, width)
    if kk == 0 or c == 0:
        return TopK(values, ids)
    sel = _selectable(z)
    kth = sel.topk(kk, dim=-1, sorted=True).values[:, -1:]
    above = sel > kth
    tie = sel == kth
    take = above | (tie & (tie.cumsum(-1) <= kk - above.sum(-1, keepdim=True)))  # exactly kk per row
    # the taken columns in ascending order, each at its rank among them; the others to a dump slot
    slot = torch.where(take, take.cumsum(-1) - 1, kk)
    cols = torch.zeros((c, kk + 1), dtype=torch.int64, device=z.device)
    cols.scatter_(1, slot, torch.arange(width, device=z.device).expand(c, width))
    cols = cols[:, :kk]
    picked = z.gather(1, cols)
    order = _selectable(picked).sort(dim=-1, descending=True, stable=True).indices  # ties keep ascending ids
    values[:, :kk] = picked.gather(1, order)
    ids[:, :kk] = cols.gather(1, order) + offset
    return TopK(values, ids)


def global_topk(z: torch.Tensor, k: int, layout: VocabLayout) -> TopK:
    """The GLOBAL top-``k`` of the rows whose shard ``z [c, V_loc]`` this rank holds (the same
    result on every rank): :func:`local_topk`, one all-gather of the candidates, and the tie rule's
    first ``k`` of their union."""
    mine = local_topk(z, k, layout.offset)
    if not layout.sharded:
        return mine
    wide = torch.float64
    packed = torch.stack([mine.values.to(wide), mine.ids.to(wide)], dim=-1)  # [c, k, 2]
    c = z.shape[0]
    every = comm.all_gather_last_dim(packed.reshape(c, 2 * k), layout.group, [2 * k] * layout.world)
    every = every.reshape(c, layout.world * k, 2)
    values, ids = every[..., 0].to(z.dtype), every[..., 1].to(torch.int64)
    # candidates arrive in rank order, each rank's ids ascending among its ties: ascending ids within
    # every tie, except the (-inf, -1) pads, which go after every real -inf entry
    pad_last = torch.where(ids < 0, layout.vocab_size, ids).sort(dim=-1, stable=True).indices
    values, ids = values.gather(1, pad_last), ids.gather(1, pad_last)
    order = _selectable(values).sort(dim=-1, descending=True, stable=True).indices[:, :k]
    return TopK(values.gather(1, order), ids.gather(1, order))
