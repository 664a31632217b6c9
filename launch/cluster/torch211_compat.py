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
3. FSDP groups of several modules whose modules do not all run forward. torchtitan 0.3.0 shards
   ``[norm, lm_head]`` as one FSDP group (``fully_shard([model.norm, model.lm_head])``), and under
   ``ChunkedLossWrapper`` the model's forward skips the lm_head (``_skip_lm_head=True``), which then
   runs once per chunk. Newer torch (2.13's sources read) runs such a group's pre-forward at every
   module call, so each chunk's input gets the post-backward hook, and completes the group at the
   root's post-forward (``FSDPState._force_complete_incomplete_states``). torch 2.11 runs a group's
   pre-forward only when no module of the group is pending and its post-forward only once all have
   run, so here only the first two chunks get hooks: the norm's output gets no pre-backward hook
   (the wrapper's ``lm_head.reshard()`` then frees the norm's weight before its backward: "its data
   is not allocated yet"), and under bf16 mixed precision the lm_head's gradient is left half in
   the reduce dtype and half in bf16 ("FSDP reduce-scatter expects uniform gradient dtype"). The
   stand-in shards each module of a ``fully_shard([...])`` list as a group of its own, which torch
   2.11's single-module hooks handle at every call. It refuses modules that share a parameter (a
   tied embedding and lm_head, which torchtitan groups as one unit). On one GPU a group only saves
   collective calls, each a local copy here; the norm's weight (``dim`` numbers) is gathered on
   its own.

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

import torch.nn as nn

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


GROUPS = "fully_shard([modules]) as one group per module (torch 2.11 completes a group only when all of it ran)"


def _one_group_per_module(fully_shard):
    """``fully_shard`` that shards each module of a list as its own group (3. above)."""

    @functools.wraps(fully_shard)
    def wrapped(module, *args, **kwargs):
        if isinstance(module, nn.Module) or len(module) == 1:
            return fully_shard(module, *args, **kwargs)
        seen: dict[int, str] = {}
        for i, m in enumerate(module):
            for name, p in m.named_parameters():
                if id(p) in seen:
                    raise NotImplementedError(
                        f"fully_shard of modules that share a parameter ({seen[id(p)]} and module {i}'s {name}, "
                        f"e.g. tied embeddings) needs {NEEDS}: the torch 2.11 stand-in shards each module of a "
                        "group on its own")
                seen[id(p)] = f"module {i}'s {name}"
        for m in module:
            fully_shard(m, *args, **kwargs)
        return module

    return wrapped


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
        missing.append(GROUPS)
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
    if GROUPS in missing:
        fsdp.fully_shard = _one_group_per_module(fsdp.fully_shard)
    return missing
