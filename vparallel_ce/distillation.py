"""``distillation_loss``: knowledge distillation between a student's and a teacher's logits, both
sharded along the vocabulary over the same group.

Forward per token chunk: the chunk's maxima of both softmaxes, one all-reduce MAX of them, the
sum-exps and the divergence's partial sums relative to those maxima, one all-reduce SUM of them (a
second one of two floats per token for JSD) -- the math and exactly what crosses ranks are in
:mod:`vparallel_ce.divergence`. The backward recomputes each chunk's two softmaxes from the saved
logits and the saved per-token statistics and needs no collective. The teacher is a constant: no
gradient flows into it. Extra memory: one chunk's fp32 working set (a few ``[chunk, V_local]``
tensors) in forward and backward, plus the student gradient's buffer.

A sparse teacher (:class:`vparallel_ce.topk.TopKTeacher`: top-k ids and log-probs per token) runs
the same Function over the math of :mod:`vparallel_ce.topk` instead: one MAX and one SUM
all-reduce per chunk, the SUM carrying the student's logits at the ``k`` ids.
"""

from __future__ import annotations

import torch

from . import compiled
from .autocast import autocast_off
from .call import Call, settles_check
from .distillation_call import TopKRows, distillation_call
from .divergence import DistillSpec, token_loss
from .options import Options
from .policy import ChunkPolicy
from .second_order import first_order_only
from .stats import local_targets, token_slices, token_weights
from .teacher import DENSE, TopKMath, graph_inputs, in_graph, teacher_of
from .topk import TAIL_MODES

__all__ = ["distillation_loss"]


def distillation_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    target: torch.Tensor | None = None,
    *,
    group=None,
    kind: str = "forward_kl",
    beta: float = 0.5,
    temperature: float = 1.0,
    ignore_index: int = -100,
    reduction: str = "mean",
    hard_weight: float = 0.0,
    num_valid_tokens: int | torch.Tensor | None = None,
    vocab_size: int | None = None,
    chunks: int | str = "auto",
    policy: ChunkPolicy | None = None,
    check: bool = True,
) -> torch.Tensor:
    r"""Distillation loss of a student against a teacher whose vocab dim is sharded over ``group``.

    Per token, with ``p = softmax(teacher / T)`` and ``q = softmax(student / T)`` over the GLOBAL
    vocab: ``T**2 * D + hard_weight * CE(student, target)``, where ``D`` is ``KL(p||q)``
    (``"forward_kl"``), ``KL(q||p)`` (``"reverse_kl"``) or ``beta KL(p||m) + (1 - beta) KL(q||m)``
    with ``m = beta p + (1 - beta) q`` (``"jsd"``), and ``CE`` the plain cross-entropy of the student
    logits at temperature 1.

    Args:
        student_logits: ``[..., V_local]`` float tensor, this rank's ``torch.chunk(full, world, -1)``
            slice of the student's logits, or a DTensor ``Shard(-1)`` (its mesh gives the group).
        teacher_logits: the teacher's logits, the same shard layout and shape (a plain tensor or a
            DTensor), in any float dtype (read in the statistics' dtype; the ranks must agree on
            it); a constant: it gets no gradient. Or a sparse teacher,
            :class:`vparallel_ce.TopKTeacher` ``(ids, logprobs, tail=...)``: ``[..., k]`` GLOBAL
            ids and the teacher's log-probabilities there at temperature ``T`` (``p`` as given,
            not rescaled), the same on every rank; the divergence is then over the ``k`` ids and a
            tail class (``TailMode.BUCKET``) or over the ``k`` ids renormalised
            (``TailMode.RENORMALIZE``), the student's ``q`` still over the GLOBAL vocab
            (:mod:`vparallel_ce.topk`). With ``check``, ids out of ``[0, V)`` or repeated in a row,
            log-probs above 0 or (``BUCKET``) probabilities summing above 1 raise on every rank.
        target: ``[...]`` integer ids in the GLOBAL vocab, the same on every rank, or None (every
            token counts). Tokens whose target is ``ignore_index`` count 0 and are left out of
            ``mean``. Needed for ``hard_weight > 0``.
        group: ProcessGroup or 1-D DeviceMesh the vocab is sharded over; None = unsharded.
        kind: ``"forward_kl"``, ``"reverse_kl"`` or ``"jsd"`` (or a
            :class:`vparallel_ce.divergence.Divergence`).
        beta: the JSD's mixture weight in ``[0, 1]`` (other kinds ignore it, but the ranks must
            still agree on it).
        temperature: ``T > 0``, softening both softmaxes; the loss is scaled by ``T**2``.
        ignore_index, reduction, num_valid_tokens, vocab_size, chunks, policy, check: as in
            :func:`vparallel_ce.cross_entropy`.
        hard_weight: the weight of the student's cross-entropy against ``target`` (``>= 0``).

    Returns:
        fp32 loss (fp64 for fp64 student logits), a plain tensor: a scalar for ``mean``/``sum``,
        the token shape for ``none``. ``student_logits.grad`` is this shard's slice of the gradient
        of that one loss, in the student logits' dtype.
    """
    options = Options(reduction=reduction, ignore_index=ignore_index, num_valid_tokens=num_valid_tokens,
                      temperature=temperature, divergence=kind, beta=beta, hard_weight=hard_weight, chunks=chunks,
                      policy=policy, vocab_size=vocab_size, check=check)
    if torch.compiler.is_compiling() and in_graph(teacher_logits):  # one custom op in the graph
        out, shape = compiled.apply(*graph_inputs("distillation_loss", (student_logits, target), teacher_logits),
                                    group, options)
    else:
        out, shape = _eager(student_logits, teacher_logits, target, group, options)
    return out.reshape(shape) if reduction == "none" else out


# under torch.compile reached only for an input the graph does not take (an unknown tail mode):
# then eager, between two graphs
@compiled.run_eagerly
def _eager(student_logits, teacher_logits, target, group, options: Options):
    args, shape = _start(student_logits, teacher_logits, target, group=group, options=options)
    return _Distillation.apply(*args), shape


def _start(student, teacher, target, *, group, options: Options) -> tuple[tuple, torch.Size]:
    """The front door, then :class:`_Distillation`'s arguments and the per-token shape."""
    call, inp, rows = distillation_call(student, teacher, target, group=group, options=options)
    spec = DistillSpec.of(options)
    if isinstance(rows, TopKRows):
        math, tensors = TopKMath(rows.tail), (rows.ids, rows.logprobs.detach())
    else:
        math, tensors = DENSE, (rows.detach(),)
    return (inp.x, inp.target, target is not None, spec, call, math, *tensors), inp.shape


def _stats_per_chunk(s, teacher, local_t, owned, spec: DistillSpec, call: Call, math):
    ops = call.ops(s)
    parts = [math.statistics(s[sl], [t[sl] for t in teacher], local_t[sl], owned[sl], spec, call.layout, ops)
             for sl in token_slices(s.shape[0], call.plan.chunks)]
    return type(parts[0])(*(None if f[0] is None else torch.cat(f) for f in zip(*parts)))


def _rows_of(st, sl: slice):
    return type(st)(*(None if f is None else f[sl] for f in st))


class _Distillation(torch.autograd.Function):
    """Forward: statistics per chunk (collectives); backward: the student's closed-form gradient
    per chunk (local). ``math``: the teacher's kind (its per-chunk statistics and gradient), over
    the ``teacher`` tensors. Autocast is off inside: the math is explicit fp32 (fp64 for fp64)."""

    @staticmethod
    def forward(ctx, s, target, target_given: bool, spec: DistillSpec, call: Call, math, *teacher):
        with autocast_off(s.device.type):
            lay = call.layout
            local_t, owned, valid = local_targets(target, lay.offset, lay.local_size, call.spec.ignore_index,
                                                  all_owned=call.all_owned)
            if not target_given:  # the target is a stand-in: every token counts
                valid = torch.ones_like(valid)
            st = _stats_per_chunk(s, teacher, local_t, owned, spec, call, math)
            n_valid = call.valid_count(target, valid, of_target=target_given)
            weights = token_weights(valid, n_valid, call.reduction, st.s_log_s.dtype)
            ctx.save_for_backward(s, *teacher)
            ctx.call, ctx.spec, ctx.math, ctx.stats = call, spec, math, st
            ctx.targets, ctx.weights = (local_t, owned), weights
            return call.loss_output(ctx, call.ops(s), token_loss(st, valid, spec), n_valid)

    @staticmethod
    @first_order_only("distillation_loss")
    @settles_check
    def backward(ctx, grad_out):
        s, *teacher = ctx.saved_tensors
        with autocast_off(s.device.type):
            g = grad_out.reshape(-1) if ctx.call.reduction == "none" else grad_out
            r = ctx.weights
            # an ignored token's weight (exactly 0) stays 0 whatever the upstream gradient, nan included
            w = torch.where(r == 0, r, r * g.to(r.dtype))
            local_t, owned = ctx.targets
            ds = torch.empty_like(s)
            ops = ctx.call.ops(s)
            for sl in token_slices(s.shape[0], ctx.call.plan.chunks):
                ds[sl] = ctx.math.grad(s[sl], [t[sl] for t in teacher], local_t[sl], owned[sl],
                                       _rows_of(ctx.stats, sl), w[sl], ctx.spec, ctx.call.layout, ops)
        return (ds, None, None, None, None, None) + (None,) * len(teacher)


# the compiled op's inputs: (student, target, teacher logits) or (student, target, ids, logprobs);
# the Function's arguments: (s, target, target_given, spec, call, math, *teacher tensors)
for _name, _tensors in (("distillation_loss", 1), *((f"distillation_loss:{t}", 2) for t in TAIL_MODES)):
    compiled.register(_name, _Distillation,
                      lambda ts, *, op, group, options: _start(ts[0], teacher_of(op, ts[2:]), ts[1], group=group,
                                                               options=options),
                      grad_of=(0,) + (None,) * (5 + _tensors), target=1, optional={1})
