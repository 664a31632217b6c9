r"""The global top-``k`` ids and log-probs of a vocab-sharded softmax: ``topk_logprobs`` (logits) and
``linear_topk_logprobs`` (hidden states + lm_head shard), e.g. to write a :class:`~vparallel_ce.TopKTeacher`
cache or an on-policy teacher's record in one call.

Per token, with ``z = logits / T`` over the GLOBAL vocab: ``ids`` the ``k`` largest entries of
``z`` under :mod:`vparallel_ce.vocab_topk`'s tie rule (value descending, then id ascending),
``logprobs = z_ids - logsumexp_j z_j`` and ``rest_logprob = log sum_{j not in ids} p_j`` (the
mass the record leaves out, ``-inf`` when none; exact, not ``log(1 - sum)``).

Per token chunk -- what crosses ranks: one all-gather of each rank's local top-``k`` (value, id)
pairs, ``[c, world k]``, whose first value is the global max ``m``; then one all-reduce SUM of
``[S, S_rest]`` (``sum e^{z - m}`` over the shard, and over its entries not among the ids). The
linear op makes one chunk's ``[c, V_loc]`` logits at a time. No gradient: a record, not a loss.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import comm
from .call import linear_call, logits_call
from .gemm import logits as lm_logits, matmul_inputs
from .options import Options
from .policy import ChunkPolicy
from .sampling_set import CHUNK_BYTES
from .stats import finite_shift, scaled_logits
from .chunk_walk import Rows
from .topk import TailMode, TopKTeacher
from .vocab_topk import global_topk

__all__ = ["TopKLogprobs", "topk_logprobs", "linear_topk_logprobs"]


class TopKLogprobs(NamedTuple):
    """``ids [..., k]`` (int64 GLOBAL ids; ``-1`` beyond the vocab), ``logprobs [..., k]`` and
    ``rest_logprob [...]`` (fp32, fp64 for fp64 inputs)."""

    ids: torch.Tensor
    logprobs: torch.Tensor
    rest_logprob: torch.Tensor

    def teacher(self, *, temperature: float, tail: TailMode | str = TailMode.BUCKET) -> TopKTeacher:
        """The record as a :class:`~vparallel_ce.TopKTeacher` taken at ``temperature`` (the one given
        to the op). Slots beyond the vocabulary (``k > V``) are not a valid record."""
        return TopKTeacher(self.ids, self.logprobs, tail=tail, temperature=float(temperature))


def topk_logprobs(logits: torch.Tensor, k: int, *, group=None, temperature: float = 1.0, vocab_size: int | None = None,
                  chunks: int | str = "auto", check: bool = True) -> TopKLogprobs:
    r"""The top-``k`` ids of ``softmax(logits / temperature)`` over the GLOBAL vocab and their
    log-probs, from logits sharded along the vocab.

    Args:
        logits: ``[..., V_local]``, this rank's ``torch.chunk`` slice (or a DTensor ``Shard(-1)``).
        k: ids per token, ``>= 1`` (the same on every rank).
        group, vocab_size, check: as in :func:`vparallel_ce.cross_entropy`.
        temperature: ``T > 0``.
        chunks: token chunks (an int), or ``"auto"``: one chunk's fp32 working set about 256 MiB.

    Returns:
        :class:`TopKLogprobs` ``(ids, logprobs, rest_logprob)``, the same on every rank; equal to
        ``torch.sort(log_softmax(full / T), descending=True, stable=True)``'s first ``k`` of the
        gathered fp32 logits. No gradient flows.
    """
    options = Options(reduction="none", temperature=temperature, chunks=chunks, vocab_size=vocab_size, check=check,
                      top_k=k)
    with torch.no_grad():
        stand_in = torch.zeros(logits.shape[:-1], dtype=torch.int64, device=logits.device)
        call, inp = logits_call(logits, stand_in, op="topk_logprobs", group=group, options=options, memo=None,
                                target_given=False)
        call.settle()
        rows = Rows(call, _chunks(call, inp.x.shape[0], chunks))
        parts = [_record(call, inp.x[sl], k) for sl in rows.local]
        return _shaped(parts, inp.shape, k)


def linear_topk_logprobs(hidden: torch.Tensor, weight: torch.Tensor, k: int, bias: torch.Tensor | None = None, *,
                         group=None, temperature: float = 1.0, vocab_size: int | None = None,
                         chunks: int | str = "auto", check: bool = True, check_replicated: bool = True,
                         logits_dtype: torch.dtype | None = None) -> TopKLogprobs:
    r""":func:`topk_logprobs` of ``hidden @ weight.T + bias`` (``hidden [..., H]`` replicated over the
    group, ``weight [V_local, H]`` this rank's lm_head shard), one token chunk's logits at a time.
    ``logits_dtype=torch.float32``: from the GEMM's fp32 result (as in
    :func:`vparallel_ce.linear_token_logprobs`). Other arguments as in :func:`topk_logprobs`."""
    options = Options(reduction="none", temperature=temperature, chunks=chunks, vocab_size=vocab_size, check=check,
                      check_replicated=check_replicated, logits_dtype=logits_dtype, top_k=k)
    with torch.no_grad():
        stand_in = torch.zeros(hidden.shape[:-1], dtype=torch.int64, device=hidden.device)
        call, inp = linear_call(hidden, weight, stand_in, bias, op="linear_topk_logprobs", group=group,
                                options=options, memo=None, target_given=False)
        call.settle()
        hm, wm, bm = matmul_inputs(call, inp.h, inp.w, inp.b)
        rows = Rows(call, _chunks(call, inp.h.shape[0], chunks))
        parts = [_record(call, lm_logits(call, hm[sl], wm, bm), k) for sl in rows.local]
        return _shaped(parts, inp.shape, k)


def _chunks(call, n: int, chunks) -> int:
    if chunks != "auto":
        return int(chunks)
    width = -(-call.layout.vocab_size // call.layout.world)
    return max(1, min(n, -(-n * 12 * max(width, 1) // CHUNK_BYTES)))


def _record(call, x: torch.Tensor, k: int) -> TopKLogprobs:
    """One chunk's record from its ``[c, V_loc]`` logits (one all-gather, one all-reduce SUM)."""
    lay = call.layout
    z = scaled_logits(x, call.spec)
    top = global_topk(z, k, lay)
    m = finite_shift(top.values[:, 0]) if k else torch.zeros(z.shape[0], dtype=z.dtype, device=z.device)
    e = torch.exp(z - m.unsqueeze(-1))
    local = top.ids - lay.offset
    mine = (top.ids >= 0) & (local >= 0) & (local < lay.local_size)
    hits = torch.zeros(z.shape, dtype=torch.int32, device=z.device)
    if z.shape[1]:  # (an add: the slots that are not this shard's write 0 at a clamped column)
        hits.scatter_add_(1, local.clamp(0, lay.local_size - 1), mine.to(torch.int32))
    in_top = hits > 0
    sums = torch.stack([e.sum(-1), torch.where(in_top, 0.0, e).sum(-1)])
    sums = comm.all_reduce_sum_(sums, lay.group)
    log_s = torch.log(sums[0])
    return TopKLogprobs(top.ids, (top.values - m.unsqueeze(-1)) - log_s.unsqueeze(-1), torch.log(sums[1]) - log_s)


def _shaped(parts: list, shape: torch.Size, k: int) -> TopKLogprobs:
    ids, logprobs, rest = (torch.cat(p) for p in zip(*parts))
    return TopKLogprobs(ids.reshape(*shape, k), logprobs.reshape(*shape, k), rest.reshape(shape))
