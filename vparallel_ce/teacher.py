"""A distillation's teacher as the two distillation ops' autograd Functions see it, one token chunk
at a time: which per-chunk math its kind takes, over the chunk's teacher tensors.

* Dense: ``(t,)``, the teacher's ``[c, V_loc]`` logits of this rank's vocab shard -- the math of
  :mod:`vparallel_ce.divergence`;
* Sparse: ``(ids, logprobs)``, ``[c, k]`` each, the teacher's top-k record of the chunk's tokens --
  the math of :mod:`vparallel_ce.topk` (one object per tail mode).

``distillation_loss`` slices its teacher tensors per chunk; ``linear_distillation_loss`` makes a
dense teacher's logits chunk by chunk from its hidden rows and lm_head, or takes a top-k record's
rows. Both then call the same two methods, so the ops hold no per-kind branches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .divergence import DistillSpec, grad_student, statistics
from .topk import TailMode, topk_grad_student, topk_statistics

__all__ = ["DenseMath", "DENSE", "TopKMath"]


class DenseMath:
    """The teacher's logits, ``(t,)``: :mod:`vparallel_ce.divergence`."""

    @staticmethod
    def statistics(s: torch.Tensor, teacher, local_t, owned, spec: DistillSpec, layout):
        """The chunk's per-token statistics (the op's collectives run here)."""
        return statistics(s, teacher[0], local_t, owned, spec, layout)

    @staticmethod
    def grad(s: torch.Tensor, teacher, local_t, owned, st, weight, spec: DistillSpec, layout,
             out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """The student's ``[c, V_loc]`` logits' gradient for per-token ``weight``; local."""
        return grad_student(s, teacher[0], local_t, owned, st, weight, spec, out_dtype)


DENSE = DenseMath()


@dataclass(frozen=True)
class TopKMath:
    """The teacher's top-k ids and log-probs, ``(ids, logprobs)``: :mod:`vparallel_ce.topk`."""

    tail: TailMode

    def statistics(self, s: torch.Tensor, teacher, local_t, owned, spec: DistillSpec, layout):
        return topk_statistics(s, *teacher, local_t, owned, spec, layout, self.tail)

    def grad(self, s: torch.Tensor, teacher, local_t, owned, st, weight, spec: DistillSpec, layout,
             out_dtype: torch.dtype | None = None) -> torch.Tensor:
        return topk_grad_student(s, teacher[0], local_t, owned, st, weight, spec, layout, self.tail, out_dtype)
