"""A distillation's teacher as the two distillation ops' autograd Functions see it, one token chunk
at a time: which per-chunk math its kind takes, over the chunk's teacher tensors.

* Dense: ``(t,)``, the teacher's ``[c, V_loc]`` logits of this rank's vocab shard -- the math of
  :mod:`vparallel_ce.divergence`;
* Sparse: ``(ids, logprobs)``, ``[c, k]`` each, the teacher's top-k record of the chunk's tokens --
  the math of :mod:`vparallel_ce.topk` (one object per tail mode).

``distillation_loss`` slices its teacher tensors per chunk; ``linear_distillation_loss`` makes a
dense teacher's logits chunk by chunk from its hidden rows and lm_head, or takes a top-k record's
rows. Both then call the same two methods, so the ops hold no per-kind branches.

Under ``torch.compile`` (:mod:`vparallel_ce.compiled`) a teacher enters the graph as tensors: a
top-k record as its ids and log-probs, its tail mode (and recorded temperature) in the op's name
(:func:`graph_inputs`, :func:`teacher_of`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .divergence import DistillSpec, statistics
from .topk import TAIL_MODES, TailMode, TopKTeacher, topk_grad_student, topk_statistics

__all__ = ["DenseMath", "DENSE", "TopKMath", "in_graph", "graph_inputs", "teacher_of"]


class DenseMath:
    """The teacher's logits, ``(t,)``: :mod:`vparallel_ce.divergence`, its local passes ``ops.distill``'s."""

    @staticmethod
    def statistics(s: torch.Tensor, teacher, local_t, owned, spec: DistillSpec, layout, ops):
        """The chunk's per-token statistics (the op's collectives run here); ``ops``: the call's
        :class:`~vparallel_ce.kernels.KernelBackend`."""
        return statistics(s, teacher[0], local_t, owned, spec, layout, ops.distill)

    @staticmethod
    def grad(s: torch.Tensor, teacher, local_t, owned, st, weight, spec: DistillSpec, layout, ops,
             out_dtype: torch.dtype | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """The student's ``[c, V_loc]`` logits' gradient for per-token ``weight``, in ``out_dtype``
        or written into ``out``; local."""
        return ops.distill.grad(s, teacher[0], local_t, owned, st, weight, spec, out_dtype, out)


DENSE = DenseMath()


@dataclass(frozen=True)
class TopKMath:
    """The teacher's top-k ids and log-probs, ``(ids, logprobs)``: :mod:`vparallel_ce.topk` (the
    torch math whatever ``ops``: its passes touch ``k + 1`` entries a token, not the vocab)."""

    tail: TailMode

    def statistics(self, s: torch.Tensor, teacher, local_t, owned, spec: DistillSpec, layout, ops):
        return topk_statistics(s, *teacher, local_t, owned, spec, layout, self.tail)

    def grad(self, s: torch.Tensor, teacher, local_t, owned, st, weight, spec: DistillSpec, layout, ops,
             out_dtype: torch.dtype | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        return topk_grad_student(s, teacher[0], local_t, owned, st, weight, spec, layout, self.tail, out_dtype, out)


def in_graph(teacher) -> bool:
    """Whether a compiled op can take ``teacher`` as graph inputs: a tensor (logits or hidden
    states), or a top-k record of tensors with a known tail mode. Anything else runs the op eagerly,
    which raises what eager raises."""
    if isinstance(teacher, TopKTeacher):
        return (isinstance(teacher.ids, torch.Tensor) and isinstance(teacher.logprobs, torch.Tensor)
                and teacher.tail in TAIL_MODES
                and (teacher.temperature is None or type(teacher.temperature) in (int, float)))
    return isinstance(teacher, torch.Tensor)


def graph_inputs(op: str, leading: tuple, teacher, dense: tuple = ()) -> tuple[str, tuple]:
    """``(name, tensors)`` of a compiled distillation op: the student's ``leading`` inputs, then
    the teacher's tensors, detached (a constant gets no gradient): a record's ids and log-probs
    (the op ``"<op>:<tail>"``, and ``"@<temperature>"`` where the record has one), or ``teacher``
    and ``dense``, the rest of a dense teacher."""
    if isinstance(teacher, TopKTeacher):
        tail = teacher.tail.value if isinstance(teacher.tail, TailMode) else teacher.tail
        recorded = "" if teacher.temperature is None else f"@{float(teacher.temperature)!r}"
        return f"{op}:{tail}{recorded}", (*leading, teacher.ids, teacher.logprobs.detach())
    return op, (*leading, *(None if t is None else t.detach() for t in (teacher, *dense)))


def teacher_of(op: str, tensors) -> torch.Tensor | TopKTeacher:
    """The inverse of :func:`graph_inputs` for the teacher: its first tensor, or the record."""
    if ":" in op:
        op, _, recorded = op.partition("@")
        return TopKTeacher(tensors[0], tensors[1], tail=op.rsplit(":", 1)[1],
                           temperature=float(recorded) if recorded else None)
    return tensors[0]
