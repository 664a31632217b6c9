"""Every collective of the library, and the only module that calls ``torch.distributed``.

"Which ranks talk, how often, how many bytes" is answerable here:

* per token chunk of a loss: one all-reduce MAX and one all-reduce SUM of ``O(chunk tokens)`` floats
  (:func:`all_reduce_max_`, :func:`all_reduce_sum_`); with ``batch_invariant=True`` the SUM is an
  all-gather of ``O(world * chunk tokens)`` floats added in rank order
  (:func:`all_reduce_sum_rank_ordered`), and so is the linear ops' hidden gradient, chunk by chunk;
* once per call: an all-gather of a fixed number of integers (shard sizes, target range and the
  agreement's facts, :func:`all_gather_ints`), skipped with ``check=False`` when the global vocab
  size is known; only where that finds a bad input or a disagreement, an all-gather of each rank's
  message or value to name them (:func:`all_gather_objects`, then the call raises);
* with sequence parallelism: an all-gather of each hidden/target chunk (:func:`all_gather_rows`) and
  a reduce-scatter of its hidden gradient (:func:`reduce_scatter_rows`); the token counts of the
  ranks once per call;
* the pipeline adapter: a SUM of the step's valid-token count over DP and of the step loss over
  PP/DP (:func:`all_reduce_sum_` on a group), or a broadcast of it (:func:`broadcast_`).

Every function takes a ProcessGroup (already resolved by :func:`resolve_group`) and is a no-op on
``None`` or a group of one rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = [
    "resolve_group", "world_size", "rank", "is_sharded", "backend", "all_reduce_max_", "all_reduce_sum_",
    "all_reduce_sum_rank_ordered",
    "broadcast_", "all_gather_ints", "all_gather_objects", "all_gather_rows", "all_gather_last_dim",
    "reduce_scatter_rows",
]


def resolve_group(group):
    """Accept ``None``, a ``ProcessGroup`` or a 1-D ``DeviceMesh``; return a ProcessGroup or None."""
    if group is None:
        return None
    mesh_cls = _device_mesh_cls()
    if mesh_cls is not None and isinstance(group, mesh_cls):
        if group.ndim != 1:
            raise ValueError(
                f"group: a DeviceMesh must be 1-D (the vocab-parallel dim), got a {group.ndim}-D mesh; "
                "pass mesh['tp'] or its process group"
            )
        return group.get_group()
    if isinstance(group, dist.ProcessGroup):
        return group
    _refuse_non_member(group)
    raise TypeError(f"group must be a ProcessGroup, a 1-D DeviceMesh or None, got {type(group).__name__}")


def _refuse_non_member(group) -> None:
    """``dist.new_group`` gives the processes outside the new group a marker, not a group: a loss
    called with it on such a process is a call outside its group, said as that."""
    marker = getattr(getattr(dist, "GroupMember", None), "NON_GROUP_MEMBER", object())
    if group is marker or (isinstance(group, int) and not isinstance(group, bool) and group == marker):
        me = dist.get_rank() if dist.is_initialized() else "?"
        raise ValueError(f"this process (global rank {me}) is not a member of the group it passed: "
                         "dist.new_group gives GroupMember.NON_GROUP_MEMBER to the processes outside the group; "
                         "call the loss only on the ranks of its group (or pass the group this rank belongs to)")


def _device_mesh_cls():
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:  # pragma: no cover - very old torch
        return None
    return DeviceMesh


def world_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def process_count() -> int:
    """The default process group's size (1 where torch.distributed is not initialised)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


def is_sharded(group) -> bool:
    return world_size(group) > 1


def backend(group) -> str | None:
    return None if group is None else dist.get_backend(group)


def global_rank(group, group_rank: int) -> int:
    return dist.get_global_rank(group, group_rank)


def all_reduce_max_(t: torch.Tensor, group) -> torch.Tensor:
    if is_sharded(group):
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t


def all_reduce_sum_(t: torch.Tensor, group) -> torch.Tensor:
    if is_sharded(group):
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


def all_reduce_sum_rank_ordered(t: torch.Tensor, group) -> torch.Tensor:
    """The sum of ``t`` over the group, added in rank order: ``((t_0 + t_1) + t_2) + ...`` on every
    rank, whatever the message size. A SUM all-reduce's order is the backend's (NCCL's ring or
    tree, chunked by message size), so an element's rounding would depend on how many elements
    travel with it; this all-gathers ``[world, *t.shape]`` (``world`` times the bytes) and adds
    locally. Returns a new tensor (``t`` itself on one rank)."""
    if not is_sharded(group):
        return t
    return _gathered_sum(t, group, slice(None))


def _gathered_sum(t: torch.Tensor, group, rows: slice) -> torch.Tensor:
    """``rows`` of every rank's ``t`` added in rank order, from an all-gather: a new tensor."""
    parts = [torch.empty_like(t) for _ in range(world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    total = parts[0][rows]
    for p in parts[1:]:  # elementwise, one rank at a time: the order is the rank order
        total += p[rows]
    return total


def broadcast_(t: torch.Tensor, group, src_group_rank: int) -> torch.Tensor:
    if is_sharded(group):
        dist.broadcast(t, src=global_rank(group, src_group_rank), group=group)
    return t


def all_gather_ints(values: list, group, device) -> list[list[int]]:
    """Every rank's list of integers, in rank order. ``values`` may hold 0-dim device tensors (a
    target checksum): they are stacked on device, so gathering them adds no extra host sync."""
    t = torch.stack([torch.as_tensor(v, device=device).to(torch.int64).reshape(()) for v in values])
    if not is_sharded(group):
        return [t.tolist()]
    out = [torch.empty_like(t) for _ in range(world_size(group))]
    dist.all_gather(out, t, group=group)
    return [o.tolist() for o in out]


def all_gather_objects(obj, group) -> list:
    """Every rank's picklable ``obj``, in rank order: the second exchange of a call whose first one
    found a disagreement or a bad input (never on a call that goes ahead), to name each rank's
    value in the error."""
    if not is_sharded(group):
        return [obj]
    out = [None] * world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def all_gather_rows(x: torch.Tensor, group) -> torch.Tensor:
    """Concatenate every rank's ``x`` (same shape on all ranks) along dim 0, in rank order."""
    if not is_sharded(group):
        return x
    parts = [torch.empty_like(x) for _ in range(world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=0)


def all_gather_last_dim(x: torch.Tensor, group, sizes: list[int]) -> torch.Tensor:
    """The full ``[..., sum(sizes)]`` tensor from every rank's ``[..., sizes[rank]]`` piece (the
    unfused reference loss only: this is the memory the fused ops avoid)."""
    if not is_sharded(group):
        return x
    width = max(sizes)
    padded = torch.nn.functional.pad(x, (0, width - x.shape[-1])).contiguous()
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([p[..., :n] for p, n in zip(parts, sizes)], dim=-1)


def reduce_scatter_rows_rank_ordered(x: torch.Tensor, group) -> torch.Tensor:
    """:func:`reduce_scatter_rows` with every row added in rank order, ``((x_0 + x_1) + x_2) +
    ...``, whatever the message size (:func:`all_reduce_sum_rank_ordered`'s reason): an all-gather
    of ``x`` (``world`` times the bytes), then this rank's rows summed locally."""
    if not is_sharded(group):
        return x
    m = x.shape[0] // world_size(group)
    me = rank(group)
    return _gathered_sum(x, group, slice(me * m, (me + 1) * m))


def reduce_scatter_rows(x: torch.Tensor, group) -> torch.Tensor:
    """Sum ``x`` (``[world * m, ...]``) over the group and return this rank's ``m`` rows. Uses
    reduce_scatter where the backend has it (NCCL), else all-reduce + slice (gloo has none)."""
    if not is_sharded(group):
        return x
    world, me = world_size(group), rank(group)
    m = x.shape[0] // world
    if backend(group) == "gloo":
        x = x.contiguous()
        dist.all_reduce(x, group=group)
        return x[me * m : (me + 1) * m]
    out = torch.empty((m, *x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.reduce_scatter_tensor(out, x.contiguous(), group=group)
    return out
