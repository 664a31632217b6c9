"""``cross_entropy``: vocab-parallel cross-entropy over logits sharded along the vocabulary.

Forward per token chunk: local statistics of the chunk (one read of the logits), one all-reduce MAX
and one all-reduce SUM of four floats per token (:mod:`vparallel_ce.stats`). The backward recomputes
each chunk's softmax from the saved input logits and the saved per-token ``(m, log S)`` and needs no
collective. Extra memory: one chunk's fp32 working set in forward; the gradient buffer (logits'
dtype) plus one chunk's fp32 working set in backward. The caller's logits are never modified.
Works with: plain or DTensor ``Shard(-1)`` logits, any TP degree (uneven and empty shards),
``torch.autocast`` (the statistics are fp32 whatever the region's dtype), ``torch.compile``.
"""

from __future__ import annotations

import torch

from . import compiled
from .second_order import first_order_only
from .autocast import autocast_off
from .call import Call, logits_call, settles_check
from .options import Options
from .policy import ChunkPolicy
from .stats import (
    GradCoefs, TokenStats, combine, local_targets, scale_coefs, token_loss, token_slices, unit_loss_coefs,
)

__all__ = ["cross_entropy", "logits_statistics", "logits_gradient"]


def cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    group=None,
    vocab_size: int | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    num_valid_tokens: int | torch.Tensor | None = None,
    z_loss: float = 0.0,
    softcap: float | None = None,
    chunks: int | str = "auto",
    policy: ChunkPolicy | None = None,
    check: bool = True,
    batch_invariant: bool = False,
) -> torch.Tensor:
    r"""Cross-entropy of logits whose vocab dim is sharded over ``group``.

    Args:
        logits: ``[..., V_local]`` float tensor, this rank's ``torch.chunk(full, world, -1)[rank]``
            slice of the full logits; or a DTensor sharded on its last dim (``Shard(-1)``) over one
            mesh dim and replicated over the others, whose mesh gives the group.
        target: ``[...]`` integer ids in the GLOBAL vocab ``[0, V)``, the same on every rank.
        group: ProcessGroup or 1-D DeviceMesh the vocab is sharded over; None = unsharded.
        vocab_size: the global ``V``, optional (checked against the shard sizes when given).
        ignore_index, reduction, label_smoothing: as in ``F.cross_entropy`` (label smoothing uses
            the GLOBAL vocab size; ``mean`` is over non-ignored tokens).
        num_valid_tokens: the divisor of ``mean`` instead of this call's valid-token count: an int or
            a one-element integer tensor (no host read), the same on every rank of the group. With
            the valid tokens of a whole gradient-accumulation step (``vparallel_ce.count_valid_tokens``
            over the data-parallel group), the step's gradients equal one big batch's -- HF's
            ``num_items_in_batch``, torchtitan's ``global_valid_tokens`` (docs/accumulation.md).
        z_loss: adds ``z_loss * logsumexp(logits)**2`` per non-ignored token (PaLM).
        softcap: if set, ``logits -> softcap * tanh(logits / softcap)`` first (Gemma-2).
        chunks: number of token chunks, or ``"auto"`` (:func:`vparallel_ce.policy.choose_chunks`).
        policy: a :class:`vparallel_ce.policy.ChunkPolicy` for ``chunks="auto"`` (its budget); the
            same on every rank of the group (checked).
        check: exchange shard sizes/options across the group and check that every valid target id
            lies in ``[0, V)``, raising on every rank (one host sync per call). ``False`` skips both;
            then ``vocab_size`` (or a DTensor) must tell ``V``, and an out-of-range id gives a
            silently wrong loss.
        batch_invariant: each token's loss (``reduction="none"``) and its row of the gradient are
            bitwise the same whatever the other tokens of the call, their number and ``chunks``:
            one program per row on a GPU (bf16/fp16), else fixed 128-row tiles with vocab sums in a
            fixed order, and the ranks' partials added in rank order (``docs/rl.md``, "Batch
            invariance"; :mod:`vparallel_ce.invariant`). The same on every rank (checked).

    Returns:
        fp32 loss (fp64 for fp64 logits), a plain tensor even for DTensor input: a scalar for
        ``mean``/``sum``, ``target``'s shape for ``none``. Equals ``F.cross_entropy`` (+ z-loss) on the
        gathered, soft-capped fp32 logits; the gradient of each rank's shard is that shard's slice
        of the gradient of that one loss, in the logits' dtype.
    """
    options = Options(reduction=reduction, ignore_index=ignore_index, label_smoothing=label_smoothing,
                      num_valid_tokens=num_valid_tokens, z_loss=z_loss, softcap=softcap, chunks=chunks, policy=policy,
                      vocab_size=vocab_size, check=check, batch_invariant=batch_invariant)
    if torch.compiler.is_compiling():  # one custom op in the graph (vparallel_ce.compiled)
        out, shape = compiled.apply("cross_entropy", (logits, target), group, options)
    else:
        call, inp = logits_call(logits, target, op="cross_entropy", group=group, options=options)
        out, shape = _CrossEntropy.apply(inp.x, inp.target, call), inp.shape
    return out.reshape(shape) if reduction == "none" else out


def logits_statistics(x: torch.Tensor, target: torch.Tensor, call: Call) -> tuple[TokenStats, tuple]:
    """The statistics pass over ``[N, V_local]`` logits, chunk by chunk (one exchange per chunk):
    the global per-token statistics of all ``N`` tokens and the targets mapped to this shard,
    ``(local_t, owned, valid)`` (:func:`~vparallel_ce.stats.local_targets`; the backward's
    :func:`logits_gradient` takes them again rather than launching their kernels twice)."""
    lay, spec = call.layout, call.spec
    ops = call.ops(x)
    targets = local_targets(target, lay.offset, lay.local_size, spec.ignore_index, all_owned=call.all_owned)
    local_t, owned, _ = targets
    parts = [combine(ops.local_stats(x[sl], local_t[sl], owned[sl], spec), lay, rank_ordered=call.batch_invariant)
             for sl in token_slices(x.shape[0], call.plan.chunks, tile=call.tile)]
    st = TokenStats(*(None if f[0] is None else torch.cat(f) for f in zip(*parts)))
    return st, targets


def logits_gradient(x: torch.Tensor, targets: tuple, shift: torch.Tensor, coefs: GradCoefs,
                    call: Call) -> torch.Tensor:
    """The gradient pass: ``d obj / d x`` chunk by chunk for the per-token global max ``shift`` and
    coefficients ``coefs`` of all ``N`` tokens, in the logits' dtype; ``targets``: the forward's
    ``(local_t, owned, valid)``. Local, no collective."""
    ops = call.ops(x)
    local_t, owned, _ = targets
    dx = torch.empty_like(x)
    for sl in token_slices(x.shape[0], call.plan.chunks, tile=call.tile):
        part = GradCoefs(*(None if k is None else k[sl] for k in coefs))
        dx[sl] = ops.grad_logits(x[sl], local_t[sl], owned[sl], shift[sl], part, call.spec)
    return dx


class _CrossEntropy(torch.autograd.Function):
    """Thin autograd wrapper: forward = statistics per chunk; backward = local softmax gradient.
    Autocast is off inside: the math is explicit fp32 (fp64 for fp64 logits)."""

    @staticmethod
    def forward(ctx, x, target, call: Call):
        with autocast_off(x.device.type):
            st, targets = logits_statistics(x, target, call)
            valid = targets[2]
            n_valid = call.valid_count(target, valid)
            coefs = unit_loss_coefs(st, valid, n_valid, call.reduction, call.spec)
            ctx.save_for_backward(x)
            ctx.call, ctx.targets, ctx.shift, ctx.coefs = call, targets, st.max, coefs  # per-token vectors
            return call.loss_output(ctx, call.ops(x), token_loss(st, valid, call.spec), n_valid)

    @staticmethod
    @first_order_only("cross_entropy")
    @settles_check
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        with autocast_off(x.device.type):
            g = grad_out.reshape(-1) if ctx.call.reduction == "none" else grad_out
            dx = logits_gradient(x, ctx.targets, ctx.shift, scale_coefs(ctx.coefs, g), ctx.call)
        return dx, None, None


compiled.register("cross_entropy", _CrossEntropy, compiled.front_door(logits_call, lambda inp: (inp.x, inp.target)),
                  grad_of=(0, None, None), target=1)
