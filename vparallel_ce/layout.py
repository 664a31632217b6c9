"""Who holds which vocabulary rows, and every collective the losses use.

The vocabulary of size ``V`` is split over a tensor-parallel group of ``W`` ranks in the
``torch.chunk`` layout (the same as DTensor ``Shard``): with ``s = ceil(V / W)``, rank ``r`` holds
ids ``[min(r*s, V), min((r+1)*s, V))`` -- trailing ranks may hold an empty shard.

All communication of the library goes through the small functions at the bottom of this file, so
"which ranks talk, how often, how many bytes" is answerable here:

* per token chunk: one all-reduce MAX and one all-reduce SUM, each ``O(chunk tokens)`` floats;
* once per call: an all-gather of a few integers (shard sizes and agreement checks), skipped with
  ``check=False`` when the global vocab size is known;
* with sequence parallelism: an all-gather of each hidden/target chunk and a reduce-scatter of the
  hidden gradient chunk.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["VocabLayout", "resolve_group", "shard_range", "vocab_layout", "group_size"]


def resolve_group(group):
    """Accept ``None``, a ``ProcessGroup`` or a 1-D ``DeviceMesh``; return a ProcessGroup or None.

    A group of size 1 (or ``None``) means "unsharded": no collective is ever issued.
    """
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
    raise TypeError(f"group must be a ProcessGroup, a 1-D DeviceMesh or None, got {type(group).__name__}")


def _device_mesh_cls():
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:  # pragma: no cover - very old torch
        return None
    return DeviceMesh


def group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def shard_range(vocab_size: int, world: int, rank: int) -> tuple[int, int]:
    """``(offset, size)`` of rank ``rank``'s shard in the torch.chunk layout."""
    step = math.ceil(vocab_size / world) if vocab_size > 0 else 0
    start = min(rank * step, vocab_size)
    stop = min((rank + 1) * step, vocab_size)
    return start, stop - start


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


def vocab_layout(
    local_size: int,
    group,
    *,
    device: torch.device,
    vocab_size: int | None = None,
    check: bool = True,
    agree: dict[str, int] | None = None,
    problem=None,
) -> VocabLayout:
    """Build the layout of this rank's shard and check that the group agrees on it.

    Args:
        local_size: this rank's number of vocab rows (last dim of the logits / dim 0 of the weight).
        group: resolved ProcessGroup or None.
        vocab_size: the global vocab size if the caller knows it (a DTensor does).
        check: exchange shard sizes and ``agree`` values across the group (one all-gather of a few
            int64s) and raise the same ``ValueError`` on every rank when they do not fit. Needed
            anyway when ``vocab_size`` is unknown.
        agree: named integers that must be equal on every rank (token count, chunk count, ...):
            ranks that disagree on the chunk count would otherwise deadlock in the per-chunk
            collectives.
        problem: this rank's local input problem (a :class:`vparallel_ce.validate.Problem`), shared
            through the exchange so that every rank raises, not just this one.
    """
    world = group_size(group)
    if problem is not None and (world == 1 or not (check or vocab_size is None)):
        problem.raise_()
    if world == 1:
        v = local_size if vocab_size is None else vocab_size
        if v != local_size:
            raise ValueError(f"vocab_size={vocab_size} but the unsharded logits have {local_size} classes")
        return VocabLayout(None, 1, 0, v, 0, local_size)
    rank = dist.get_rank(group)
    if check or vocab_size is None:
        names = sorted(agree or {})
        mine = [int(problem is not None), local_size, -1 if vocab_size is None else vocab_size]
        mine += [agree[n] for n in names]
        rows = _all_gather_ints(mine, group, device)
        bad = [r for r, row in enumerate(rows) if row[0]]
        if problem is not None:
            problem.raise_()
        if bad:
            from .validate import InvalidInputError

            raise InvalidInputError(f"invalid input on rank(s) {bad} of the vocab-parallel group (see the error there)")
        rows = [row[1:] for row in rows]
        sizes = [row[0] for row in rows]
        _check_agreement(rows, names)
        total = sum(sizes)
        if vocab_size is not None and total != vocab_size:
            raise ValueError(
                f"shard sizes {sizes} add up to {total}, but vocab_size is {vocab_size}: "
                "each rank must pass its torch.chunk slice of the vocab"
            )
        expected = [shard_range(total, world, r)[1] for r in range(world)]
        if sizes != expected:
            raise ValueError(
                f"vocab shard sizes over the group are {sizes}; the torch.chunk layout of V={total} "
                f"over {world} ranks is {expected} (rank r must hold torch.chunk(full, {world}, -1)[r])"
            )
        vocab_size = total
    offset, size = shard_range(vocab_size, world, rank)
    if size != local_size:
        raise ValueError(
            f"rank {rank} holds {local_size} vocab rows, but the torch.chunk layout of V={vocab_size} "
            f"over {world} ranks gives it {size}"
        )
    return VocabLayout(group, world, rank, vocab_size, offset, local_size)


def _all_gather_ints(values: list, group, device) -> list[list[int]]:
    # values may hold 0-dim device tensors (a target checksum): stacked on device, no extra sync
    t = torch.stack([torch.as_tensor(v, device=device).to(torch.int64).reshape(()) for v in values])
    out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, t, group=group)
    return [o.tolist() for o in out]


def _check_agreement(rows: list[list[int]], names: list[str]) -> None:
    """Raise the same error on every rank when the ranks disagree (all ranks hold all rows)."""
    vocab_claims = {row[1] for row in rows}
    if len(vocab_claims) > 1:
        raise ValueError(f"ranks of the group disagree on vocab_size: {sorted(vocab_claims)}")
    for i, name in enumerate(names):
        values = [row[2 + i] for row in rows]
        if len(set(values)) > 1:
            raise ValueError(
                f"ranks of the vocab-parallel group disagree on {name}: {values} "
                "(every rank of the group must pass the same tokens and options)"
            )


# ---------------------------------------------------------------------------------------------
# Collectives. Each is a no-op on an unsharded layout.


def all_reduce_max_(t: torch.Tensor, layout: VocabLayout) -> torch.Tensor:
    if layout.sharded:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=layout.group)
    return t


def all_reduce_sum_(t: torch.Tensor, layout: VocabLayout) -> torch.Tensor:
    if layout.sharded:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=layout.group)
    return t


def all_gather_rows(x: torch.Tensor, layout: VocabLayout) -> torch.Tensor:
    """Concatenate every rank's ``x`` (same shape on all ranks) along dim 0, in rank order."""
    if not layout.sharded:
        return x
    parts = [torch.empty_like(x) for _ in range(layout.world)]
    dist.all_gather(parts, x.contiguous(), group=layout.group)
    return torch.cat(parts, dim=0)


def all_gather_last_dim(x: torch.Tensor, layout: VocabLayout) -> torch.Tensor:
    """The full ``[..., V]`` tensor from every rank's torch.chunk shard ``[..., V_local]`` (the
    unfused reference path only: this is the memory the fused ops avoid)."""
    if not layout.sharded:
        return x
    width = shard_range(layout.vocab_size, layout.world, 0)[1]
    padded = torch.nn.functional.pad(x, (0, width - x.shape[-1])).contiguous()
    parts = [torch.empty_like(padded) for _ in range(layout.world)]
    dist.all_gather(parts, padded, group=layout.group)
    sizes = [shard_range(layout.vocab_size, layout.world, r)[1] for r in range(layout.world)]
    return torch.cat([p[..., :n] for p, n in zip(parts, sizes)], dim=-1)


def reduce_scatter_rows(x: torch.Tensor, layout: VocabLayout) -> torch.Tensor:
    """Sum ``x`` (``[world * m, ...]``, same on all ranks' shapes) over the group and return this
    rank's ``m`` rows. Uses reduce_scatter where the backend has it (NCCL), else all-reduce + slice
    (gloo has no reduce-scatter)."""
    if not layout.sharded:
        return x
    m = x.shape[0] // layout.world
    if dist.get_backend(layout.group) == "gloo":
        x = x.contiguous()
        dist.all_reduce(x, group=layout.group)
        return x[layout.rank * m : (layout.rank + 1) * m]
    out = torch.empty((m, *x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.reduce_scatter_tensor(out, x.contiguous(), group=layout.group)
    return out


# ---------------------------------------------------------------------------------------------
# DTensor inputs: find the mesh dim the vocab (or tokens) is sharded over and take the local shard.


def _dtensor_cls():
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover
        return None
    return DTensor


def is_dtensor(t) -> bool:
    cls = _dtensor_cls()
    return cls is not None and isinstance(t, cls)


def _sharded_mesh_dim(t, dim: int, what: str):
    """The single mesh dim over which DTensor ``t`` is ``Shard(dim)`` (None if none); the other
    mesh dims must be Replicate."""
    from torch.distributed.tensor import Replicate, Shard

    dim = dim % t.ndim
    found = None
    for mesh_dim, p in enumerate(t.placements):
        if isinstance(p, Shard) and p.dim % t.ndim == dim:
            found = mesh_dim
        elif not isinstance(p, Replicate):
            raise ValueError(
                f"{what} is a DTensor with placements {tuple(t.placements)}: it must be Shard({dim}) over one "
                "mesh dim and Replicate over the others"
            )
    return found


def _group_of(t, mesh_dim, group, what):
    mesh_group = t.device_mesh.get_group(mesh_dim)
    if group is not None:
        given = resolve_group(group)
        if dist.get_world_size(given) != dist.get_world_size(mesh_group):
            raise ValueError(
                f"group has {dist.get_world_size(given)} ranks but {what}'s DTensor mesh dim "
                f"{mesh_dim} has {dist.get_world_size(mesh_group)}"
            )
    return mesh_group


def _plain(t, what: str):
    """A replicated DTensor's local tensor; plain tensors pass through."""
    if not is_dtensor(t):
        return t
    from torch.distributed.tensor import Replicate

    if not all(isinstance(p, Replicate) for p in t.placements):
        raise ValueError(f"{what} is a DTensor with placements {tuple(t.placements)}; it must be replicated")
    return t.to_local()


def unwrap_logits(logits, target, group, vocab_size):
    """DTensor logits sharded on the last dim -> (local logits, target, group, V)."""
    if not is_dtensor(logits):
        return logits, _plain(target, "target"), group, vocab_size
    mesh_dim = _sharded_mesh_dim(logits, -1, "logits")
    full_v = logits.shape[-1]
    if mesh_dim is None:
        raise ValueError(
            f"logits is a DTensor with placements {tuple(logits.placements)}: it must be sharded on its last "
            "(vocab) dim, e.g. the output of ColwiseParallel(use_local_output=False)"
        )
    if vocab_size is not None and vocab_size != full_v:
        raise ValueError(f"vocab_size={vocab_size} but the DTensor logits have {full_v} classes")
    group = _group_of(logits, mesh_dim, group, "logits")
    return logits.to_local(), _plain(target, "target"), group, full_v


def unwrap_linear(hidden, weight, target, bias, group, sequence_parallel):
    """DTensor weight (``Shard(0)``) / hidden (Replicate, or ``Shard`` on a token dim with
    sequence parallelism) -> local tensors, the group and ``V``."""
    vocab_size = None
    if is_dtensor(weight):
        mesh_dim = _sharded_mesh_dim(weight, 0, "weight")
        if mesh_dim is None or weight.device_mesh.ndim != 1:
            raise ValueError(
                f"weight is a DTensor with placements {tuple(weight.placements)} on a {weight.device_mesh.ndim}-D "
                "mesh: expected the lm_head shard of ColwiseParallel (Shard(0) on a 1-D TP mesh). An FSDP-sharded "
                "parameter outside its module's forward is not the vocab shard; unshard it first"
            )
        vocab_size = weight.shape[0]
        group = _group_of(weight, mesh_dim, group, "weight")
        weight = weight.to_local()
    if bias is not None and is_dtensor(bias):
        bias = bias.to_local()
    if is_dtensor(hidden):
        # with sequence parallelism the local token shard is what the op wants; the target must be
        # sharded the same way (same local shape)
        hidden = hidden.to_local() if sequence_parallel else _plain(hidden, "hidden (without sequence_parallel)")
    if is_dtensor(target):
        target = target.to_local()
    return hidden, weight, target, bias, group, vocab_size
