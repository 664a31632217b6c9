"""What torchtitan 0.3.0 needs from torch >= 2.12, stood in for on torch 2.11, for a ONE-GPU run.

Only for torch < 2.12 (torch 2.11 in practice) and world size 1: no FSDP sharding, no HSDP, no
TP/CP/EP/PP. torchtitan_bench.py calls :func:`apply` before it imports torchtitan when given
``--torch211-compat`` (torchtitan_gpu.sh passes it); on a torch that has the names it does nothing.

torchtitan 0.3.0 is written against torch >= 2.12. On torch 2.11 its import stops at::

    from torch.distributed.fsdp import DataParallelMeshDims

(in torchtitan.distributed.fsdp and .full_dtensor, which every model's parallelize imports).
``DataParallelMeshDims(shard=..., replicate=...)`` is FSDP2's description of which named axes of a
multi-axis SPMD mesh are data-parallel, handed to ``fully_shard(..., dp_mesh_dims=...)``; torch
2.11's ``fully_shard`` has no such parameter. On a world-1 dense run torchtitan never builds one:
with its default ``spmd_types`` backend, ``full_dtensor.resolve_fsdp_mesh`` returns ``None`` for a
mesh of size 1, and the ``partial_dtensor`` backend passes ``None``; ``apply_fsdp_to_decoder`` then
calls ``fully_shard`` without ``dp_mesh_dims``, as torch 2.11 takes it. The name is otherwise only
an annotation (``DataParallelMeshDims | None``, evaluated when the modules load). So the stand-in is
a class of that name that cannot be built: where torchtitan would need a real one (the
``full_dtensor`` backend, a sharded or replicated data-parallel mesh, expert parallelism), the run
stops with this module's message instead of handing torch 2.11 something it cannot honour.

The rest of what the world-1 llama3 trainer uses exists in torch 2.11 (checked against torch
2.11.0's sources: every torch name that torchtitan's and spmd_types' modules import or reference,
and the parameters of every torch function the trainer called in a CPU run), except
``torch.distributed.set_timeout``, called after the first step, which torch 2.13 lacks as well:
torchtitan_bench.py gives every torch one. Also missing from 2.11, not stood in for, off the
world-1 dense path: ``fsdp._fully_shard._fsdp_common.ShardPlacementResult`` (imported inside
torchtitan's expert-parallel branch), ``torch.compiler._is_non_strict_tracing`` (MoE token
dispatch), ``torch.distributed._mesh_layout._FlatLayout`` (spmd_types falls back to
``_MeshLayout`` itself).
"""

from __future__ import annotations

import os

NEEDS = "torch >= 2.12"


class DataParallelMeshDims:
    """Name-only stand-in for torch >= 2.12's ``torch.distributed.fsdp.DataParallelMeshDims``
    (fields ``shard`` and ``replicate``: mesh axis names). Building one raises: torch 2.11's FSDP
    cannot take it."""

    def __init__(self, shard=None, replicate=None):
        raise NotImplementedError(
            f"torchtitan asked for FSDP over data-parallel mesh axes (shard={shard!r}, "
            f"replicate={replicate!r}): fully_shard(dp_mesh_dims=...) needs {NEEDS}. The torch 2.11 "
            "stand-in (launch/cluster/torch211_compat.py) covers one-GPU runs with the spmd_types or "
            "partial_dtensor backend only.")


def apply() -> list[str]:
    """Install the stand-ins that this torch lacks; the names installed (empty on torch >= 2.12).

    Raises ``RuntimeError`` when one is needed and ``WORLD_SIZE`` is above 1."""
    import torch.distributed.fsdp as fsdp

    missing = [] if hasattr(fsdp, "DataParallelMeshDims") else ["torch.distributed.fsdp.DataParallelMeshDims"]
    if not missing:
        return []
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != 1:
        raise RuntimeError(f"{', '.join(missing)} missing (torchtitan 0.3.0 needs {NEEDS}); the torch 2.11 "
                           f"stand-ins are for a world of 1, WORLD_SIZE is {world}")
    fsdp.DataParallelMeshDims = DataParallelMeshDims
    return missing
