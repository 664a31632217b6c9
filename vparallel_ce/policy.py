"""The chunk policy: how many chunks, which schedule, and whether gradients are made in forward.

Pure functions of their arguments -- no device queries, no clocks, no RNG -- so every rank of a
group computes the same answer (ranks that disagree on the chunk count would deadlock in the
per-chunk collectives).

Memory model (bytes, per rank, ``V_loc = ceil(V / tp)``):

* one chunk's fp32 logits: ``tokens_per_chunk * V_loc * 4``; the budget bounds this quantity;
* the token-chunked linear schedule adds an fp32 dW accumulator: ``V_loc * H * 4``;
* with gradients made in forward, the op keeps ``dW`` (+ ``dh``) alive from forward to backward,
  once per microbatch in flight: GPipe holds every microbatch's forward before any backward, 1F1B
  about one. Under GPipe the policy therefore prefers recompute-in-backward.

Speed model: every chunk costs two small all-reduces and a few kernel launches, and chunks below
``min_chunk_tokens`` rows make the lm_head matmuls inefficient; so with the default budget the count
is capped at ``ceil(tokens / min_chunk_tokens)``. ``docs/policy.md`` has the measurements behind the
defaults.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

__all__ = ["ChunkPolicy", "Plan", "choose_chunks", "choose_plan", "explain", "DEFAULT_POLICY"]

GiB = 1024**3


@dataclass(frozen=True)
class Plan:
    """What an op will do: ``schedule`` is ``"token"`` (chunks of tokens) or ``"vocab"`` (blocks of
    the local vocab, linear op only); ``chunks`` counts the token chunks or vocab blocks."""

    schedule: str
    chunks: int
    grad_in_forward: bool


@dataclass(frozen=True)
class ChunkPolicy:
    """The inputs of the chunk decision beyond the shapes.

    Attributes:
        budget_bytes: bound on one chunk's fp32 logits (``tokens/chunk * V_loc * 4``); None = the
            default (``DEFAULT_BUDGET_BYTES``, soft: the ``min_chunk_tokens`` floor applies).
        min_chunk_tokens: with the default budget, chunks are never made smaller than this.
        block_columns: the vocab schedule's preferred block width: its time is flat while blocks
            stay this wide, so it uses at least ``ceil(V_loc / block_columns)`` blocks.
        microbatches_in_flight: forward passes whose saved state is alive at once on this stage
            (1 without PP or under 1F1B; the microbatch count under GPipe).
        grad_in_forward: force (True/False) or let the memory model decide (None) whether
            mean/sum losses compute their gradients during forward.
    """

    budget_bytes: int | None = None
    min_chunk_tokens: int = 1024
    block_columns: int = 8192
    microbatches_in_flight: int = 1
    grad_in_forward: bool | None = None

    def chunks(self, num_tokens: int, vocab_size: int, tp_degree: int = 1) -> int:
        """Token chunks for ``num_tokens`` tokens of one microbatch on this rank."""
        if num_tokens <= 0:
            return 1
        row = local_vocab(vocab_size, tp_degree) * 4
        budget = DEFAULT_BUDGET_BYTES if self.budget_bytes is None else int(self.budget_bytes)
        if row == 0:
            return 1
        if budget < row:  # not even one token's row fits: one token per chunk
            return num_tokens
        k = math.ceil(num_tokens / (budget // row))  # whole rows per chunk, so the bound holds
        if self.budget_bytes is None:
            k = min(k, math.ceil(num_tokens / self.min_chunk_tokens))
        return max(1, min(k, num_tokens))

    def plan(self, num_tokens: int, vocab_size: int, tp_degree: int = 1, *, hidden_size: int,
             reduction: str = "mean", schedule: str = "auto") -> Plan:
        """The full plan of ``linear_cross_entropy`` for one call."""
        v_loc = local_vocab(vocab_size, tp_degree)
        budget = DEFAULT_BUDGET_BYTES if self.budget_bytes is None else int(self.budget_bytes)
        k = min(self.chunks(num_tokens, vocab_size, tp_degree), max(v_loc, 1))
        if schedule == "auto":
            # one chunk: 3 matmuls, no accumulator (dW comes out of one matmul) -- the fastest point.
            # Several: the token schedule's fp32 dW accumulator (4 V_loc H bytes) does not shrink
            # with more chunks; past the budget walk the vocab instead (4 matmuls, memory at the floor)
            accumulator = v_loc * hidden_size * 4
            schedule = "token" if k == 1 or accumulator <= budget else "vocab"
        if schedule == "vocab":
            # blocks of the local vocab over all tokens: the budget bounds one block's fp32 logits,
            # and blocks of ~block_columns cost no time over one block (docs/policy.md)
            fp32 = num_tokens * v_loc * 4
            k = max(math.ceil(fp32 / max(budget, 1)), math.ceil(v_loc / self.block_columns), 1)
            k = min(k, max(v_loc, 1))
        gif = self.grad_in_forward
        if gif is None:
            # grads made in forward stay alive until backward: dW (a full lm_head shard) and dh per
            # microbatch in flight. Under GPipe that is M shards at once, so recompute instead.
            gif = schedule == "token" and self.microbatches_in_flight <= 1
        return Plan(schedule, k, bool(gif) and reduction != "none")


def local_vocab(vocab_size: int, tp_degree: int) -> int:
    return math.ceil(vocab_size / max(1, tp_degree))


# Default bound on one chunk's fp32 logits. See docs/policy.md for the sweep behind it.
DEFAULT_BUDGET_BYTES = 1 * GiB
DEFAULT_POLICY = ChunkPolicy()


def choose_chunks(num_tokens: int, vocab_size: int, tp_degree: int = 1, *, dtype: torch.dtype = torch.bfloat16,
                  budget_bytes: int | None = None) -> int:
    """Chunk count for ``chunks="auto"``: the fewest chunks whose fp32 logits fit the budget.

    Args:
        num_tokens: tokens in one microbatch on this rank.
        vocab_size: the GLOBAL vocab size (the local shard is ``ceil(V / tp_degree)``).
        dtype: the logits' dtype (kept for the signature; fp32 statistics cost the same for all).
        budget_bytes: hard bound on ``tokens/chunk * ceil(V/tp) * 4`` whenever one row fits.

    Returns an int in ``[1, num_tokens]``: non-increasing in ``tp_degree``, non-decreasing in
    ``num_tokens`` and ``vocab_size``, 1 when the whole microbatch fits.
    """
    del dtype
    return replace(DEFAULT_POLICY, budget_bytes=budget_bytes).chunks(num_tokens, vocab_size, tp_degree)


def choose_plan(num_tokens: int, vocab_size: int, tp_degree: int = 1, *, hidden_size: int,
                reduction: str = "mean", policy: ChunkPolicy | None = None, schedule: str = "auto") -> Plan:
    """:class:`Plan` for ``linear_cross_entropy`` (schedule, chunk count, grads in forward)."""
    return (policy or DEFAULT_POLICY).plan(num_tokens, vocab_size, tp_degree, hidden_size=hidden_size,
                                           reduction=reduction, schedule=schedule)


def explain(num_tokens: int, vocab_size: int, tp_degree: int = 1, *, hidden_size: int | None = None,
            policy: ChunkPolicy | None = None) -> str:
    """One paragraph saying what the policy picks and why."""
    policy = policy or DEFAULT_POLICY
    v_loc = local_vocab(vocab_size, tp_degree)
    budget = DEFAULT_BUDGET_BYTES if policy.budget_bytes is None else policy.budget_bytes
    full = num_tokens * v_loc * 4
    k = policy.chunks(num_tokens, vocab_size, tp_degree)
    text = (
        f"{num_tokens} tokens x V_loc={v_loc} (V={vocab_size} over tp={tp_degree}) make {full / GiB:.2f} GiB of "
        f"fp32 logits against a {'default ' if policy.budget_bytes is None else ''}budget of {budget / GiB:.2f} GiB: "
    )
    if k == 1:
        text += "they fit, so one chunk (no chunking overhead)."
    else:
        per = math.ceil(num_tokens / k)
        text += f"{k} chunks of <= {per} tokens ({per * v_loc * 4 / GiB:.2f} GiB each)"
        if policy.budget_bytes is None and k == math.ceil(num_tokens / policy.min_chunk_tokens):
            text += f", capped so no chunk is smaller than {policy.min_chunk_tokens} tokens"
        text += "."
    if hidden_size is not None:
        p = policy.plan(num_tokens, vocab_size, tp_degree, hidden_size=hidden_size)
        text += (
            f" linear_cross_entropy: {p.schedule}-chunked schedule with {p.chunks} "
            f"{'token chunks' if p.schedule == 'token' else 'vocab blocks'}, gradients "
            f"{'made in forward (3 matmuls)' if p.grad_in_forward else 'recomputed in backward'}; "
            f"{policy.microbatches_in_flight} microbatch(es) in flight."
        )
    return text
