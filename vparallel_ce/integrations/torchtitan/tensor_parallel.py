"""Where torchtitan 0.3's lm_head output lives under tensor parallelism, per SPMD backend.

torchtitan's ``parallelism.spmd_backend`` decides what the losses receive:

* ``"spmd_types"`` (the default): plain local tensors typed by the ``spmd_types`` package. The
  logits are this rank's ``[B, S, V_local]`` vocab shard, the lm_head weight its ``[V_local, H]``
  rows (torchtitan shards the vocab like ``torch.chunk``, the layout the ops expect), and the TP
  group is the current SPMD mesh's ``"tp"`` axis. The hidden states the root norm hands the lm_head
  are typed ``R`` (replicate) on that axis: the gradient that flows back into them is expected to
  be *partial* -- each rank's vocab shard's part -- and the norm's backward sums it over TP (an
  all-reduce, or a reduce-scatter with sequence parallelism).
* ``"partial_dtensor"``: DTensors on the TP mesh -- ``Shard(-1)`` logits, a ``Shard(0)`` weight,
  ``Replicate`` hidden states whose gradient is the full one -- which the ops read directly.
* ``"full_dtensor"``: DTensors over every mesh axis (batch-sharded over DP as well); not supported
  by these losses, which say so.

Without TP every backend gives plain full-vocab tensors.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from torchtitan.distributed.spmd_types import current_spmd_mesh, spmd_mesh_size
from torchtitan.distributed.utils import get_spmd_backend

__all__ = ["tp_group", "check_backend", "hidden_grad_for_decoder"]


def check_backend(labels: torch.Tensor, loss_name: str) -> None:
    """Refuse the ``full_dtensor`` backend (labels arrive as DTensors there)."""
    if isinstance(labels, DTensor) or get_spmd_backend() == "full_dtensor":
        raise ValueError(
            f"{loss_name} does not support parallelism.spmd_backend='full_dtensor' (DTensors over every mesh "
            "axis); use 'spmd_types' (torchtitan's default) or 'partial_dtensor'"
        )


def tp_group(*tensors: torch.Tensor):
    """The process group the vocab is sharded over for these plain local tensors: the SPMD mesh's
    TP group under the ``spmd_types`` backend with TP > 1, else None (DTensors carry their mesh;
    without TP nothing is sharded)."""
    if any(isinstance(t, DTensor) for t in tensors):
        return None
    if get_spmd_backend() == "spmd_types" and spmd_mesh_size("tp") > 1:
        return current_spmd_mesh().get_group("tp")
    return None


def hidden_grad_for_decoder(full_grad: torch.Tensor, group) -> torch.Tensor:
    """The hidden-state gradient to hand torchtitan's decoder, from the FULL gradient (summed over
    the vocab shards) that ``linear_cross_entropy`` makes.

    Under ``spmd_types`` with TP (``group`` set) the decoder's root norm sums what it gets over TP,
    as for the partial gradients of its own lm_head: one rank hands the sum on and the others zeros
    (the backward of spmd_types' ``convert(R, I)``), so the norm's sum is the full gradient once.
    DTensor and unsharded gradients go back as they are."""
    if group is None or group.rank() == 0:
        return full_grad
    return torch.zeros_like(full_grad)
