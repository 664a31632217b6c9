r"""``linear_mtp_loss``: the multi-token-prediction loss of DeepSeek-V3-style MTP heads, through the
shared, vocab-sharded lm_head, in ONE walk of :mod:`vparallel_ce.chunk_walk` for every head.

Heads ``d = 0..D`` (``0`` the main head, ``d >= 1`` the MTP depths) each give hidden states ``h_d
[N, H]`` and labels ``t_d`` (depth ``d``: the main labels rolled left by ``d``,
:func:`vparallel_ce.labels.mtp_labels`). With ``l_i`` the cross-entropy of token ``i`` through the
lm_head and ``n_d`` the divisor of head ``d`` (its valid tokens, or as given)::

    L_d  = sum_{i in head d, t_i valid} l_i / n_d              ("mean";  "sum": n_d = 1)
    loss = L_0 + mtp_scale * (1 / D) sum_{d=1..D} L_d

so the loss is one weighted sum ``sum_i r_i l_i`` over the rows of all heads, ``r_i = c_d / n_d`` with
``c_0 = 1`` and ``c_d = mtp_scale / D``. The rows of every head are stacked into one ``[(D+1) N, H]``
call and walked as one: per chunk the statistics (2 all-reduces) and, from the per-token weights
``r``, the loss' gradient coefficients (:func:`vparallel_ce.stats.loss_grad_coefs`). ``dW`` of the
lm_head is made once, summed over every head's rows in fp32 (or one GEMM with one chunk); each
head's ``dh`` is its rows of the one hidden gradient. A head without a valid token adds nothing.

Metrics, detached: each head's ``L_d`` and its top-1 acceptance, the share of its valid tokens
whose argmax over the global vocab (ties to the lowest id, :mod:`vparallel_ce.top1`) is the label,
from the logits the walk makes anyway (one more all-gather of ``2`` float64 per token and rank).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F

from . import comm, compiled, kernels, top1
from .autocast import autocast_off
from .call import Call, linear_call, settles_check
from .chunk_walk import Grads, KeptLogits, Schedule, scale_valid_unit_grads
from .compaction import Compaction, compacted_head_rows
from .gemm import logits, matmul_inputs
from .labels import mtp_labels
from .linear import ChunkSaved
from .options import Options
from .policy import DEFAULT_POLICY, ChunkPolicy, GradMode
from .second_order import first_order_only
from .stats import compute_dtype, loss_grad_coefs, scale_coefs, token_loss
from .validate import Problem

__all__ = ["linear_mtp_loss", "MTPOutput"]


class MTPOutput(NamedTuple):
    """What :func:`linear_mtp_loss` returns (a tuple: ``loss, head_losses, acceptance, num_valid_tokens``).

    Attributes:
        loss: the scalar loss ``L_0 + mtp_scale * mean_d L_d`` (fp32; fp64 for fp64 inputs), with
            gradients.
        head_losses: ``[D + 1]`` detached: ``L_d`` of each head, ``0`` the main head -- its mean
            cross-entropy (``"sum"``: its summed cross-entropy); nan for a head with no valid token
            under ``"mean"`` (0/0) unless a count is given.
        acceptance: ``[D + 1]`` detached: each head's top-1 hits (argmax == label) over its valid
            tokens, divided by ``n_d`` (``"mean"``) or their number (``"sum"``).
        num_valid_tokens: ``[D + 1]`` float64: the divisors ``n_d`` of ``"mean"`` (as given, or each
            head's own valid tokens over the group), each head's own count for ``"sum"``.
    """

    loss: torch.Tensor
    head_losses: torch.Tensor
    acceptance: torch.Tensor
    num_valid_tokens: torch.Tensor


def linear_mtp_loss(
    hiddens: Sequence[torch.Tensor],
    weight: torch.Tensor,
    labels,
    bias: torch.Tensor | None = None,
    *,
    mtp_scale: float = 0.3,
    positions: torch.Tensor | None = None,
    group=None,
    num_valid_tokens=None,
    reduction: str = "mean",
    sequence_parallel: bool = False,
    vocab_size: int | None = None,
    ignore_index: int = -100,
    chunks: int | str = "auto",
    schedule: str = "auto",
    recompute: bool | None = None,
    policy: ChunkPolicy | None = None,
    check: bool = True,
    check_replicated: bool = True,
    logits_dtype: torch.dtype | None = None,
) -> MTPOutput:
    r"""Multi-token-prediction loss of a main head and ``D`` MTP depths through one lm_head shard.

    Args:
        hiddens: ``D + 1 >= 2`` tensors ``[..., S, H]`` of one shape: the main head's hidden states
            (after the final norm), then each depth's. A detached one (no ``requires_grad``) is used
            as given and gets no gradient. With ``sequence_parallel``, this rank's token shard of each.
        weight: ``[V_local, H]``, this rank's ``torch.chunk(W, world, 0)`` shard of the lm_head.
        labels: the main head's next-token labels ``[..., S]`` (``hiddens[0].shape[:-1]``), which
            are rolled for each depth here (:func:`vparallel_ce.labels.mtp_labels`, with
            ``positions``); or ``D + 1`` label tensors, one per head, already rolled -- what sequence
            or context parallelism needs (:func:`vparallel_ce.labels.context_parallel_labels`),
            since a rank's shard cannot be rolled locally.
        bias: ``[V_local]`` shard, optional.
        mtp_scale: the weight of the mean of the depths' losses (DeepSeek-V3: 0.3, then 0.1).
        positions: ``[..., S]`` reset-style position ids of packed documents (0 at each document's
            first token): no depth label crosses a document boundary. Only with one ``labels`` tensor.
        group, vocab_size, ignore_index, chunks, schedule, recompute, policy, check,
            check_replicated, logits_dtype: as in :func:`vparallel_ce.linear_cross_entropy`
            (the chunks are of the ``(D + 1) N`` stacked rows).
        num_valid_tokens: ``"mean"``'s divisors: None (each head's own valid tokens, over the group
            with ``sequence_parallel``), one count for every head (an int or a one-element integer
            tensor: torchtitan's ``global_valid_tokens``), or ``D + 1`` counts (a sequence of ints or
            an integer tensor, :func:`vparallel_ce.labels.count_head_tokens`) for exact gradient
            accumulation over microbatches and DP / CP ranks. The same on every rank of ``group``.
        reduction: ``"mean"`` or ``"sum"`` (each head's loss summed, the same weights).
        sequence_parallel: each rank holds its own token shard of every hidden and label tensor
            (labels as ``D + 1`` tensors); losses and metrics cover the whole group.

    Returns:
        :class:`MTPOutput` ``(loss, head_losses, acceptance, num_valid_tokens)``. Gradients, each
        in its input's dtype: every hidden's (the full gradient, summed over the group; this
        rank's rows with ``sequence_parallel``), ``weight.grad``/``bias.grad`` this shard's.
        ``loss`` equals torchtitan 0.3.0's ``MTPLoss`` on the gathered logits for ``"sum"`` (and
        ``"mean"`` with one count for every head); see ``docs/mtp.md``. Under ``torch.compile`` the op
        runs eagerly (a graph break).
    """
    return _linear_mtp_loss(hiddens, weight, labels, bias, mtp_scale, positions, group, num_valid_tokens, reduction,
                            sequence_parallel, vocab_size, ignore_index, chunks, schedule, recompute, policy, check,
                            check_replicated, logits_dtype)


# under torch.compile: a graph break, the op runs eagerly (its front door reads values on the host)
@compiled.run_eagerly
def _linear_mtp_loss(hiddens, weight, labels, bias, mtp_scale, positions, group, num_valid_tokens, reduction,
                     sequence_parallel, vocab_size, ignore_index, chunks, schedule, recompute, policy, check,
                     check_replicated, logits_dtype) -> MTPOutput:
    heads, problem = _heads(hiddens, weight, labels, positions, ignore_index, sequence_parallel)
    counts, count_problem = _given_counts(num_valid_tokens, len(heads[0]) if heads else 0, reduction)
    problem = problem or count_problem
    n_heads = len(heads[0]) if heads else 0
    options = Options(reduction=reduction, ignore_index=ignore_index, chunks=chunks, schedule=schedule,
                      recompute=recompute, policy=policy, vocab_size=vocab_size, sequence_parallel=sequence_parallel,
                      check=check, check_replicated=check_replicated, logits_dtype=logits_dtype,
                      mtp_heads=n_heads if problem is None else 0, mtp_scale=mtp_scale, mtp_counts=counts)
    if problem is None:
        hs, ts = heads
        h_all = torch.cat([h.reshape(-1, h.shape[-1]) for h in hs])
        t_all = torch.cat([t.reshape(-1) for t in ts])
    else:  # stand-ins the front door checks beside the problem, which it raises on every rank
        h_all, t_all = _stand_ins(weight)
    call, inp = linear_call(h_all, weight, t_all, bias, op="linear_mtp_loss", group=group, options=options,
                            more_checks=lambda *_: _mtp_problem(problem, reduction), memo=None)
    per_head = inp.target.numel() // n_heads
    own = (inp.target.reshape(n_heads, per_head) != ignore_index).sum(1)
    if problem is None:
        call, inp, per_head = _compacted(call, inp, own, n_heads, per_head, options)
    heads_of = torch.arange(n_heads, device=inp.target.device).repeat_interleave(per_head)
    if call.sequence_parallel:  # every rank's tokens count
        comm.all_reduce_sum_(own, call.layout.group)
    # the weights c_d / n_d formed in float64 (counts exact to 2^53), rounded once in the op
    coef = torch.full((n_heads,), float(mtp_scale) / (n_heads - 1), dtype=torch.float64, device=own.device)
    coef[0] = 1.0
    if reduction == "mean":
        n = own.double() if counts is None else torch.where(counts >= 0, counts.to(own.device, torch.float64),
                                                             float("nan"))
        weights = coef / n
    else:
        n, weights = own.double(), coef
    # a head without a valid token adds nothing (its weight never meets a valid token's loss)
    loss, loss_sums, hits = _LinearMTP.apply(inp.h, inp.w, inp.b, inp.target, weights, heads_of, call)
    head_losses = loss_sums if reduction == "sum" else loss_sums / n.to(loss_sums.dtype)
    acceptance = hits if reduction == "sum" else hits / n.to(hits.dtype)
    return MTPOutput(loss, head_losses, acceptance, n)


def _heads(hiddens, weight, labels, positions, ignore_index, sequence_parallel):
    """``((hiddens, labels), None)``, each a list of ``D + 1`` tensors, or ``(None, Problem)``."""
    if isinstance(hiddens, torch.Tensor) or not isinstance(hiddens, Sequence) or len(hiddens) < 2:
        return None, Problem(ValueError, "hiddens must be a sequence of D + 1 >= 2 tensors (the main head's hidden "
                                         "states, then each MTP depth's)")
    if not all(isinstance(h, torch.Tensor) for h in hiddens):
        return None, Problem(TypeError, "hiddens must hold tensors, got "
                                        f"{[type(h).__name__ for h in hiddens]}")
    shapes = {tuple(h.shape) for h in hiddens}
    if len(shapes) != 1 or hiddens[0].dim() < 2:
        return None, Problem(ValueError, "every hidden must be [..., S, H] of one shape, got shapes "
                                         f"{[tuple(h.shape) for h in hiddens]}")
    if len({h.dtype for h in hiddens}) != 1:
        return None, Problem(TypeError, f"every hidden must have one dtype, got {[h.dtype for h in hiddens]}")
    token_shape = tuple(hiddens[0].shape[:-1])
    if isinstance(labels, torch.Tensor):
        if sequence_parallel:
            return None, Problem(ValueError, "with sequence_parallel=True pass labels as D + 1 tensors (one per "
                                             "head, rolled over the whole sequence): a rank's shard of the labels "
                                             "cannot be rolled locally (vparallel_ce.labels.mtp_labels)")
        if tuple(labels.shape) != token_shape or (positions is not None and tuple(positions.shape) != token_shape):
            return None, Problem(ValueError, f"labels {tuple(labels.shape)} and positions "
                                             f"{None if positions is None else tuple(positions.shape)} must have "
                                             f"the hidden states' token shape {token_shape}")
        return (list(hiddens), mtp_labels(labels, len(hiddens) - 1, positions=positions,
                                          ignore_index=ignore_index)), None
    if positions is not None:
        return None, Problem(ValueError, "positions are for rolling one labels tensor; per-head labels are rolled "
                                         "already (pass positions to mtp_labels / context_parallel_labels)")
    if (not isinstance(labels, Sequence) or len(labels) != len(hiddens)
            or not all(isinstance(t, torch.Tensor) and tuple(t.shape) == token_shape for t in labels)):
        return None, Problem(ValueError, f"labels must be a tensor of shape {token_shape} or {len(hiddens)} such "
                                         "tensors (one per head)")
    return (list(hiddens), list(labels)), None


def _given_counts(count, heads: int, reduction: str):
    """``num_valid_tokens`` as a ``[heads]`` integer tensor (or None), or a Problem."""
    if count is None:
        return None, None
    if reduction != "mean":
        return None, Problem(ValueError, f"num_valid_tokens is the divisor of reduction='mean', got {reduction!r}")
    if isinstance(count, int) and not isinstance(count, bool):
        count = torch.tensor([count] * max(heads, 1))
    elif isinstance(count, Sequence) and all(isinstance(c, int) and not isinstance(c, bool) for c in count):
        count = torch.tensor(list(count), dtype=torch.int64)
    if (not isinstance(count, torch.Tensor) or count.is_floating_point() or count.dtype == torch.bool
            or count.numel() not in (1, heads)):
        return None, Problem(ValueError, f"num_valid_tokens must be None, one count or {heads} counts (one per head) "
                                         f"as ints or an integer tensor, got {count!r}")
    if count.device.type == "cpu" and bool((count < 0).any()):  # (a device count is not read: nan if negative)
        return None, Problem(ValueError, f"num_valid_tokens must be >= 0, got {count.tolist()}")
    return count.reshape(-1).expand(heads).to(torch.int64), None


def _mtp_problem(problem: Problem | None, reduction: str) -> Problem | None:
    if problem is None and reduction not in ("mean", "sum"):
        return Problem(ValueError, f"linear_mtp_loss: reduction must be 'mean' or 'sum', got {reduction!r}")
    return problem


def _compacted(call: Call, inp, own: torch.Tensor, n_heads: int, per_head: int, o: Options):
    """``(call, inputs, rows per head)`` over each head's valid rows (ignored-token compaction,
    :mod:`vparallel_ce.compaction`), where the policy compacts; as they are otherwise. Every head
    keeps as many rows as the head with the most valid ones (rounded up as the policy rounds), so
    the heads stay equal parts of the stacked rows and a token chunk stays one head's rows. The
    per-head counts are read on the host (a sync, where :meth:`ChunkPolicy.reads_valid_count`
    accepts one); the targets are replicated or the group's own, so every rank keeps the same
    rows. Not with sequence parallelism, where each rank's counts differ."""
    policy = o.policy or DEFAULT_POLICY
    total = inp.target.numel()
    if (call.sequence_parallel or call.replan is None or kernels.is_fake(inp.target)
            or not policy.reads_valid_count(total, inp.w.shape[-1], call.layout.local_size)):
        return call, inp, per_head
    kept = policy.kept_rows((per_head,), (int(own.max()),))
    if kept is None:
        return call, inp, per_head
    rows = Compaction(compacted_head_rows(inp.target, o.ignore_index, n_heads, kept[0]), total)
    return call.with_rows((kept[0] * n_heads,)), inp.compacted(rows), kept[0]


def _one_pass_head(call: Call, sched: Schedule, b, rows, c: int, per_head: int) -> int | None:
    """The head whose rows alone make up token chunk ``c``, where one kernel can make the chunk's
    statistics, loss and gradient for an upstream gradient of 1 over its kept logits
    (:meth:`Schedule.unit_grad_with_statistics`: a read of the logits fewer than statistics then
    gradient; the chunk's rows share one weight), else None."""
    sl = rows.local[c]
    if not sched.unit_grad_with_statistics(call, b) or sl.stop <= sl.start or per_head == 0:
        return None
    head = sl.start // per_head
    return head if (sl.stop - 1) // per_head == head else None


def _stand_ins(weight):
    like = weight if isinstance(weight, torch.Tensor) and weight.dim() == 2 else torch.zeros(0, 1)
    return like.new_zeros(0, like.shape[-1]), torch.zeros(0, dtype=torch.int64, device=like.device)


class _LinearMTP(torch.autograd.Function):
    """One walk over the stacked rows of every head: per chunk the statistics (and the top-1 of
    the logits), the loss' gradient coefficients from the rows' weights ``r``; gradients made in
    forward for an upstream gradient of 1 (``GradMode.IN_FORWARD``) or in backward from the kept
    or recomputed logits, as :class:`vparallel_ce.linear._LinearCrossEntropy` makes them.
    Returns the loss and, detached, each head's summed losses and top-1 hits."""

    @staticmethod
    def forward(ctx, h, w, b, t, weights, heads_of, call: Call):
        """``weights [D + 1]``: each head's ``c_d / n_d``; ``heads_of [M]``: the head of each row."""
        need = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], b is not None and ctx.needs_input_grad[2])
        with autocast_off(h.device.type):
            spec, lay = call.spec, call.layout
            hm, wm, bm = matmul_inputs(call, h, w, b)
            ops = call.ops(wm)
            in_forward = any(need) and call.plan.grad_mode is GradMode.IN_FORWARD
            sched = Schedule.of(call, keep_logits=in_forward or Schedule.keeps_for_backward(call, need))
            rows = sched.rows(call)
            cdt = compute_dtype(wm.dtype)
            n_heads = weights.numel()
            r = weights.to(cdt)[heads_of]
            grads = Grads(h, w, b, need, acc_dtype=cdt, rows=rows, schedule=sched) if in_forward else None
            # per head (one more slot for sequence parallelism's padding rows): summed losses and hits
            sums = torch.zeros(n_heads + 1, 2, dtype=cdt, device=h.device)
            saved, kept = [], KeptLogits()
            per_head = t.numel() // n_heads
            for c, h_c, t_c, targets in sched.walk(call, rows, hm, t):
                head = _one_pass_head(call, sched, b, rows, c, per_head) if in_forward else None
                if head is not None:  # the head's weight is the chunk's: one kernel, as linear_cross_entropy's
                    x = logits(call, h_c, wm, bm)
                    # r = 1 / n for mean: the head's c_d / n_d as the divisor n_d / c_d (float64); the
                    # top-1 read in the same pass, before the gradient is written over the logits
                    st, loss_c, mine = ops.loss_stats_grad_(x, t_c, 1.0 / weights[head], "mean", call.spec,
                                                            with_top1=True)
                    valid = targets()[2]
                    hit = valid & (top1.join(mine, lay) == t_c)
                    sums[head] += torch.stack([loss_c.to(cdt).sum(), hit.to(cdt).sum()])
                    grads.add_chunk(rows, c, h_c, sched.blocks[0], wm, x)
                    del x
                    continue
                best = []

                def see(blk, x, best=best):
                    mine = top1.local(x, lay.offset + blk.start)
                    best.append(mine if not best else top1.merge(best.pop(), mine))

                st, kept_c = sched.statistics(call, ops, h_c, wm, bm, targets, on_block=see)
                local_t, owned, valid = targets()
                r_c = torch.where(valid, rows.gather(c, r, fill=0), 0.0)
                head_c = rows.gather(c, heads_of, fill=n_heads)
                # per-head sums as one small GEMM with the rows' one-hot heads: a fixed order (an
                # index_add_ would add in whatever order a GPU's atomics land)
                one_hot = F.one_hot(head_c, n_heads + 1).to(cdt)
                hit = valid & (top1.join(best[0], lay) == t_c)
                sums += one_hot.t() @ torch.stack([token_loss(st, valid, spec), hit.to(cdt)], dim=1)
                coefs = loss_grad_coefs(st.max, st.log_s, r_c, spec, valid)
                if in_forward:
                    sched.gradients(call, ops, rows, c, h_c, wm, bm, local_t, owned, st.max, coefs, kept_c, grads)
                    continue
                saved.append(ChunkSaved(st.max, coefs, (t_c, local_t, owned, valid)))
                if kept_c:
                    kept.add(kept_c)
            loss_sums, hits = sums[:n_heads].unbind(1)
            # sum_d (c_d / n_d) * (summed losses of head d): a head without a valid token adds 0
            # whatever its weight (inf for a count of 0)
            loss = torch.where(loss_sums == 0, 0.0, loss_sums * weights.to(cdt)).sum()
            ctx.call, ctx.need, ctx.in_forward, ctx.saved, ctx.kept = call, need, in_forward, saved, kept
            if in_forward:
                ctx.save_for_backward(*grads.finish(rows), t)
            else:
                ctx.save_for_backward(h, w, b, t)
            out = call.settle_forward(ctx, loss, loss_sums, hits)
            ctx.mark_non_differentiable(*out[1:])
            return out

    @staticmethod
    @first_order_only("linear_mtp_loss")
    @settles_check
    def backward(ctx, grad_loss, _sums, _hits):
        call = ctx.call
        none = (None,) * 4
        if ctx.in_forward:  # made in forward for an upstream gradient of 1: scale by the scalar
            *grads, t = ctx.saved_tensors
            return scale_valid_unit_grads(call, grads, grad_loss, t) + none
        h, w, b, t = ctx.saved_tensors
        if not any(ctx.need):
            return (None,) * 3 + none
        with autocast_off(h.device.type):
            hm, wm, bm = matmul_inputs(call, h, w, b)
            ops = call.ops(wm)
            kept_chunks = ctx.kept.take()  # empty on a second backward of the graph: it recomputes
            sched = Schedule.of(call, keep_logits=False)
            rows = sched.rows(call)
            grads = Grads(h, w, b, ctx.need, acc_dtype=compute_dtype(wm.dtype), rows=rows, schedule=sched)
            known = [chunk.targets for chunk in ctx.saved]
            for c, h_c, _, targets in sched.walk(call, rows, hm, t, known):
                local_t, owned, _ = targets()
                chunk = ctx.saved[c]
                sched.gradients(call, ops, rows, c, h_c, wm, bm, local_t, owned, chunk.shift,
                                scale_coefs(chunk.coefs, grad_loss), kept_chunks[c] if kept_chunks else [], grads)
            return grads.finish(rows) + none
