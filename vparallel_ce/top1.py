r"""The greedy token of vocab-sharded logits: each token's argmax over the GLOBAL vocab, ties to
the lowest id, from blocks of logits that never meet on one rank.

Per block of a rank's shard (ids ``[o, o + V_b)``), ``torch.max`` gives the block's largest logit
and its first (lowest) id; blocks merge in ascending id order, a later block winning only with a
strictly larger value (:func:`merge`). Over the group, ONE all-gather of ``(value, id)`` pairs per
token (:func:`join`): the largest value wins, and among ranks holding it the first in rank order,
whose ids are the lowest (the ``torch.chunk`` layout ascends with the rank). That is
``argmax(x)`` of the gathered logits row, as ``torch.argmax`` picks it.

This is :mod:`vparallel_ce.vocab_topk`'s tie rule at ``k = 1``, made block by block as the chunk
walk sees the logits (one ``torch.max`` per block, merged; no sort), except for nan: a row holding
a nan has no argmax that equals a target (its id is -1), where the top-``k`` selects the nan.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import comm

__all__ = ["Top1", "local", "merge", "join"]


class Top1(NamedTuple):
    """Per token ``[c]``: the largest logit seen so far (float64: exact for every logits dtype)
    and its global id (float64, exact below 2^53)."""

    value: torch.Tensor
    id: torch.Tensor


def local(x: torch.Tensor, first_id: int) -> Top1:
    """The largest logit of each row of a ``[c, V_b]`` block whose column 0 is global id
    ``first_id``, and its lowest id. An empty block has value -inf and id -1."""
    if x.shape[-1] == 0:
        return Top1(torch.full(x.shape[:1], float("-inf"), dtype=torch.float64, device=x.device),
                    torch.full(x.shape[:1], -1.0, dtype=torch.float64, device=x.device))
    value, idx = x.max(dim=-1)  # ties: the first maximal entry (torch.max's documented rule)
    return Top1(value.to(torch.float64), (idx + first_id).to(torch.float64))


def merge(a: Top1, b: Top1) -> Top1:
    """Two blocks of the same rows, ``b`` holding the higher ids: ``b`` wins only where it is
    strictly larger (or where it holds a nan and ``a`` does not: a nan row stays nan)."""
    take = (b.value > a.value) | (b.value.isnan() & ~a.value.isnan())
    return Top1(torch.where(take, b.value, a.value), torch.where(take, b.id, a.id))


def join(mine: Top1, layout) -> torch.Tensor:
    """Each row's argmax over the group's shards (int64 ``[c]``, identical on every rank; -1 for a
    row with a nan). One all-gather of ``2 c`` float64 per rank."""
    value, ids = mine
    if layout.sharded:
        every = comm.all_gather_rows(torch.stack([value, ids]), layout.group)  # [world * 2, c]
        every = every.reshape(layout.world, 2, -1)
        values, all_ids = every[:, 0], every[:, 1]
        best = values.amax(0)
        first = (values == best).to(torch.uint8).argmax(0)  # the first rank holding the max
        ids = all_ids.gather(0, first.unsqueeze(0)).squeeze(0)
        value = best
    return torch.where(value.isnan(), -1.0, ids).to(torch.int64)
