"""A drop-in for Megatron-LM's ``tensor_parallel.vocab_parallel_cross_entropy``.

Same signature and layout: ``vocab_parallel_logits`` is ``[S, B, V_local]`` (this rank's vocab
partition), ``target`` ``[S, B]`` global ids, the result the per-token loss ``[S, B]`` (fp32).
Differences, on purpose: label smoothing follows PyTorch's definition over the GLOBAL vocab
(``(1 - eps) * nll + eps * mean_j(-log p_j)``), uneven partitions in the ``torch.chunk`` layout work,
the logits are never modified in place, and out-of-range targets raise instead of giving garbage.
"""

from __future__ import annotations

import torch

from .cross_entropy import cross_entropy

__all__ = ["vocab_parallel_cross_entropy"]


def _megatron_tp_group():
    try:
        from megatron.core import parallel_state
    except ImportError as exc:
        raise ValueError(
            "vocab_parallel_cross_entropy: pass group= (the tensor-parallel ProcessGroup); "
            "megatron.core is not installed to look it up"
        ) from exc
    return parallel_state.get_tensor_model_parallel_group()


def vocab_parallel_cross_entropy(vocab_parallel_logits: torch.Tensor, target: torch.Tensor,
                                 label_smoothing: float = 0.0, *, group=None, chunks="auto") -> torch.Tensor:
    """Per-token cross-entropy ``[S, B]`` of vocab-parallel logits ``[S, B, V_local]``.

    ``group``: the TP group; by default Megatron's ``parallel_state`` tensor-model-parallel group.
    """
    if group is None:
        group = _megatron_tp_group()
    return cross_entropy(vocab_parallel_logits, target, group=group, reduction="none",
                         label_smoothing=label_smoothing, chunks=chunks)
