r"""``linear_distillation_loss``: distillation between a student and a teacher given by their hidden
states and lm_head shards, never materialising either model's ``[N, V_local]`` logits beyond one
token chunk.

With ``s = h_s W_s^T + b_s`` and ``t = h_t W_t^T + b_t`` this rank's vocab shard of the two models'
logits (``W_s [V_loc, H_s]``, ``W_t [V_loc, H_t]``: the same rows of the vocab, hidden sizes free),
the loss is :func:`vparallel_ce.distillation_loss` of ``(s, t)``. Per token chunk ``c``:

1. ``t_c = h_t,c W_t^T`` (the teacher: a constant) and ``s_c = h_s,c W_s^T`` -- two GEMMs;
2. :func:`vparallel_ce.divergence.statistics` of the pair: one all-reduce MAX and one SUM of a few
   floats per token (two SUMs for the JSD);
3. the student logits' gradient ``ds_c`` by :func:`vparallel_ce.divergence.grad_student`, then
   ``dh_c = ds_c W_s`` and ``dW_s (+)= ds_c^T h_s,c``, ``db_s += sum ds_c`` -- two more GEMMs.

For ``mean``/``sum`` step 3 runs in forward for an upstream gradient of 1 (``r_i``: 1 or
``1 / n_valid`` on valid tokens, 0 on ignored ones) and the backward scales the finished gradients by
the upstream scalar: 4 GEMMs in all, dW summed over the chunks in an fp32 accumulator. For
``none`` (or with several microbatches in flight, :mod:`vparallel_ce.policy`) the forward keeps the
per-token statistics and the backward recomputes both logits chunk by chunk: 6 GEMMs.

``student_hidden.grad`` is the FULL gradient (the shards' partial ``dh`` summed over the group), or
with ``sequence_parallel`` this rank's token rows of it (chunk rows all-gathered, ``dh``
reduce-scattered) -- the row and gradient machinery is :mod:`vparallel_ce.linear`'s (``Rows``,
``Grads``). Under ``torch.autocast`` all four GEMMs run in the autocast dtype; the statistics are
fp32; each gradient comes back in its input's dtype. The teacher gets no gradient.

A sparse teacher (:class:`vparallel_ce.TopKTeacher`, an offline cache's top-k ids and log-probs) in
place of the teacher's hidden states and lm_head replaces step 1's teacher GEMM by the chunk's rows
of the record (all-gathered with the hidden rows under sequence parallelism) and step 2 by
:func:`vparallel_ce.topk.topk_statistics`; the per-chunk math of each kind of teacher is
:mod:`vparallel_ce.teacher`'s, so the Function below holds no branch on it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import compiled
from .autocast import autocast_off
from .call import Call, LinearInputs, settles_check
from .distillation_call import TopKRows, linear_distillation_call
from .divergence import DistillSpec, token_loss
from .chunk_walk import Grads, Rows, Schedule, cat_parts, chunk_losses, scale_unit_grads, scale_valid_unit_grads
from .gemm import logits, matmul_inputs
from .options import Options
from .policy import ChunkPolicy, GradMode, WeightGrad
from .second_order import first_order_only
from .stats import compute_dtype, local_targets, token_weights
from .teacher import DENSE, TopKMath, graph_inputs, in_graph, teacher_of
from .topk import TAIL_MODES, TopKTeacher

__all__ = ["linear_distillation_loss"]


def linear_distillation_loss(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_hidden: torch.Tensor | TopKTeacher,
    teacher_weight: torch.Tensor | None = None,
    target: torch.Tensor | None = None,
    *,
    student_bias: torch.Tensor | None = None,
    teacher_bias: torch.Tensor | None = None,
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
    sequence_parallel: bool = False,
    check: bool = True,
) -> torch.Tensor:
    r"""``distillation_loss(student_hidden @ student_weight.T + student_bias, teacher_hidden @
    teacher_weight.T + teacher_bias, target, ...)`` with both lm_heads sharded along the vocab, the
    logits made one token chunk at a time.

    Args:
        student_hidden: ``[..., H_s]``, replicated over the group; with ``sequence_parallel=True``
            this rank's token shard (``teacher_hidden`` and ``target`` split the same way). A DTensor
            (Replicate, or sequence-sharded) is accepted.
        student_weight: ``[V_local, H_s]``, this rank's ``torch.chunk(W_s, world, 0)[rank]`` shard of
            the student's lm_head, or a DTensor ``Shard(0)`` (its mesh gives the group).
        teacher_hidden: ``[..., H_t]``, the teacher's hidden states of the same tokens (``H_t`` may
            differ from ``H_s``); a constant. Or a sparse teacher, :class:`vparallel_ce.TopKTeacher`
            ``(ids, logprobs, tail=...)``, ``[..., k]`` each over the student hidden's token dims
            (replicated, or with ``sequence_parallel`` this rank's tokens), in place of the
            teacher's hidden states AND lm_head: an offline top-k cache against a fused student
            (the math, the tail modes and the checks as in :func:`vparallel_ce.distillation_loss`;
            no teacher GEMM; per chunk one MAX and one SUM all-reduce, the SUM ``k + 1`` to
            ``k + 4`` floats per token).
        teacher_weight: ``[V_local, H_t]``, the teacher's lm_head shard of the SAME vocab rows; a
            constant. None (the default) with a sparse teacher.
        target: ``[...]`` global ids, or None (every token counts); needed for ``hard_weight > 0``.
        student_bias, teacher_bias: ``[V_local]`` shards, optional (no ``teacher_bias`` with a
            sparse teacher).
        group, kind, beta, temperature, ignore_index, reduction, hard_weight, num_valid_tokens,
        vocab_size, check: as in :func:`vparallel_ce.distillation_loss`.
        chunks: token chunks (an int), or ``"auto"``: sized by the distillation memory model
            (:func:`vparallel_ce.policy.distillation_chunk_bytes`: both models' logits chunks and
            the divergence's temporaries against the policy's budget; a sparse teacher counts as
            ``H_t = 0``, and is over-counted by its logits chunk).
        policy: a :class:`vparallel_ce.policy.ChunkPolicy`; ``vparallel_ce.policy.explain(...,
            distillation=DistillShape(kind, (H_s, H_t)))`` prints the plan a call runs.
        sequence_parallel: as in :func:`vparallel_ce.linear_cross_entropy`: ``sum``/``mean`` over
            the whole group's tokens, ``none`` this rank's tokens' losses.

    Returns:
        fp32 loss (fp64 for fp64 inputs): a scalar for ``mean``/``sum``, the token shape for
        ``none``. Gradients, each in its input's dtype: ``student_weight.grad`` /
        ``student_bias.grad`` this shard's; ``student_hidden.grad`` the full gradient (summed over
        the group), or this rank's rows of it with ``sequence_parallel``. The teacher's tensors get
        no gradient, even where they require one.
    """
    options = Options(reduction=reduction, ignore_index=ignore_index, num_valid_tokens=num_valid_tokens,
                      temperature=temperature, divergence=kind, beta=beta, hard_weight=hard_weight, chunks=chunks,
                      policy=policy, vocab_size=vocab_size, sequence_parallel=sequence_parallel, check=check)
    student = (student_hidden, student_weight, target, student_bias)
    if torch.compiler.is_compiling() and in_graph(teacher_hidden):  # one custom op in the graph
        name, tensors = graph_inputs("linear_distillation_loss", student, teacher_hidden, (teacher_weight, teacher_bias))
        out, shape = compiled.apply(name, tensors, group, options)
    else:
        out, shape = _eager(student, (teacher_hidden, teacher_weight, teacher_bias), group, options)
    return out.reshape(shape) if reduction == "none" else out


# under torch.compile reached only for an input the graph does not take (an unknown tail mode):
# then eager, between two graphs
@compiled.run_eagerly
def _eager(student: tuple, teacher: tuple, group, options: Options):
    args, shape, inp = _start(student, teacher, group=group, options=options, compact=True)
    h, w, b, target, source, target_given, _, call = args
    out = _LinearDistillation.apply(*args, _Walk(call, h, w, b, target, source, target_given))
    # (compacted: the kept rows' losses back in the caller's order)
    return (inp.place(out) if options.reduction == "none" else out), shape


def _start(student: tuple, teacher: tuple, *, group, options: Options, compact: bool = False
           ) -> tuple[tuple, torch.Size, LinearInputs]:
    """The front door on ``(hidden, weight, target, bias)`` of the student and ``(hidden, weight,
    bias)`` of the teacher (a top-k record in place of its hidden states), then
    :class:`_LinearDistillation`'s arguments, the per-token shape and the student's inputs (their
    ``place`` puts per-token losses back in the caller's order). ``compact``: as in
    :func:`vparallel_ce.call.linear_call` (the eager op's)."""
    (h, w, target, b), (th, tw, tb) = student, teacher
    call, inp, rows = linear_distillation_call(h, w, th, tw, target, b, tb, group=group, options=options,
                                               compact=compact)
    spec = DistillSpec.of(options)
    if isinstance(rows, TopKRows):
        source = _TopKSource(rows.ids, rows.logprobs.detach(), TopKMath(rows.tail))
    else:
        # a constant (each detach is a new tensor object: host time before the first GEMM)
        source = _LogitsSource(*(x.detach() if x is not None and x.requires_grad else x
                                 for x in (rows.h, rows.w, rows.b)))
    return (inp.h, inp.w, inp.b, inp.target, source, target is not None, spec, call), inp.shape, inp


@dataclass(frozen=True)
class _Chunk:
    """A token chunk's student rows, gathered over the group with sequence parallelism: its hidden
    rows (in the matmul dtype), the targets mapped to this shard, and which rows count (padding
    rows and ignored tokens do not)."""

    h: torch.Tensor  # [c, H_s]
    local_t: torch.Tensor  # [c]
    owned: torch.Tensor  # [c]
    valid: torch.Tensor  # [c] bool


class _Walk:
    """The token chunks of one call over its :class:`~vparallel_ce.chunk_walk.Rows`: the student's
    inputs in the matmul dtype, the teacher's source made ready, and chunk 0's two logits GEMMs
    launched as soon as the walk is made. The eager op makes it before autograd's Function
    machinery and the forward's own set-up run: from an idle GPU, that host time (tens of
    microseconds) is time the GPU would wait for its first GEMM (the distillation benchmark's
    from-idle times show it, ``docs/benchmarks.md``). :meth:`logits` hands chunk 0's
    logits over once, so a reference to the walk keeps no logits alive through the other chunks."""

    def __init__(self, call: Call, h, w, b, target: torch.Tensor, teacher, target_given: bool):
        self.call, self.target, self.given = call, target, target_given
        self.rows = Rows(call, call.plan.chunks)
        with autocast_off(h.device.type), torch.no_grad():
            self.hm, self.wm, self.bm = matmul_inputs(call, h, w, b)
            self.source = teacher.prepared(call)
            self._first = self._logits(0) if len(self.rows) else None
        # without a target every token of this rank counts (the stand-in target of zeros may well
        # equal ignore_index); with one, each chunk's mask comes from its targets
        self.all_local = None if target_given else torch.ones_like(target, dtype=torch.bool)

    def logits(self, c: int) -> tuple[torch.Tensor, torch.Tensor, tuple]:
        """Chunk ``c``'s student hidden rows (gathered over the group with sequence parallelism),
        its student logits and its teacher's chunk (:meth:`_LogitsSource.chunk`)."""
        if c == 0 and self._first is not None:
            first, self._first = self._first, None
            return first
        return self._logits(c)

    def _logits(self, c: int):
        h_c = self.rows.gather(c, self.hm)
        return h_c, logits(self.call, h_c, self.wm, self.bm), self.source.chunk(self.call, self.rows, c)

    def chunk(self, c: int, h_c: torch.Tensor) -> _Chunk:
        """Chunk ``c`` over its hidden rows ``h_c`` (:meth:`logits`). Called once the chunk's
        GEMMs are launched: its target maps are small kernels, which would otherwise hold them
        back on the host."""
        call, rows = self.call, self.rows
        t_c = rows.gather(c, self.target, fill=call.spec.ignore_index)
        lay = call.layout
        local_t, owned, valid = local_targets(t_c, lay.offset, lay.local_size, call.spec.ignore_index,
                                              all_owned=call.all_owned)
        if not self.given:  # gathered as integers (gloo gathers no bools); padding rows get 0
            valid = rows.gather(c, self.all_local.to(t_c.dtype), fill=0) != 0
        return _Chunk(h_c, local_t, owned, valid)


@dataclass(frozen=True)
class _LogitsSource:
    """A dense teacher: its ``[N, H_t]`` hidden rows and lm_head shard, whose logits each chunk
    makes under ``no_grad`` (a constant)."""

    h: torch.Tensor
    w: torch.Tensor
    b: torch.Tensor | None
    math = DENSE

    @property
    def tensors(self) -> tuple:
        return self.h, self.w, self.b

    def with_tensors(self, h, w, b) -> "_LogitsSource":
        """The same teacher over ``tensors`` (as saved for backward)."""
        return _LogitsSource(h, w, b)

    def prepared(self, call: Call) -> "_LogitsSource":
        """Cast to the matmul dtype (a no-op outside autocast)."""
        return _LogitsSource(*matmul_inputs(call, self.h, self.w, self.b))

    def chunk(self, call: Call, rows: Rows, c: int) -> tuple[torch.Tensor]:
        with torch.no_grad():
            return (logits(call, rows.gather(c, self.h), self.w, self.b),)


@dataclass(frozen=True)
class _TopKSource:
    """A sparse teacher: its ``[N, k]`` ids and log-probs, whose rows each chunk takes (gathered
    with sequence parallelism; a padding row's are never read)."""

    ids: torch.Tensor
    logprobs: torch.Tensor
    math: TopKMath

    @property
    def tensors(self) -> tuple:
        return self.ids, self.logprobs

    def with_tensors(self, ids, logprobs) -> "_TopKSource":
        return _TopKSource(ids, logprobs, self.math)

    def prepared(self, call: Call) -> "_TopKSource":
        return self

    def chunk(self, call: Call, rows: Rows, c: int) -> tuple[torch.Tensor, torch.Tensor]:
        return rows.gather(c, self.ids), rows.gather(c, self.logprobs)


class _LinearDistillation(torch.autograd.Function):
    """Forward: per chunk the student's logits and the teacher's chunk (its logits, or its top-k
    rows), the divergence's statistics (collectives) and, with the plan's gradients in forward,
    the student's gradients for an upstream gradient of 1; backward: scales those, or recomputes
    the chunks and the gradients chunk by chunk. ``teacher``: a :class:`_LogitsSource` or
    :class:`_TopKSource`, whose ``math`` is the chunk's. Autocast is off inside; the matmul dtype
    comes from the :class:`Call`."""

    @staticmethod
    def forward(ctx, h, w, b, target, teacher, target_given: bool, spec: DistillSpec, call: Call,
                walk: _Walk | None = None):
        if walk is None:  # the compiled op's forward makes its own
            walk = _Walk(call, h, w, b, target, teacher, target_given)
        need = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], b is not None and ctx.needs_input_grad[2])
        in_forward = any(need) and call.plan.grad_mode is GradMode.IN_FORWARD
        with autocast_off(h.device.type):
            hm, wm, source, rows = walk.hm, walk.wm, walk.source, walk.rows
            grads, per_token, stats, n_valid = None, [], [], None
            for c in range(len(rows)):
                h_c, s, t = walk.logits(c)
                if in_forward and grads is None:  # its buffers' host time, too, after the first GEMMs
                    grads = _grads(call, rows, h, w, b, hm, wm, need)
                ch = walk.chunk(c, h_c)
                if c == 0 and call.reduction == "mean":
                    # the mean's divisor, which gradients made in forward weigh by: made once the
                    # first GEMMs are queued (at world 1 it launches the target check)
                    n_valid = call.valid_count(target, walk.all_local, of_target=target_given)
                st = source.math.statistics(s, t, ch.local_t, ch.owned, spec, call.layout, call.ops(s))
                per_token.append(chunk_losses(rows, c, token_loss(st, ch.valid, spec), call.reduction))
                if in_forward:
                    unit = token_weights(ch.valid, n_valid, call.reduction, st.divergence.dtype)
                    _add_grads(grads, rows, c, ch, s, t, st, unit, spec, wm, source.math)
                else:
                    stats.append(st)
                del s, t
            ctx.call, ctx.spec, ctx.need, ctx.in_forward, ctx.target_given = call, spec, need, in_forward, target_given
            if in_forward:  # only the [N, H_s] / [V_loc, H_s] gradients (and the targets) are kept, no logits
                ctx.save_for_backward(*grads.finish(rows), target)
            elif any(need):
                ctx.save_for_backward(h, w, b, target, *teacher.tensors)
                ctx.teacher, ctx.stats, ctx.n_valid = teacher, stats, n_valid
            return call.loss_output(ctx, call.ops(wm), cat_parts(per_token), n_valid)

    @staticmethod
    @first_order_only("linear_distillation_loss")
    @settles_check
    def backward(ctx, grad_out):
        nothing = (None,) * 6
        if ctx.in_forward:  # made in forward for grad_out == 1: scale by the scalar
            call, (*grads, target) = ctx.call, ctx.saved_tensors
            if ctx.target_given:  # an ignored token holds no contribution
                return scale_valid_unit_grads(call, grads, grad_out, target) + nothing
            # every token counts: only an empty call holds no contribution
            counted = None if sum(call.counts) else torch.zeros((), device=grad_out.device)
            return scale_unit_grads(call.ops(grad_out), grads, grad_out, counted=counted) + nothing
        call, spec = ctx.call, ctx.spec
        h, w, b, target, *teacher = ctx.saved_tensors
        walk = _Walk(call, h, w, b, target, ctx.teacher.with_tensors(*teacher), ctx.target_given)
        with autocast_off(h.device.type):
            hm, wm, source, rows = walk.hm, walk.wm, walk.source, walk.rows
            grads = _grads(call, rows, h, w, b, hm, wm, ctx.need)
            g_local = grad_out.reshape(-1) if call.reduction == "none" else None
            for c in range(len(rows)):
                h_c, s, t = walk.logits(c)
                ch = walk.chunk(c, h_c)
                st = ctx.stats[c]
                r = token_weights(ch.valid, ctx.n_valid, call.reduction, st.divergence.dtype)
                g = rows.gather(c, g_local) if g_local is not None else grad_out
                # an ignored token's weight (exactly 0) stays 0 whatever the upstream gradient, nan included
                weight = torch.where(r == 0, r, r * g.to(r.dtype))
                _add_grads(grads, rows, c, ch, s, t, st, weight, spec, wm, source.math)
                del s, t
            return grads.finish(rows) + nothing


def _grads(call: Call, rows: Rows, h, w, b, hm, wm, need) -> Grads:
    """The student's gradient buffers: fp32 sums over chunks and ranks (one block: the whole shard),
    or with the plan's :attr:`~vparallel_ce.policy.WeightGrad.ONE_GEMM` every chunk's logits'
    gradient kept for one dW GEMM with ``hm``, the matmul-dtype hidden rows."""
    whole = Schedule(len(rows), (slice(0, call.layout.local_size),), keep_logits=False)
    one_gemm = call.plan.weight_grad is WeightGrad.ONE_GEMM
    return Grads(h, w, b, need, acc_dtype=compute_dtype(wm.dtype), rows=rows, schedule=whole,
                 kept_hidden=hm if one_gemm else None)


def _add_grads(grads: Grads, rows: Rows, c: int, ch: _Chunk, s, teacher: tuple, st, weight, spec: DistillSpec, wm,
               math) -> None:
    """Chunk ``c``'s ``d (sum_i weight_i loss_i)`` into the student's buffers: the logits' gradient
    made in fp32 and written in the matmul dtype the two GEMMs take it in, or in fp32 where ``db``
    sums it (unrounded)."""
    dh_rows = grads.rows_of(rows, c, ch.h)
    if s.shape[-1]:  # an empty vocab shard adds nothing (its dh rows stay 0 until the sum over the group)
        out_dtype = compute_dtype(s.dtype) if grads.db is not None else ch.h.dtype
        ds = math.grad(s, teacher, ch.local_t, ch.owned, st, weight, spec, rows.call.layout, rows.call.ops(s),
                       out_dtype=out_dtype, out=grads.kept_rows(rows, c))
        grads.add_block(slice(0, s.shape[-1]), ds, ch.h, wm, dh_rows)
    grads.end_chunk(rows, c, dh_rows)


def _compiled_start(tensors, *, op: str, group, options: Options):
    """:func:`_start` on the compiled op's inputs (:func:`vparallel_ce.teacher.graph_inputs`)."""
    teacher = teacher_of(op, tensors[4:])
    rest = (teacher, None, None) if isinstance(teacher, TopKTeacher) else (teacher, *tensors[5:])
    return _start(tuple(tensors[:4]), rest, group=group, options=options)[:2]


# the compiled op's inputs: the student's (hidden, weight, target, bias), then the teacher's (hidden,
# weight, bias) or (ids, logprobs); the Function's arguments: (h, w, b, target, source, target_given,
# spec, call)
for _name, _optional in (("linear_distillation_loss", {2, 3, 6}),
                         *((f"linear_distillation_loss:{t}", {2, 3}) for t in TAIL_MODES)):
    compiled.register(_name, _LinearDistillation, _compiled_start, grad_of=(0, 1, 3) + (None,) * 5, target=2,
                      optional=_optional)
