r"""Labels along the sequence: the heads of multi-token prediction over packed documents, the
same across a context-parallel (CP) sharding of the sequence, and the valid tokens of each head
over the data-parallel and CP ranks.

**Heads.** With ``labels[i]`` the next-token label of position ``i`` (head 0), MTP depth ``d``
predicts ``labels[i + d]``: the labels rolled left by ``d`` along the last dim, the last ``d``
positions ``ignore_index``. With reset-style ``positions`` (0 at each packed document's first
token), position ``i`` keeps its label only where ``positions[i + d] == positions[i] + d``: a label
never comes from the next document. This is torchtitan 0.3.0's ``roll_mtp_sequence(labels,
shift=d, fill_value=-100, positions=positions)``, along the last dim instead of dim 1.

**Context parallelism.** A CP group of ``W`` ranks shards the sequence: contiguously (rank ``r``
holds the ``r``-th of ``W`` equal parts) or in torch's head-tail load-balanced layout, which
torchtitan uses for causal attention (rank ``r`` holds parts ``r`` and ``2W - 1 - r`` of ``2W``).
Rolling a shard's labels locally would lose ``d`` labels at each shard boundary: the label of a
shard's last positions lies on another rank. :func:`context_parallel_labels` all-gathers the
shard's labels (and positions) over the CP group -- ``B S`` integers, once per batch -- rolls the
whole sequence and returns this rank's part of every head, in the same layout.

**Counts.** ``linear_mtp_loss(..., num_valid_tokens=)`` takes one divisor per head:
:func:`count_head_tokens` sums each head's valid tokens over the microbatches of a step and over
the ranks that hold different tokens (DP and CP; never TP).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import comm

__all__ = ["mtp_labels", "context_parallel_shard", "context_parallel_labels", "count_head_tokens"]


def mtp_labels(labels: torch.Tensor, depths: int, *, positions: torch.Tensor | None = None,
               ignore_index: int = -100) -> list[torch.Tensor]:
    """The labels of the main head and of MTP depths ``1..depths``.

    Args:
        labels: ``[..., S]`` next-token labels (the main head's), integer ids.
        depths: ``D >= 0``, the MTP depths.
        positions: optional ``[..., S]`` reset-style position ids of packed documents.
        ignore_index: the fill of positions without a label.

    Returns:
        ``D + 1`` tensors of ``labels``' shape: ``[labels, depth 1, ..., depth D]``, depth ``d``
        being ``labels[..., i + d]`` at ``i`` (``ignore_index`` past the end, or across a document
        boundary). A depth ``d >= S`` is all ``ignore_index``.
    """
    if positions is not None and positions.shape != labels.shape:
        raise ValueError(f"positions shape {tuple(positions.shape)} does not match labels {tuple(labels.shape)}")
    if not isinstance(depths, int) or isinstance(depths, bool) or depths < 0:
        raise ValueError(f"depths must be an int >= 0, got {depths!r}")
    return [labels] + [_roll(labels, d, positions, ignore_index) for d in range(1, depths + 1)]


def _roll(labels: torch.Tensor, d: int, positions: torch.Tensor | None, fill: int) -> torch.Tensor:
    s = labels.shape[-1]
    out = torch.full_like(labels, fill)
    if d >= s:
        return out
    src = labels[..., d:]
    if positions is not None:  # the source is d tokens later in the same document
        src = torch.where(positions[..., d:] == positions[..., : s - d] + d, src, fill)
    out[..., : s - d] = src
    return out


def context_parallel_shard(x: torch.Tensor, rank: int, world: int, *, load_balanced: bool = False,
                           dim: int = -1) -> torch.Tensor:
    """This CP rank's part of ``x`` along its sequence dim ``dim`` (``-1`` for ``[..., S]`` ids,
    ``-2`` for ``[..., S, H]`` hidden states): the ``rank``-th of ``world`` equal parts, or with
    ``load_balanced`` parts ``rank`` and ``2 world - 1 - rank`` of ``2 world`` (torch's head-tail
    layout, torchtitan's for causal attention). ``S`` must divide evenly."""
    parts = 2 * world if load_balanced else world
    if x.shape[dim] % parts:
        raise ValueError(f"a sequence of {x.shape[dim]} tokens does not split into {parts} equal CP parts")
    pieces = x.chunk(parts, dim=dim)
    if not load_balanced:
        return pieces[rank]
    return torch.cat([pieces[rank], pieces[2 * world - 1 - rank]], dim=dim)


def _unshard(shard: torch.Tensor, group, load_balanced: bool) -> torch.Tensor:
    """The whole ``[..., S]`` sequence from every CP rank's shard (one all-gather)."""
    world = comm.world_size(group)
    every = comm.all_gather_rows(shard.movedim(-1, 0).contiguous(), group).movedim(0, -1)
    per_rank = every.chunk(world, dim=-1)  # rank order
    if not load_balanced:
        return torch.cat(per_rank, dim=-1)
    heads = [p.chunk(2, dim=-1) for p in per_rank]  # rank r holds parts r and 2W - 1 - r
    return torch.cat([h[0] for h in heads] + [h[1] for h in reversed(heads)], dim=-1)


def context_parallel_labels(labels: torch.Tensor, *, group=None, depths: int = 0,
                            positions: torch.Tensor | None = None, load_balanced: bool = False,
                            next_token: bool = False, ignore_index: int = -100) -> list[torch.Tensor]:
    """Every head's labels of this CP rank's tokens, with the labels that lie on other ranks.

    Args:
        labels: this rank's CP shard ``[..., S / W]`` of the sequence's next-token labels (or,
            with ``next_token``, of its input token ids).
        group: the CP ProcessGroup / 1-D DeviceMesh (None or one rank: no sharding).
        depths: MTP depths ``D`` (0: the main head only).
        positions: this rank's shard of the reset-style positions (packed documents), or None.
        load_balanced: the shards are in the head-tail layout (:func:`context_parallel_shard`).
        next_token: ``labels`` are input ids; head 0's label of position ``i`` is the id at
            ``i + 1`` (``ignore_index`` at the sequence's end; across packed documents as a data
            loader shifts a packed stream, i.e. not masked).
        ignore_index: the fill of positions without a label.

    Returns:
        ``D + 1`` tensors, this rank's shard of each head's labels (:func:`mtp_labels` of the whole
        sequence), in the input's layout. Communication: one all-gather of the shard (two with
        ``positions``) over the CP group.
    """
    group = comm.resolve_group(group)
    world, rank = comm.world_size(group), comm.rank(group)
    full = _unshard(labels, group, load_balanced) if world > 1 else labels
    full_pos = None
    if positions is not None:
        full_pos = _unshard(positions, group, load_balanced) if world > 1 else positions
    if next_token:
        full = _roll(full, 1, None, ignore_index)
    heads = mtp_labels(full, depths, positions=full_pos, ignore_index=ignore_index)
    if world == 1:
        return heads
    return [context_parallel_shard(h, rank, world, load_balanced=load_balanced) for h in heads]


def count_head_tokens(heads, *, group=None, ignore_index: int = -100) -> torch.Tensor:
    """Each head's valid tokens of a step: the ``num_valid_tokens`` of :func:`vparallel_ce.linear_mtp_loss`
    for an exact gradient accumulation over microbatches and DP / CP ranks.

    Args:
        heads: one microbatch's head labels (``D + 1`` tensors, :func:`mtp_labels` /
            :func:`context_parallel_labels`), or a list of them (the step's microbatches).
        group: the ProcessGroup / 1-D DeviceMesh of the ranks that hold DIFFERENT tokens -- DP, and
            CP when the labels are CP shards -- or a sequence of such groups (e.g. ``(dp_group,
            cp_group)``: summed over each). Never the TP group (its ranks hold the same tokens).

    Returns:
        An int64 ``[D + 1]`` tensor on the labels' device (no host sync), the same on every rank of
        the group(s).
    """
    if not isinstance(heads, Sequence) or not heads:
        raise ValueError("count_head_tokens: heads must be a non-empty sequence of head labels")
    batches = [heads] if isinstance(heads[0], torch.Tensor) else list(heads)
    sizes = {len(b) for b in batches}
    if len(sizes) != 1:
        raise ValueError(f"count_head_tokens: every microbatch must have the same number of heads, got {sorted(sizes)}")
    n = torch.stack([torch.stack([t.ne(ignore_index).sum() for t in b]) for b in batches]).sum(0).to(torch.int64)
    groups = group if isinstance(group, (list, tuple)) else (group,)
    for g in groups:
        comm.all_reduce_sum_(n, comm.resolve_group(g))
    return n
