r"""``linear_cross_entropy``: lm_head matmul + vocab-parallel cross-entropy, never materialising the
logits of the whole local vocab for all tokens at once: it runs the chunk walk of
:mod:`vparallel_ce.chunk_walk` (its two schedules, token and vocab, and what each costs are described there).

Under ``torch.autocast`` the matmuls run in the autocast dtype (``Call.matmul_dtype``), as
``F.linear`` would there; statistics are fp32 and each input's gradient comes back in its own dtype
(fp32 for fp32 master weights). Works with: any TP degree (uneven and empty shards), sequence
parallelism, DTensor weight ``Shard(0)`` / hidden, ``torch.compile`` (one custom op in the graph on
one rank, a graph break at the op under TP: :mod:`vparallel_ce.compiled`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from . import compiled, policy as _policy
from .policy import GradMode
from .second_order import first_order_only
from .autocast import autocast_off
from .call import Call, linear_call, settles_check
from .options import Options
from .chunk_walk import Grads, KeptLogits, Schedule, cat_parts, chunk_losses, scale_valid_unit_grads
from .gemm import logits, matmul_inputs, matmul_operand, mm_into
from .stats import GradCoefs, combine, compute_dtype, scale_coefs, token_loss, unit_loss_coefs

__all__ = ["linear_cross_entropy", "Backward", "ChunkSaved", "Saved", "grads_from_unit_dx"]


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    group=None,
    sequence_parallel: bool = False,
    vocab_size: int | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    num_valid_tokens: int | torch.Tensor | None = None,
    z_loss: float = 0.0,
    softcap: float | None = None,
    chunks: int | str = "auto",
    schedule: str = "auto",
    recompute: bool | None = None,
    policy: _policy.ChunkPolicy | None = None,
    check: bool = True,
    check_replicated: bool = True,
    logits_dtype: torch.dtype | None = None,
    batch_invariant: bool = False,
) -> torch.Tensor:
    r"""``cross_entropy(hidden @ weight.T + bias, target)`` with ``weight`` sharded along the vocab.

    Args:
        hidden: ``[..., H]``, replicated over the group; with ``sequence_parallel=True``, this rank's
            token shard (any split of the tokens; ``target`` must be split the same way). A DTensor
            (Replicate, or sequence-sharded) is accepted.
        weight: ``[V_local, H]``, this rank's ``torch.chunk(W, world, 0)[rank]`` shard of the lm_head
            weight, or a DTensor ``Shard(0)`` (what ``ColwiseParallel`` gives), whose mesh sets the group.
        target: ``[...]`` (``hidden.shape[:-1]``) global class ids.
        bias: ``[V_local]`` shard, optional.
        group, vocab_size, ignore_index, reduction, label_smoothing, num_valid_tokens, z_loss, softcap,
        check: as in :func:`vparallel_ce.cross_entropy`. With ``sequence_parallel`` the ``sum``/``mean`` are over
            the tokens of the whole group (identical on every rank) and ``none`` returns this rank's
            tokens' losses.
        chunks: an int: that many token chunks (``chunks=1``: no chunking, the 3-matmul fast point),
            or vocab blocks with ``schedule="vocab"``; ``"auto"``: the policy sizes them and may pick
            the vocab schedule.
        schedule: ``"token"``, ``"vocab"`` or ``"auto"`` (token for an int ``chunks``, else the policy).
        recompute: ``True`` recomputes the logits in backward (flat forward memory: what a pipeline
            schedule holding several microbatches wants); ``False`` makes the gradients in forward
            (mean/sum only); ``None``, with one microbatch in flight: one token chunk keeps its logits
            for the backward (3 matmuls), several token chunks make the gradients in forward.
        policy: a :class:`vparallel_ce.policy.ChunkPolicy` (budget, microbatches in flight, ...).
            ``vparallel_ce.policy.explain`` with the same arguments prints the plan this call runs.
        check_replicated: with ``check`` on a group and without ``sequence_parallel``, check that
            ``hidden`` is the same on every rank (an integer sum of its bits rides on the call's
            exchange: one read of ``hidden``). ``False`` skips it, for a caller whose hidden states
            are known to differ on purpose (a pipeline's shape-inference call on uninitialised
            outputs, whose result is discarded).
        logits_dtype: ``None``: the logits are made in the matmul dtype (bf16 inputs round them to
            bf16 before the fp32 statistics). ``torch.float32``: the statistics, loss and the logits'
            gradient are made from the GEMM's fp32 result, never rounded (a no-op for fp32/fp64
            matmuls); the gradient GEMMs still take that gradient in the matmul dtype. See
            ``docs/rl.md`` ("Precision of the logits") for what it costs.
        batch_invariant: as in :func:`vparallel_ce.cross_entropy`, for the per-token loss and each
            token's row of ``hidden.grad``: the lm_head GEMMs run as Triton GEMMs of one fixed tile
            config on a GPU (bf16/fp16; never the fused kernels), else through torch one 128-row
            tile at a time; the vocab is walked in the same blocks whatever ``N`` and the gradients
            are made in backward (``schedule`` and ``recompute`` are overridden); the hidden
            gradient is summed over the group in rank order. ``weight.grad``/``bias.grad`` sum over
            tokens and are not batch invariant.

    Returns:
        fp32 loss (fp64 for fp64 inputs): scalar for mean/sum, per-token for none. Gradients, each in
        its input's dtype: ``weight.grad``/``bias.grad`` are this shard's; ``hidden.grad`` is the full
        gradient (summed over the group), or this rank's token rows of it with ``sequence_parallel``.
    """
    options = Options(reduction=reduction, ignore_index=ignore_index, label_smoothing=label_smoothing,
                      num_valid_tokens=num_valid_tokens, z_loss=z_loss, softcap=softcap, chunks=chunks,
                      schedule=schedule, recompute=recompute, policy=policy, vocab_size=vocab_size,
                      sequence_parallel=sequence_parallel, check=check, check_replicated=check_replicated,
                      logits_dtype=logits_dtype, batch_invariant=batch_invariant)
    if torch.compiler.is_compiling():  # one custom op in the graph (vparallel_ce.compiled)
        out, shape = compiled.apply("linear_cross_entropy", (hidden, weight, target, bias), group, options)
    else:
        call, inp = linear_call(hidden, weight, target, bias, op="linear_cross_entropy", group=group, options=options,
                                compact=True)
        out, shape = _LinearCrossEntropy.apply(inp.h, inp.w, inp.b, inp.target, call), inp.shape
        if reduction == "none":  # (compacted: the kept rows' losses back in the caller's order)
            out = inp.place(out)
    return out.reshape(shape) if reduction == "none" else out


class Backward(enum.Enum):
    """What a forward of :class:`_LinearCrossEntropy` leaves its backward, from the plan's
    :class:`~vparallel_ce.policy.GradMode` and the inputs that need a gradient."""

    #: ``GradMode.IN_FORWARD``: the gradients for an upstream gradient of 1; backward scales them
    SCALE = enum.auto()
    #: ``GradMode.FROM_KEPT_LOGITS`` on a rank holding the whole vocab (one chunk, one block): the
    #: kept logits were overwritten with their gradient for 1 by the statistics' kernel
    #: (:meth:`Schedule.grad_with_statistics`); backward scales the ``[N, H]`` side
    UNIT_LOGITS = enum.auto()
    #: ``GradMode.FROM_KEPT_LOGITS``: the gradient pass runs over the kept logits
    KEPT_LOGITS = enum.auto()
    #: ``GradMode.RECOMPUTE`` (or no input needs a gradient): the gradient pass recomputes them
    RECOMPUTE = enum.auto()

    @classmethod
    def of(cls, call: Call, need, b, schedule: "Schedule") -> "Backward":
        """``schedule``: the forward's (it keeps the logits unless this is ``RECOMPUTE``)."""
        if not any(need):
            return cls.RECOMPUTE
        if call.plan.grad_mode is GradMode.IN_FORWARD:
            return cls.SCALE
        if not Schedule.keeps_for_backward(call, need):
            return cls.RECOMPUTE
        return cls.UNIT_LOGITS if schedule.grad_with_statistics(call, b) else cls.KEPT_LOGITS

    @staticmethod
    def keeps_logits(call: Call, need) -> bool:
        """Whether the forward's schedule keeps its logits (for gradients in forward or backward)."""
        return any(need) and (call.plan.grad_mode is GradMode.IN_FORWARD or Schedule.keeps_for_backward(call, need))


@dataclass
class ChunkSaved:
    """What the backward needs of one token chunk: the global max ``shift`` and the loss' unit
    coefficients (:func:`~vparallel_ce.stats.unit_loss_coefs`) of its rows, and the forward's
    target maps ``(t_c, local_t, owned, valid)``. Under ``Backward.UNIT_LOGITS`` the coefficients
    are made only if a second backward recomputes (:meth:`coefs_for`), from ``unit``."""

    shift: torch.Tensor
    coefs: GradCoefs | None = None
    targets: tuple | None = None
    unit: tuple | None = None  # (statistics, t_c, n_valid)

    def coefs_for(self, call: Call) -> GradCoefs:
        if self.coefs is None:
            st, t_c, n_valid = self.unit
            valid = t_c != call.spec.ignore_index
            self.coefs = unit_loss_coefs(combine(st, call.layout, rank_ordered=call.batch_invariant), valid, n_valid, call.reduction, call.spec)
        return self.coefs


@dataclass
class Saved:
    """A forward's state for its backward (beside ``ctx.saved_tensors``: ``(h, w, b, t)``, or under
    ``Backward.SCALE`` the gradients for 1)."""

    call: Call
    mode: Backward
    need: tuple[bool, bool, bool]
    chunks: list[ChunkSaved] = field(default_factory=list)
    kept: KeptLogits = field(default_factory=KeptLogits)


class _LinearCrossEntropy(torch.autograd.Function):
    """Thin autograd wrapper: forward and backward walk the same :class:`Schedule`; what the
    forward leaves is a :class:`Saved` of one :class:`Backward` mode. Autocast is off inside; the
    matmul dtype comes from the :class:`Call`. The forward makes each chunk's gradient
    coefficients for an upstream gradient of 1 (:func:`~vparallel_ce.stats.unit_loss_coefs`); the
    backward scales them, or the gradients made from them."""

    @staticmethod
    def forward(ctx, h, w, b, t, call: Call):
        need = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], b is not None and ctx.needs_input_grad[2])
        with autocast_off(h.device.type):
            spec = call.spec
            hm, wm, bm = matmul_inputs(call, h, w, b)
            ops = call.ops(wm)
            sched = Schedule.of(call, keep_logits=Backward.keeps_logits(call, need))
            saved = Saved(call, Backward.of(call, need, b, sched), need)
            mode = saved.mode
            rows = sched.rows(call)
            grads = None
            if mode is Backward.SCALE:
                grads = Grads(h, w, b, need, acc_dtype=compute_dtype(wm.dtype), rows=rows, schedule=sched)
            n_valid, per_token = None, []
            one_pass = mode is Backward.SCALE and sched.unit_grad_with_statistics(call, b)
            for c, h_c, t_c, targets in sched.walk(call, rows, hm, t):
                if mode is Backward.UNIT_LOGITS:
                    # one kernel makes the chunk's target maps, statistics, loss, and the kept
                    # logits' gradient for 1 over them: besides it, the mean's divisor (at world 1 the
                    # target check's kernel, launched after this GEMM) and the reduction
                    x = logits(call, h_c, wm, bm)
                    n_valid = call.valid_count(t) if call.reduction == "mean" else None
                    st, loss_c = ops.loss_stats_grad_(x, t_c, n_valid, call.reduction, spec)
                    per_token.append(loss_c)
                    saved.kept.add([x])
                    # no kernels for the coefficients now; a recomputing walk makes the target maps again
                    saved.chunks.append(ChunkSaved(st.max, unit=(st, t_c, n_valid)))
                    continue
                if one_pass:  # as UNIT_LOGITS, chunk by chunk: the gradient for 1 made at once from it
                    x = logits(call, h_c, wm, bm)
                    if n_valid is None and call.reduction == "mean":
                        n_valid = call.valid_count(t)
                    st, loss_c = ops.loss_stats_grad_(x, t_c, n_valid, call.reduction, spec)
                    per_token.append(loss_c)
                    grads.add_chunk(rows, c, h_c, sched.blocks[0], wm, x)
                    del x
                    continue
                st, kept = sched.statistics(call, ops, h_c, wm, bm, targets)
                local_t, owned, valid = targets()
                if n_valid is None:  # launched after the first GEMM too (mean's scale needs it from chunk 0)
                    whole = len(rows) == 1 and not call.sequence_parallel  # the chunk's mask is all of t's
                    n_valid = call.valid_count(t, valid if whole else None)
                coefs = unit_loss_coefs(st, valid, n_valid, call.reduction, spec)
                per_token.append(chunk_losses(rows, c, token_loss(st, valid, spec), call.reduction))
                if mode is Backward.SCALE:
                    sched.gradients(call, ops, rows, c, h_c, wm, bm, local_t, owned, st.max, coefs, kept, grads)
                    continue
                saved.chunks.append(ChunkSaved(st.max, coefs, (t_c, local_t, owned, valid)))
                if mode is Backward.KEPT_LOGITS:
                    saved.kept.add(kept)
            if n_valid is None and call.reduction == "mean":
                n_valid = call.valid_count(t)
            ctx.saved = saved
            if mode is Backward.SCALE:  # only [N, H] / [V_loc, H] gradients (and the targets) are kept, no logits
                ctx.save_for_backward(*grads.finish(rows), t)
            else:
                ctx.save_for_backward(h, w, b, t)
            return call.loss_output(ctx, ops, cat_parts(per_token), n_valid)

    @staticmethod
    @first_order_only("linear_cross_entropy")
    @settles_check
    def backward(ctx, grad_out):
        saved: Saved = ctx.saved
        call = saved.call
        if saved.mode is Backward.SCALE:  # made in forward for grad_out == 1: scale by the scalar
            *grads, t = ctx.saved_tensors
            return scale_valid_unit_grads(call, grads, grad_out, t) + (None, None)
        h, w, b, t = ctx.saved_tensors
        with autocast_off(h.device.type):
            hm, wm, bm = matmul_inputs(call, h, w, b)
            ops = call.ops(wm)
            kept_chunks = saved.kept.take()  # empty on a second backward of the graph: it recomputes
            if saved.mode is Backward.UNIT_LOGITS and kept_chunks:
                g = grad_out
                if call.reduction == "none":  # an ignored token's rows stay 0 whatever its g (nan too)
                    g = torch.where(t != call.spec.ignore_index, g.reshape(-1), 0)
                return grads_from_unit_dx(ops, kept_chunks[0][0], h, w, b, hm, wm, g, saved.need, t,
                                          call.spec.ignore_index) + (None, None)
            sched = Schedule.of(call, keep_logits=False)
            rows = sched.rows(call)
            grads = Grads(h, w, b, saved.need, acc_dtype=compute_dtype(wm.dtype), rows=rows, schedule=sched)
            known = [chunk.targets for chunk in saved.chunks] if saved.mode is not Backward.UNIT_LOGITS else None
            for c, h_c, t_c, targets in sched.walk(call, rows, hm, t, known):
                local_t, owned, _ = targets()
                g = rows.gather(c, grad_out.reshape(-1)) if call.reduction == "none" else grad_out
                chunk = saved.chunks[c]
                sched.gradients(call, ops, rows, c, h_c, wm, bm, local_t, owned, chunk.shift,
                                scale_coefs(chunk.coefs_for(call), g), kept_chunks[c] if kept_chunks else [], grads)
            return grads.finish(rows) + (None, None)


def grads_from_unit_dx(ops, dx, h, w, b, hm, wm, g, need, target, ignore_index) -> tuple:
    """``(dh, dW, db)`` from ``dx [N, V]``, the logits' gradient for an upstream gradient of 1 that
    the forward made (:meth:`Schedule.grad_with_statistics`), and the upstream ``g`` (a scalar, or
    per token for ``none``)::

        dW = dx^T (g h),    dh = g (dx W),    db = g sum_i dx_i

    ``g`` goes on the ``[N, H]`` operand and result, never on ``dx`` (that would be one more pass
    over the logits). ``g h`` is formed in fp32, rounded once into the matmul dtype (exact for
    ``g = 1``) and freed before ``dh`` is allocated, so the peak is ``dx + dW + dh``, as with the
    gradient pass of the kept logits. fp32 logits (``Call.logits_dtype``) leave an fp32 ``dx`` here
    (the forward's kernel writes it over them): ``db`` sums it as it is, the GEMMs take a copy in
    the matmul dtype.

    An ignored token's (``target == ignore_index``) rows of ``g h`` and ``dh`` are not scaled: its
    row of ``dx`` is 0, so whatever ``g`` (nan, inf) it adds nothing to ``dW`` and its ``dh`` row
    stays ``0 W``, as ``F.cross_entropy``'s; ``db`` takes ``g`` only where some token is valid."""
    need_h, need_w, need_b = need
    dh = dw = db = None
    if need_b and b is not None:  # a scalar g: a bias with reduction="none" does not take this path
        cdt = compute_dtype(dx.dtype)
        g_b = torch.where((target != ignore_index).any(), g.to(cdt), torch.ones((), dtype=cdt, device=g.device))
        db = (dx.sum(0, dtype=cdt) * g_b).to(b.dtype)
    dx = matmul_operand(dx, hm.dtype)
    if need_w:
        gh = ops.scale_rows(hm, g, target=target, ignore_index=ignore_index)
        dw = torch.empty_like(w)
        mm_into(dw, dx.t(), gh, accumulate=False)
        del gh
    if need_h:
        dh = torch.empty_like(h)
        mm_into(dh, dx, wm, accumulate=False)
        ops.scale_rows(dh, g, out=dh, target=target, ignore_index=ignore_index)
    return dh, dw, db


compiled.register("linear_cross_entropy", _LinearCrossEntropy,
                  compiled.front_door(linear_call, lambda inp: (inp.h, inp.w, inp.b, inp.target)),
                  grad_of=(0, 1, 3, None, None), target=2, optional={3})
