r"""Per-token log-probs and entropy for RL post-training, kept vocab-sharded.

With ``z = logits / T`` over the GLOBAL vocab (``T`` the sampling temperature), per token::

    logp_i = z_{i, t_i} - lse_i,        lse_i = log sum_j exp z_ij
    H_i    = -sum_j p_ij log p_ij,      p_ij = exp(z_ij - lse_i)

Both come out of the statistics pass of the loss ops (:mod:`vparallel_ce.stats`): ``logp`` needs the
target logit and ``lse`` the loss already has; the entropy needs one more per-token float,
``E = sum_j e^{z_j - m} (z_j - m)``, joined in the same SUM all-reduce -- no extra collective. Both
outputs are differentiable in any combination (a policy-gradient term on ``logp`` plus an entropy
bonus): the backward is the loss ops' gradient pass with the coefficients of
:func:`vparallel_ce.stats.logprob_grad_coefs`, local to each shard.

Works with: any TP degree with uneven and empty shards, DTensor logits ``Shard(-1)`` / weight
``Shard(0)``, sequence parallelism (the outputs are this rank's tokens; ``weight.grad`` sums over
the whole group's tokens), ``torch.autocast`` for the linear op, V of any size (no multiple-of-128
assumption), logits of any magnitude (statistics relative to the running max, which starts at -inf).
"""

from __future__ import annotations

import itertools

import torch

from . import compiled
from .second_order import first_order_only
from .autocast import autocast_off
from .call import Call, linear_call, logits_call, settles_check
from .options import Options
from .cross_entropy import logits_gradient, logits_statistics
from .chunk_walk import Grads, KeptLogits, Schedule, cat_parts
from .gemm import matmul_inputs
from .policy import ChunkPolicy
from .sampling_masks import SamplingMasks
from .sampling_set import check_support, check_support_values, linear_set_logprobs, set_chunks, set_logprobs
from .stats import ChunkStats, GradCoefs, TokenStats, compute_dtype, logprob_grad_coefs, whole_vocab

__all__ = ["token_logprobs", "linear_token_logprobs"]


def token_logprobs(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    group=None,
    vocab_size: int | None = None,
    temperature: float = 1.0,
    ignore_index: int = -100,
    with_entropy: bool = False,
    chunks: int | str = "auto",
    policy: ChunkPolicy | None = None,
    check: bool = True,
    batch_invariant: bool = False,
    support: torch.Tensor | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
):
    r"""``log_softmax(logits / temperature)[target]`` per token, from logits sharded along the vocab.

    Args:
        logits: ``[..., V_local]``, this rank's ``torch.chunk`` slice of the full logits, or a
            DTensor ``Shard(-1)`` (as in :func:`vparallel_ce.cross_entropy`).
        target: ``[...]`` global ids, the same on every rank; ``ignore_index`` marks tokens without
            a value (their outputs and gradients are 0).
        temperature: ``T > 0``; the distribution is ``softmax(logits / T)``.
        with_entropy: also return the entropy of that distribution per token.
        group, vocab_size, chunks, policy, check, batch_invariant: as in :func:`vparallel_ce.cross_entropy`
            (``docs/rl.md``, "Batch invariance").
        support: ``[..., K]`` int64 GLOBAL vocab ids per token, padded with ``-1``: the rollout's
            sampling set (a row of ``-1``: the whole vocabulary). The log-probs and entropy are then
            over the set, ``z_t - logsumexp_{j in S} z_j`` (``docs/rl.md``, "Log-probs over the
            sampling set"); the target must be in its row's set. With ``batch_invariant`` over the
            whole shard's logits masked to the set (the full-vocabulary op's cost).
        top_k, top_p, min_p: rebuild the set from the logits as vLLM's sampler masks them (at
            ``temperature``; ties at the boundary kept, :mod:`vparallel_ce.sampling_masks`), for
            engines that send no set. Not with ``support`` or ``batch_invariant`` (``NotImplementedError``).

    Returns:
        ``logprobs`` of ``target``'s shape, fp32 (fp64 for fp64 logits); with ``with_entropy`` the
        pair ``(logprobs, entropy)``. Equal to ``-cross_entropy(logits / T, target, reduction="none")``.
    """
    options = Options(reduction="none", ignore_index=ignore_index, temperature=temperature, with_entropy=with_entropy,
                      chunks=chunks, policy=policy, vocab_size=vocab_size, check=check, batch_invariant=batch_invariant,
                      top_k=top_k, top_p=top_p, min_p=min_p)
    if support is not None or options.masks:
        _refuse_compiled()
        masks = SamplingMasks(top_k, top_p, min_p)
        call, inp = logits_call(logits, target, op="token_logprobs", group=group, options=options, memo=None,
                                support=support, more_checks=lambda _: check_support(support, target, masks,
                                                                                     batch_invariant))
        flat = _checked_support(support, inp.target, call)
        logp, entropy = set_logprobs(inp.x, inp.target, flat, call, options,
                                     set_chunks(call, 0 if flat is None else flat.shape[-1], 0, chunks))
        shape = inp.shape
    elif torch.compiler.is_compiling():  # one custom op in the graph (vparallel_ce.compiled)
        (logp, entropy), shape = compiled.apply("token_logprobs", (logits, target), group, options)
    else:
        call, inp = logits_call(logits, target, op="token_logprobs", group=group, options=options)
        (logp, entropy), shape = _TokenLogprobs.apply(inp.x, inp.target, call), inp.shape
    logp = logp.reshape(shape)
    return (logp, entropy.reshape(shape)) if with_entropy else logp


def linear_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    group=None,
    sequence_parallel: bool = False,
    vocab_size: int | None = None,
    temperature: float = 1.0,
    ignore_index: int = -100,
    with_entropy: bool = False,
    chunks: int | str = "auto",
    policy: ChunkPolicy | None = None,
    check: bool = True,
    check_replicated: bool = True,
    logits_dtype: torch.dtype | None = None,
    batch_invariant: bool = False,
    support: torch.Tensor | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
):
    r""":func:`token_logprobs` of ``hidden @ weight.T + bias`` without materialising the
    ``[N, V_local]`` logits: the statistics pass of :func:`vparallel_ce.linear_cross_entropy` in
    forward, its gradient pass (recomputing the logits) in backward.

    Args:
        hidden, weight, bias, group, sequence_parallel, vocab_size: as in
            :func:`vparallel_ce.linear_cross_entropy`. With ``sequence_parallel`` the outputs are
            this rank's tokens (``target`` is split like ``hidden``).
        temperature, ignore_index, with_entropy, check: as in :func:`token_logprobs`.
        chunks: token chunks (an int) or ``"auto"`` (the policy, which may walk vocab blocks).
        policy, check_replicated: as in :func:`vparallel_ce.linear_cross_entropy`.
        logits_dtype: ``torch.float32``: the log-probs, entropy and their gradients are made from
            the lm_head GEMM's fp32 result instead of logits rounded to bf16/fp16 -- what agreement
            with an inference engine's fp32-logit log-probs needs (``docs/rl.md``, "Precision of the
            logits"); ``None`` (default): logits in the matmul dtype. As in
            :func:`vparallel_ce.linear_cross_entropy`.
        batch_invariant: as in :func:`vparallel_ce.linear_cross_entropy`.
        support, top_k, top_p, min_p: as in :func:`token_logprobs` (``support`` split like
            ``target`` with ``sequence_parallel``). With ``support`` only the kept ids' logits are
            made where that is cheaper (their weight rows gathered, ``O(N K H)``;
            :mod:`vparallel_ce.sampling_set`).

    Returns:
        As :func:`token_logprobs`: fp32 (fp64 for fp64 inputs) per-token values of ``target``'s
        shape. Gradients: ``weight.grad``/``bias.grad`` this shard's, ``hidden.grad`` the full one
        (this rank's rows with ``sequence_parallel``), each in its input's dtype.
    """
    options = Options(reduction="none", ignore_index=ignore_index, temperature=temperature, with_entropy=with_entropy,
                      chunks=chunks, policy=policy, vocab_size=vocab_size, sequence_parallel=sequence_parallel,
                      check=check, check_replicated=check_replicated, logits_dtype=logits_dtype,
                      batch_invariant=batch_invariant, top_k=top_k, top_p=top_p, min_p=min_p)
    if support is not None or options.masks:
        _refuse_compiled()
        masks = SamplingMasks(top_k, top_p, min_p)
        call, inp = linear_call(hidden, weight, target, bias, op="linear_token_logprobs", group=group,
                                options=options, memo=None, support=support,
                                more_checks=lambda *_: check_support(support, target, masks, batch_invariant))
        flat = _checked_support(support, inp.target, call)
        logp, entropy = linear_set_logprobs(inp.h, inp.w, inp.b, inp.target, flat, call, options,
                                            set_chunks(call, 0 if flat is None else flat.shape[-1], inp.w.shape[-1],
                                                       chunks, gathered=call.ops(inp.w).gathered))
        shape = inp.shape
    elif torch.compiler.is_compiling():  # one custom op in the graph (vparallel_ce.compiled)
        (logp, entropy), shape = compiled.apply("linear_token_logprobs", (hidden, weight, target, bias), group,
                                                options)
    else:
        call, inp = linear_call(hidden, weight, target, bias, op="linear_token_logprobs", group=group,
                                options=options, compact=True)
        (logp, entropy), shape = _LinearTokenLogprobs.apply(inp.h, inp.w, inp.b, inp.target, call), inp.shape
        # (compacted: the kept rows' values back in the caller's order, 0 on the ignored rows)
        logp, entropy = inp.place(logp), inp.place(entropy)
    logp = logp.reshape(shape)
    return (logp, entropy.reshape(shape)) if with_entropy else logp


def _refuse_compiled() -> None:
    if torch.compiler.is_compiling():
        raise NotImplementedError("support= and top_k/top_p/min_p are not supported inside torch.compile: call the "
                                  "log-prob op outside the compiled region")


def _checked_support(support, target: torch.Tensor, call: Call):
    """The set as ``[N, K]`` rows (None with the masks), its values checked with ``check``."""
    if support is None:
        call.settle()
        return None
    flat = support.reshape(target.numel(), support.shape[-1])
    call.settle()  # the world-1 target range check: the set path reads the host anyway
    if call.check:
        check_support_values(flat, target, call)
    return flat


def _outputs(st, valid):
    """Per-token ``(logp, entropy)`` from the global statistics; 0 on ignored tokens."""
    zero = torch.zeros_like(st.log_s)
    logp = torch.where(valid, (st.target - st.max) - st.log_s, zero)  # relative to the max: exact
    entropy = torch.where(valid, st.entropy, zero) if st.entropy is not None else zero
    return logp, entropy


def _joined(chunks: list, joined: bool):
    """The chunks' statistics as one :class:`~vparallel_ce.stats.TokenStats` of the call's rows:
    theirs concatenated (``joined``), or their local ``ChunkStats`` (a rank holding the whole vocab)
    concatenated and joined once by :func:`~vparallel_ce.stats.whole_vocab`."""
    fields = [None if f[0] is None else cat_parts(list(f)) for f in zip(*chunks)]
    return TokenStats(*fields) if joined else whole_vocab(ChunkStats(*fields))


def _chunk_coefs(coefs: GradCoefs, sl: slice) -> GradCoefs:
    return GradCoefs(*(None if k is None else k[sl] for k in coefs))


def _coefs(g_logp, g_entropy, valid, entropy, log_s: torch.Tensor, call: Call):
    """Gradient coefficients of the chunk's rows for the upstream gradients (None = unused output)."""
    v = valid.to(log_s.dtype)
    g_lp = torch.zeros_like(log_s) if g_logp is None else g_logp.to(log_s.dtype) * v
    g_h = None if g_entropy is None or not call.spec.entropy else g_entropy.to(log_s.dtype) * v
    return logprob_grad_coefs(g_lp, g_h, entropy, log_s, valid)


class _TokenLogprobs(torch.autograd.Function):
    """Forward: the statistics pass of ``cross_entropy``. Backward: its local gradient pass."""

    @staticmethod
    def forward(ctx, x, target, call: Call):
        with autocast_off(x.device.type):
            st, targets = logits_statistics(x, target, call)
            logp, entropy = _outputs(st, targets[2])
            ctx.save_for_backward(x, st.max, st.log_s, entropy)
            ctx.call, ctx.targets = call, targets  # the shard's target maps, for the backward
            ctx.set_materialize_grads(False)
            return call.settle_forward(ctx, logp, entropy)

    @staticmethod
    @first_order_only("token_logprobs")
    @settles_check
    def backward(ctx, g_logp, g_entropy):
        x, m, log_s, entropy = ctx.saved_tensors
        call = ctx.call
        if g_logp is None and g_entropy is None:  # local: no collective in this backward
            return None, None, None
        with autocast_off(x.device.type):
            coefs = _coefs(g_logp, g_entropy, ctx.targets[2], entropy, log_s, call)
            return logits_gradient(x, ctx.targets, m, coefs, call), None, None


class _LinearTokenLogprobs(torch.autograd.Function):
    """Forward: the statistics step of the call's :class:`~vparallel_ce.chunk_walk.Schedule`;
    backward: its gradient step (logits recomputed)."""

    @staticmethod
    def forward(ctx, h, w, b, t, call: Call):
        with autocast_off(h.device.type):
            hm, wm, bm = matmul_inputs(call, h, w, b)
            ops = call.ops(wm)
            need = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], b is not None and ctx.needs_input_grad[2])
            keep = Schedule.keeps_for_backward(call, need)
            sched = Schedule.of(call, keep_logits=keep)
            rows = sched.rows(call)
            # the outputs made once for the call's rows from its chunks' statistics (the same
            # elementwise steps as chunk by chunk: a few launches per call, not per chunk)
            chunks, valid, ctx.kept = [], [], KeptLogits()
            for c, h_c, t_c, targets in sched.walk(call, rows, hm, t, Schedule.call_targets(call, rows, t)):
                st, kept = sched.statistics(call, ops, h_c, wm, bm, targets, join=call.layout.sharded)
                if keep:
                    ctx.kept.add(kept)
                chunks.append(st)
                valid.append(targets()[2])
            st = _joined(chunks, call.layout.sharded)
            logp, entropy = _outputs(st, cat_parts(valid))
            ctx.save_for_backward(h, w, b, t, torch.stack([st.max, st.log_s]), entropy)
            ctx.call = call
            ctx.set_materialize_grads(False)
            if call.sequence_parallel:  # this rank's rows of each chunk's gathered ones
                ends = list(itertools.accumulate(v.shape[0] for v in valid))
                logp, entropy = (torch.cat([rows.own(c, x[end - v.shape[0] : end])
                                            for c, (v, end) in enumerate(zip(valid, ends))]) for x in (logp, entropy))
            return call.settle_forward(ctx, logp, entropy)

    @staticmethod
    @first_order_only("linear_token_logprobs")
    @settles_check
    def backward(ctx, g_logp, g_entropy):
        h, w, b, t, shift, entropy = ctx.saved_tensors
        call = ctx.call
        need = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], b is not None and ctx.needs_input_grad[2])
        if not any(need):
            return None, None, None, None, None
        if call.layout.sharded:
            # this backward runs collectives (dh over the group, rows with SP): every rank takes the
            # same path, whichever outputs its own loss used
            g_logp = torch.zeros_like(entropy[: t.numel()]) if g_logp is None else g_logp
            if call.spec.entropy and g_entropy is None:
                g_entropy = torch.zeros_like(g_logp)
        elif g_logp is None and g_entropy is None:
            return None, None, None, None, None
        with autocast_off(h.device.type):
            hm, wm, bm = matmul_inputs(call, h, w, b)
            ops = call.ops(wm)
            sched = Schedule.of(call, keep_logits=False)
            rows = sched.rows(call)
            grads = Grads(h, w, b, need, acc_dtype=compute_dtype(wm.dtype), rows=rows, schedule=sched)
            kept_chunks = ctx.kept.take()
            known = Schedule.call_targets(call, rows, t)
            coefs_all = None
            if known is not None:  # this rank's rows are the chunks' rows: the coefficients made once
                valid = cat_parts([k[3] for k in known])
                coefs_all = _coefs(None if g_logp is None else g_logp.reshape(-1),
                                   None if g_entropy is None else g_entropy.reshape(-1), valid, entropy, shift[1],
                                   call)
            at = 0
            for c, h_c, t_c, targets in sched.walk(call, rows, hm, t, known):
                local_t, owned, valid = targets()
                sl = slice(at, at + t_c.shape[0])
                at += t_c.shape[0]
                if coefs_all is not None:
                    coefs = _chunk_coefs(coefs_all, sl) if len(rows) > 1 else coefs_all
                else:
                    g_lp = None if g_logp is None else rows.gather(c, g_logp.reshape(-1))
                    g_h = None if g_entropy is None else rows.gather(c, g_entropy.reshape(-1))
                    coefs = _coefs(g_lp, g_h, valid, entropy[sl], shift[1, sl], call)
                m_c = shift[0, sl]
                sched.gradients(call, ops, rows, c, h_c, wm, bm, local_t, owned, m_c, coefs,
                                kept_chunks[c] if kept_chunks else [], grads)
            return grads.finish(rows) + (None, None)


compiled.register("token_logprobs", _TokenLogprobs, compiled.front_door(logits_call, lambda inp: (inp.x, inp.target)),
                  grad_of=(0, None, None), target=1, outputs=2)
compiled.register("linear_token_logprobs", _LinearTokenLogprobs,
                  compiled.front_door(linear_call, lambda inp: (inp.h, inp.w, inp.b, inp.target)),
                  grad_of=(0, 1, 3, None, None), target=2, optional={3}, outputs=2)
