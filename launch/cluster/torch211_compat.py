"""What torchtitan 0.3.0 needs from torch >= 2.12, stood in for on torch 2.11, for a ONE-GPU run.

Only for torch < 2.12 (torch 2.11 in practice) and world size 1: no FSDP sharding, no HSDP, no
TP/CP/EP/PP. torchtitan_bench.py calls :func:`apply` before it imports torchtitan when given
``--torch211-compat`` (torchtitan_gpu.sh passes it where torch lacks the first name below); each
stand-in is installed only where torch lacks what it stands in for.

1. ``torch.distributed.fsdp.DataParallelMeshDims``. torchtitan 0.3.0's import stops at
   ``from torch.distributed.fsdp import DataParallelMeshDims`` (torchtitan.distributed.fsdp and
   .full_dtensor, which every model's parallelize imports). It is FSDP2's description of which
   named axes of a multi-axis SPMD mesh are data-parallel, ``fully_shard(..., dp_mesh_dims=...)``;
   torch 2.11's ``fully_shard`` has no such parameter. On a world-1 dense run torchtitan builds
   none: with its default ``spmd_types`` backend ``full_dtensor.resolve_fsdp_mesh`` returns
   ``None`` for a mesh of size 1, the ``partial_dtensor`` backend passes ``None``, and
   ``apply_fsdp_to_decoder`` then calls ``fully_shard`` without ``dp_mesh_dims``, as torch 2.11
   takes it. Otherwise the name is only an annotation (``DataParallelMeshDims | None``, evaluated
   as the modules load). The stand-in is a class of that name that cannot be built: where
   torchtitan would need a real one (the ``full_dtensor`` backend, a sharded or replicated
   data-parallel mesh, expert parallelism) the run stops with this module's message.
2. ``create_block_mask(..., separate_full_blocks=...)`` (torch.nn.attention.flex_attention).
   torchtitan's flex attention (the llama3 configs' default) builds its BlockMask with
   ``separate_full_blocks=not is_in_batch_invariant_mode()``, a parameter torch 2.11 lacks; torch
   2.11's ``create_block_mask`` always separates the full blocks, which is what ``True`` asks
   for. The stand-in wraps torch's function: it takes ``separate_full_blocks=True`` and leaves it
   out, and refuses ``False`` (torchtitan's batch-invariant mode), which torch 2.11 cannot do.
3. The pre-backward hook of an FSDP group whose modules did not all run forward. torchtitan 0.3.0
   shards ``[norm, lm_head]`` as one FSDP group, and under ``ChunkedLossWrapper`` the model's
   forward skips the lm_head (``_skip_lm_head=True``). Newer torch (2.13's sources read) completes
   such a group at the root's post-forward (``FSDPState._force_complete_incomplete_states``),
   which hooks the norm's output so that its backward gathers the group's parameters again;
   torch 2.11 runs a group's post-forward only once every module in it has run, here at the
   wrapper's first lm_head chunk, so the norm's output gets no hook. The wrapper ends its chunks
   with an explicit ``lm_head.reshard()``, which frees the norm's unsharded weight too, and the
   decoder's backward then reads freed memory ("its data is not allocated yet" on CUDA, a crash
   on CPU). The stand-in makes that explicit ``FSDPModule.reshard()`` keep the parameters
   (FSDP's own reshards, after forward and backward, are untouched; torchtitan calls
   ``reshard()`` nowhere else). On one GPU the step's peak should be the newer torch's: there the
   group is freed at the wrapper's end and gathered again at the start of the decoder's backward,
   the step's peak; here it stays until the norm's backward has run, and one gather (a copy of
   the lm_head, at world 1) is not made.

The rest of what the world-1 llama3 trainer uses exists in torch 2.11 (checked against torch
2.11.0's sources: every torch name that torchtitan's and spmd_types' modules import or reference,
the parameters of every torch function the trainer called in a CPU run, and every keyword that
torchtitan passes to a torch function whose parameters grew after 2.11), except
``torch.distributed.set_timeout``, called after the first step, which torch 2.13 lacks as well:
torchtitan_bench.py gives every torch one. Also missing from 2.11, not stood in for, off the
world-1 dense path: ``fsdp._fully_shard._fsdp_common.ShardPlacementResult`` (imported inside
torchtitan's expert-parallel branch), ``torch.compiler._is_non_strict_tracing`` (MoE token
dispatch), ``torch.distributed._mesh_layout._FlatLayout`` (spmd_types falls back to
``_MeshLayout`` itself), pipeline stages' ``get_mesh`` and schedules' ``loss_kwargs``.
"""

from __future__ import annotations

import functools
import inspect
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


def _create_block_mask_separating_full_blocks(create_block_mask):
    """torch 2.11's ``create_block_mask`` taking ``separate_full_blocks=True`` (what it always
    does) and refusing ``False``."""

    @functools.wraps(create_block_mask)
    def wrapped(*args, separate_full_blocks: bool = True, **kwargs):
        if not separate_full_blocks:
            raise NotImplementedError(
                f"create_block_mask(separate_full_blocks=False) (torchtitan's batch-invariant mode) needs {NEEDS}: "
                "torch 2.11 always separates the full blocks")
        return create_block_mask(*args, **kwargs)

    del wrapped.__wrapped__  # its signature is this one's, which takes separate_full_blocks
    return wrapped


GROUP_COMPLETION = "FSDP groups completed at the root's post-forward (FSDPModule.reshard() kept)"


def _explicit_reshard_keeping_parameters(self) -> None:
    """torch 2.11's ``FSDPModule.reshard`` for torchtitan's ``ChunkedLossWrapper``: a no-op, so the
    norm that shares the lm_head's FSDP group keeps its weight for its backward (3. above)."""


def apply() -> list[str]:
    """Install the stand-ins that this torch lacks; the names installed (empty on torch >= 2.12).

    Raises ``RuntimeError`` when one is needed and ``WORLD_SIZE`` is above 1."""
    import torch.distributed.fsdp as fsdp
    import torch.distributed.fsdp._fully_shard._fsdp_state as fsdp_state
    import torch.nn.attention.flex_attention as flex

    missing = []
    if not hasattr(fsdp, "DataParallelMeshDims"):
        missing.append("torch.distributed.fsdp.DataParallelMeshDims")
    if "separate_full_blocks" not in inspect.signature(flex.create_block_mask).parameters:
        missing.append("create_block_mask(separate_full_blocks=True)")
    if not hasattr(fsdp_state.FSDPState, "_force_complete_incomplete_states"):
        missing.append(GROUP_COMPLETION)
    if not missing:
        return []
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != 1:
        raise RuntimeError(f"{', '.join(missing)} missing (torchtitan 0.3.0 needs {NEEDS}); the torch 2.11 "
                           f"stand-ins are for a world of 1, WORLD_SIZE is {world}")
    if "torch.distributed.fsdp.DataParallelMeshDims" in missing:
        fsdp.DataParallelMeshDims = DataParallelMeshDims
    if "create_block_mask(separate_full_blocks=True)" in missing:
        flex.create_block_mask = _create_block_mask_separating_full_blocks(flex.create_block_mask)
    if GROUP_COMPLETION in missing:
        fsdp.FSDPModule.reshard = _explicit_reshard_keeping_parameters
    return missing
