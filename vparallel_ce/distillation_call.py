"""The distillation ops' front doors: :func:`distillation_call` and :func:`linear_distillation_call`
check the teacher against the student's inputs and run :func:`vparallel_ce.call.logits_call` /
:func:`vparallel_ce.call.linear_call` on the student's side, the ranks agreeing on the teacher's
facts there; besides the :class:`~vparallel_ce.call.Call` they return the teacher's local rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import kernels
from .call import Call, LinearInputs, LogitsInputs, linear_call, logits_call
from .call import _rows  # the front door's reshape, the same for the teacher's rows
from .divergence import Divergence
from .dtensor import _replicated, _unwrap_linear, local  # step 1 of the front door, for the teacher too
from .options import Options
from .policy import DistillShape
from .topk import TailMode, TopKTeacher
from .validate import Problem, check_linear_teacher, check_teacher, check_topk_teacher, check_topk_values
from .verdicts import tensor_metadata

__all__ = ["TeacherInputs", "TopKRows", "distillation_call", "linear_distillation_call"]


@dataclass(frozen=True)
class TeacherInputs:
    """The teacher's side of ``linear_distillation_loss``, local and flat (no gradient flows into it)."""

    h: torch.Tensor  # [N, H_t]
    w: torch.Tensor  # [V_local, H_t]
    b: torch.Tensor | None  # [V_local]


@dataclass(frozen=True)
class TopKRows:
    """A sparse teacher's rows: ``[N, k]`` int64 GLOBAL ids and float log-probs, and its tail mode."""

    ids: torch.Tensor
    logprobs: torch.Tensor
    tail: TailMode


def distillation_call(student, teacher, target, *, group, options: Options
                      ) -> tuple[Call, LogitsInputs, torch.Tensor | TopKRows]:
    """The front door of :func:`vparallel_ce.distillation_loss`: :func:`logits_call` on the
    student's logits, with the teacher checked against them -- logits of the same local shape (the
    same shard of the same vocab), or a :class:`~vparallel_ce.topk.TopKTeacher` whose ids and
    log-probs have the student's token dims -- and the teacher's rows besides (``[N, V_local]``
    logits, or :class:`TopKRows`). Without a target the call checks and exchanges a stand-in of
    zeros (every token counts; ``target_given`` is one of the agreed facts). The ranks agree on the
    teacher's dtype, and for a sparse teacher on its ``k``, tail mode, ids and log-probs; with
    ``check``, a sparse teacher's values are checked once the ranks agree on them
    (:func:`~vparallel_ce.validate.check_topk_values`: the same error on every rank)."""
    given = target is not None
    target = target if given else _stand_in_target(student)
    sparse = isinstance(teacher, TopKTeacher)
    if sparse:
        teacher = TopKTeacher(_replicated(teacher.ids, "TopKTeacher.ids"),
                              _replicated(teacher.logprobs, "TopKTeacher.logprobs"), tail=teacher.tail,
                              temperature=teacher.temperature)
    else:
        teacher = local(teacher)

    def more_checks(logits):
        if sparse:
            return check_topk_teacher(logits, teacher, target_given=given, hard_weight=options.hard_weight,
                                      temperature=options.temperature)
        return check_teacher(logits, teacher, target_given=given, hard_weight=options.hard_weight)

    memo = _topk_memo(teacher, teacher.ids, teacher.logprobs) if sparse else tensor_metadata(teacher)
    call, inp = logits_call(student, target, op="distillation_loss", group=group, options=options,
                            more_checks=more_checks, target_given=given, teacher=teacher, memo=memo,
                            distillation=_distill_shape(options, (local(student),) + (() if sparse else (teacher,)),
                                                        dense=not sparse))
    if not sparse:
        return call, inp, _rows(teacher, inp.target.numel(), call.layout.local_size)
    return call, inp, _topk_rows(teacher, call, inp.target, options, given)


def _topk_rows(teacher: TopKTeacher, call: Call, target: torch.Tensor, options: Options, given: bool,
               inputs: LinearInputs | None = None) -> TopKRows:
    """A (checked, agreed) sparse teacher's ``[N, k]`` rows, its values checked with ``check``
    (:func:`~vparallel_ce.validate.check_topk_values`, on the tokens that count: all of them
    without a target) -- with sequence parallelism on each rank's own rows, the ranks joining
    their verdicts. A compiled op's fake run has no values: its real run checks them.
    ``inputs``: the linear op's, whose rows (compacted: those whose target counts) the teacher's
    rows are taken as; ``target`` is theirs."""
    n, k = (target.numel() if inputs is None else inputs.shape.numel()), teacher.ids.shape[-1]
    rows = TopKRows(_rows(teacher.ids, n, k).to(torch.int64), _rows(teacher.logprobs, n, k), TailMode(teacher.tail))
    if inputs is not None and inputs.compaction is not None:
        rows = TopKRows(inputs.take(rows.ids), inputs.take(rows.logprobs), rows.tail)
    if options.check and not kernels.is_fake(rows.ids):
        valid = target != options.ignore_index if given else None
        check_topk_values(rows.ids, rows.logprobs, valid, call.layout.vocab_size, rows.tail,
                          group=call.layout.group if call.sequence_parallel else None)
    return rows


def linear_distillation_call(student_hidden, student_weight, teacher_hidden, teacher_weight, target, student_bias,
                             teacher_bias, *, group, options: Options, compact: bool = False
                             ) -> tuple[Call, LinearInputs, TeacherInputs | TopKRows]:
    """The front door of :func:`vparallel_ce.linear_distillation_loss`: :func:`linear_call` on the
    student's side, with the teacher's checked against it, and the teacher's local rows besides.
    A dense teacher (:class:`TeacherInputs`: ``[N, H_t]`` rows, lm_head shard, bias) must see the
    same tokens and vocab shard on the same device, in the student's dtype outside autocast; a
    replicated teacher hidden is checked to be replicated too; its DTensors unwrap as the
    student's (its group is the student's). A sparse teacher (:class:`TopKRows`), given as
    ``teacher_hidden`` with no teacher weight or bias, holds ``[..., k]`` ids and log-probs over
    the student's token dims -- with sequence parallelism this rank's tokens, as the hidden
    states -- and its values are checked as :func:`distillation_call` checks them, the ranks
    joining their verdicts when each holds its own tokens. Without a target the call exchanges a
    stand-in of zeros, as :func:`distillation_call`. ``compact``: as in :func:`linear_call` (the
    teacher's rows are taken as the student's)."""
    given = target is not None
    target = target if given else _stand_in_target(student_hidden)
    sp = bool(options.sequence_parallel)
    if isinstance(teacher_hidden, TopKTeacher):
        # with sequence parallelism the record holds this rank's tokens, as the hidden states
        unwrap = (lambda x, _: local(x)) if sp else _replicated
        teacher = TopKTeacher(unwrap(teacher_hidden.ids, "TopKTeacher.ids"),
                              unwrap(teacher_hidden.logprobs, "TopKTeacher.logprobs"), tail=teacher_hidden.tail,
                              temperature=teacher_hidden.temperature)

        def more_checks(hidden, weight, amp):
            if teacher_weight is not None or teacher_bias is not None:
                return Problem(TypeError, "a TopKTeacher in place of teacher_hidden is the whole teacher: pass no "
                                          "teacher_weight or teacher_bias with it")
            return check_topk_teacher(hidden, teacher, target_given=given, hard_weight=options.hard_weight,
                                      student_name="student_hidden", temperature=options.temperature)

        memo = _topk_memo(teacher, teacher.ids, teacher.logprobs, teacher_weight, teacher_bias)
        call, inp = linear_call(student_hidden, student_weight, target, student_bias, op="linear_distillation_loss",
                                group=group, options=options, more_checks=more_checks, target_given=given,
                                prefix="student_", teacher=teacher, memo=memo, compact=compact,
                                distillation=lambda weight, grad_bytes: _distill_shape(
                                    options, (weight,), (weight.shape[-1], 0), dense=False, grad_bytes=grad_bytes))
        return call, inp, _topk_rows(teacher, call, inp.target, options, given, inp)
    memo = tensor_metadata(teacher_hidden, teacher_weight, teacher_bias)
    if memo is None:  # (plain tensors unwrap to themselves)
        t_hidden, t_weight, _, t_bias, _, _ = _unwrap_linear(teacher_hidden, teacher_weight, None, teacher_bias, None,
                                                             sp)
    else:
        t_hidden, t_weight, t_bias = teacher_hidden, teacher_weight, teacher_bias

    def more_checks(hidden, weight, amp):
        return check_linear_teacher(hidden, weight, t_hidden, t_weight, t_bias, autocast_dtype=amp, target_given=given,
                                    hard_weight=options.hard_weight)

    call, inp = linear_call(student_hidden, student_weight, target, student_bias, op="linear_distillation_loss",
                            group=group, options=options, more_checks=more_checks, target_given=given,
                            also_replicated=(t_hidden,), prefix="student_",
                            memo=memo, compact=compact,
                            distillation=lambda weight, grad_bytes: _distill_shape(
                                options, (weight,), (weight.shape[-1], t_weight.shape[-1]), grad_bytes=grad_bytes))
    t_rows = inp.take(_rows(t_hidden, inp.shape.numel(), t_weight.shape[-1]))
    return call, inp, TeacherInputs(t_rows, t_weight, t_bias)


def _topk_memo(teacher: TopKTeacher, *tensors) -> tuple | None:
    """The front door's memo of a sparse teacher: its ``tensors``' metadata, its tail mode and
    recorded temperature."""
    meta = tensor_metadata(*tensors)
    return None if meta is None else (meta, type(teacher.tail), teacher.tail, teacher.temperature)


def _stand_in_target(student):
    """The target a distillation without one exchanges and checks: zeros of the student's token
    dims (every token counts; ``target_given`` is one of the agreed facts). None where the input
    is no tensor (its check reports that)."""
    base = local(student)
    if not isinstance(base, torch.Tensor) or base.dim() < 1:
        return None
    return torch.zeros(base.shape[:-1], dtype=torch.int64, device=base.device)


def _distill_shape(o: Options, logits: tuple, hidden_sizes: tuple[int, int] | None = None, *,
                   dense: bool = True, grad_bytes: int = 0) -> DistillShape | None:
    """The distillation memory model's shape of a call whose local passes read tensors like
    ``logits`` (the student's and a dense teacher's logits, or the lm_head weight whose dtype both
    linear GEMMs write): they run in Triton where :func:`vparallel_ce.kernels.triton_applies` to
    every one of them. ``grad_bytes``: :attr:`DistillShape.grad_bytes` (the linear op's). None for
    a bad divergence: its check reports it before any plan is made."""
    kind = o.divergence.value if isinstance(o.divergence, Divergence) else o.divergence
    if kind not in Divergence._value2member_map_:
        return None
    row_kernels = dense and all(isinstance(x, torch.Tensor) and kernels.triton_applies(x.device, x.dtype)
                                for x in logits)
    return DistillShape(kind, hidden_sizes, row_kernels, grad_bytes)
