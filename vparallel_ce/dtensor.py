"""DTensor inputs: find the mesh dim the vocab (or tokens) is sharded over and take the local
shard (step 1 of the front door, :mod:`vparallel_ce.call`). ``DTensor`` is imported on first use.
"""

from __future__ import annotations

from . import comm

__all__ = ["is_dtensor", "local"]


def _dtensor_cls():
    """``DTensor``, imported on first use (four checks per call: the import statement's own cost
    added up before every call's first kernel)."""
    global _DTENSOR
    if _DTENSOR is False:
        try:
            from torch.distributed.tensor import DTensor
        except ImportError:  # pragma: no cover
            DTensor = None
        _DTENSOR = DTensor
    return _DTENSOR


_DTENSOR = False  # not looked up yet


def is_dtensor(t) -> bool:
    cls = _dtensor_cls()
    return cls is not None and isinstance(t, cls)


def local(t):
    """A DTensor's local shard; anything else as it is."""
    return t.to_local() if is_dtensor(t) else t


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
        given = comm.world_size(comm.resolve_group(group))
        if given != comm.world_size(mesh_group):
            raise ValueError(
                f"group has {given} ranks but {what}'s DTensor mesh dim {mesh_dim} has "
                f"{comm.world_size(mesh_group)}"
            )
    return mesh_group


def _replicated(t, what: str):
    """A replicated DTensor's local tensor; plain tensors pass through."""
    if not is_dtensor(t):
        return t
    from torch.distributed.tensor import Replicate

    if not all(isinstance(p, Replicate) for p in t.placements):
        raise ValueError(f"{what} is a DTensor with placements {tuple(t.placements)}; it must be replicated")
    return t.to_local()


def _unwrap_logits(logits, target, group, vocab_size):
    """DTensor logits sharded on the last dim -> (local logits, target, group, V)."""
    if not is_dtensor(logits):
        return logits, _replicated(target, "target"), group, vocab_size
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
    return logits.to_local(), _replicated(target, "target"), group, full_v


def _unwrap_linear(hidden, weight, target, bias, group, sequence_parallel):
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
    # with sequence parallelism the local token shard is what the op wants; the target must be
    # sharded the same way (same local shape)
    if sequence_parallel:
        hidden = local(hidden)
    else:
        hidden = _replicated(hidden, "hidden (without sequence_parallel)")
    return hidden, weight, local(target), local(bias), group, vocab_size
