r"""A sparse teacher for distillation: the teacher's top-k ids and log-probabilities per token
instead of its logits, with the per-chunk math of the divergence against a student whose logits are
sharded along the vocab.

The teacher (:class:`TopKTeacher`) holds, per token, ``k`` distinct GLOBAL vocab ids ``i`` and
``l_i = log p_i``: the log-probabilities of the teacher distribution the divergence uses -- at the
distillation temperature already; the op does not rescale them, since re-tempering needs the
teacher's normaliser over the whole vocab, which a top-k record does not hold (at ``T = 1`` they
are what an inference server's or an offline cache's logprobs are, ``log_softmax(logits)``). The
ids and log-probs are the same on every rank. The student's ``q = softmax(s / T)`` is over the
GLOBAL vocab. The two distributions are compared over ``n`` classes, per :class:`TailMode`:

* ``BUCKET`` -- the ``k`` ids and one tail class holding the rest (``n = k + 1``)::

      p_i = e^{l_i},   p_tail = 1 - sum_i p_i = -expm1(logsumexp_i l_i)   (clamped at 0)
      q_i = softmax(s / T)_i,   q_tail = sum_{j not an id} q_j              (over the GLOBAL vocab)

  With ``k = V`` the tail class is empty and left out (no ``0 log 0``): the loss is the dense
  one's on ``teacher = log_softmax(t / T)``.
* ``RENORMALIZE`` -- both distributions renormalised over the ``k`` ids (``n = k``)::

      p_i = e^{l_i} / sum_k e^{l_k},   q_i = e^{s_i / T} / sum_k e^{s_k / T}

Then ``D`` is the divergence of :mod:`vparallel_ce.divergence` over the ``n`` classes, and the
token's loss ``T**2 D + hard_weight CE(s, target)`` (the hard term over the whole vocab, as there).

Forward, per token chunk -- what crosses ranks:

1. local: the shard's maxima of ``b = s / T`` over all its entries, over its entries that are not
   among the row's ids (``BUCKET`` only) and of ``s`` (``hard_weight > 0`` and ``T != 1``);
2. ``all_reduce_MAX`` of that ``[1..3, chunk]`` tensor -> ``m_b``, ``m_r``, ``m_h``;
3. local: ``S_b = sum_j e^{b_j - m_b}``, ``S_r = sum_{j not an id} e^{b_j - m_r}`` (``BUCKET``),
   the hard term's sums as in the dense op, and ``b_i`` at each of the ``k`` ids this rank owns
   (0 at the others: every id has one owner, so the sum is ``b_i`` exactly);
4. ``all_reduce_SUM`` of that ``[k + 1..4, chunk]`` tensor. Every rank then holds the student's
   logits at the ids and its log-mass off them (``log q_tail = m_r + log S_r - m_b - log S_b``),
   and the teacher's values are replicated: the divergence and its per-class gradient are local,
   for every kind (the JSD needs no second all-reduce here).

So a chunk costs one MAX of ``O(chunk)`` floats and one SUM of ``O(k chunk)``; no logits cross.

Backward, local: with ``g_c = q_c dD/dq_c`` (forward KL ``-p_c``, reverse KL
``q_c (log q_c - log p_c)``, JSD ``(1 - beta) q_c (log q_c - log m_c)``), a class's share of the
gradient is ``G_c = g_c - q_c sum_c' g_c'`` (from ``d q_c / d z_c' = q_c ([c = c'] - q_c')`` over
the class logits ``z``). An id's entry gets ``T G_i``; an entry off the ids gets its share of the
tail's, ``T G_tail e^{b_j - m_r} / S_r`` (``BUCKET``; 0 with ``RENORMALIZE``); plus the hard term's
``hard_weight (softmax(s)_j - [j = target])``. ``G`` (``[chunk, k]``) and ``G_tail`` are saved by
the forward. The teacher gets no gradient.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from . import comm
from .divergence import (
    Divergence, DistillSpec, _log_mixture, _maxima, _scaled, _weighted, finish_grad, hard_stats, hard_sums,
)
from .stats import compute_dtype, finite_shift

__all__ = ["TailMode", "TAIL_MODES", "TopKTeacher", "TopKStats", "topk_statistics", "topk_grad_student"]


class TailMode(str, enum.Enum):
    """What happens to the teacher's mass outside its top-k ids."""

    BUCKET = "bucket"  # one more class: the teacher's 1 - sum_k p_k against the student's mass off the ids
    RENORMALIZE = "renormalize"  # both distributions renormalised over the k ids


TAIL_MODES = tuple(m.value for m in TailMode)


@dataclass(frozen=True)
class TopKTeacher:
    """A sparse teacher: pass it as ``teacher_logits`` of :func:`vparallel_ce.distillation_loss`.

    Attributes:
        ids: ``[..., k]`` integer ids in the GLOBAL vocab (the same on every rank), distinct within
            each token's row. Rows of ignored tokens are not read.
        logprobs: ``[..., k]`` float, ``log p`` of the teacher distribution the divergence uses at
            those ids (at the distillation temperature; ``log_softmax(teacher_logits / T)``
            gathered at ``ids``): each ``<= 0``; with ``BUCKET`` their probabilities sum to at
            most 1 (the rest is the tail's). ``-inf`` is a probability of 0.
        tail: :class:`TailMode` (or its value), keyword-only.
        temperature: the ``T`` the log-probs were taken at, keyword-only: a loss called with
            another ``temperature`` raises :class:`~vparallel_ce.InvalidInputError` (the op does
            not rescale a record). None (the default): not recorded, and then not checked -- a
            record of ``log_softmax(logits / 2)`` used at ``temperature=1`` gives a loss with no
            error. :meth:`from_logits` records it.

    Build one from the teacher's full ``[..., V]`` logits with :meth:`from_logits`.
    """

    ids: torch.Tensor
    logprobs: torch.Tensor
    tail: TailMode | str = field(default=TailMode.BUCKET, kw_only=True)
    temperature: float | None = field(default=None, kw_only=True)

    @classmethod
    def from_logits(cls, logits: torch.Tensor, k: int, *, temperature: float = 1.0,
                    tail: TailMode | str = TailMode.BUCKET) -> "TopKTeacher":
        """The top-``k`` record of the teacher's full (unsharded) ``[..., V]`` logits at
        ``temperature``: ``ids`` the ``k`` largest logits' ids, ``logprobs`` their
        ``log_softmax(logits / T)`` (computed in fp32, or fp64 for fp64 logits), ``temperature``
        recorded. No gradient flows into it."""
        with torch.no_grad():
            wide = logits.to(torch.float64 if logits.dtype == torch.float64 else torch.float32)
            logprobs, ids = torch.log_softmax(wide / float(temperature), -1).topk(k, -1)
        return cls(ids, logprobs, tail=tail, temperature=float(temperature))


class TopKStats(NamedTuple):
    """Per-token statistics of a chunk (the same on every rank); field names shared with
    :class:`vparallel_ce.divergence.DistillStats` where the meaning is (``token_loss`` reads them)."""

    s_max: torch.Tensor  # m_b
    s_log_s: torch.Tensor  # log S_b
    rest_max: torch.Tensor | None  # m_r (BUCKET with k < V)
    rest_log_s: torch.Tensor | None  # log S_r
    grad_ids: torch.Tensor  # [c, k]: G_i, the gradient (over b) of the id's entry
    grad_tail: torch.Tensor | None  # [c]: G_tail
    divergence: torch.Tensor
    hard_max: torch.Tensor | None
    hard_log_s: torch.Tensor | None
    hard_loss: torch.Tensor | None


def has_tail(tail: TailMode, k: int, vocab_size: int) -> bool:
    """The tail is a class: ``BUCKET`` with ids that leave some of the vocab out (distinct ids, so
    ``k < V``)."""
    return tail is TailMode.BUCKET and k < vocab_size


def _local_ids(ids: torch.Tensor, layout) -> tuple[torch.Tensor, torch.Tensor]:
    """``(index into this shard clamped into range, owned mask)`` of ``[c, k]`` global ids."""
    local = ids - layout.offset if layout.offset else ids
    mine = (local >= 0) & (local < layout.local_size)
    return local.clamp(0, max(layout.local_size - 1, 0)), mine


def _off_ids(b: torch.Tensor, local: torch.Tensor, mine: torch.Tensor) -> torch.Tensor:
    """``[c, V_loc]`` True at the entries that are none of the row's ids. A count, not a scatter of
    booleans: a clamped index of an id this rank does not own must not clear an owned one."""
    hits = torch.zeros(b.shape, dtype=torch.int32, device=b.device)
    if b.shape[-1] > 0:
        hits.scatter_add_(-1, local, mine.to(torch.int32))
    return hits == 0


def class_divergence(log_p: torch.Tensor, log_q: torch.Tensor, spec: DistillSpec):
    """``(D, g)`` of two distributions over the same ``n`` classes given as ``[c, n]`` log-probs:
    the divergence per row and ``g_c = q_c dD/dq_c`` up to a multiple of ``q_c`` (which the class
    gradient ``g - q sum g`` cancels)."""
    p, q = torch.exp(log_p), torch.exp(log_q)
    kind = spec.divergence
    if kind is Divergence.FORWARD_KL:
        return _weighted(p, log_p - log_q).sum(-1), -p
    if kind is Divergence.REVERSE_KL:
        g = _weighted(q, log_q - log_p)
        return g.sum(-1), g
    log_m = _log_mixture(log_p, log_q, spec.beta)
    gq = _weighted(q, log_q - log_m)
    div = spec.beta * _weighted(p, log_p - log_m).sum(-1) + (1.0 - spec.beta) * gq.sum(-1)
    return div, (1.0 - spec.beta) * gq


def topk_statistics(s: torch.Tensor, ids: torch.Tensor, logprobs: torch.Tensor, local_t: torch.Tensor,
                    owned: torch.Tensor, spec: DistillSpec, layout, tail: TailMode) -> TopKStats:
    """Forward steps 1-4 of one chunk: the student's ``[c, V_loc]`` logits of this rank's shard,
    the teacher's ``[c, k]`` ids and log-probs, the targets mapped to the shard (read only with
    ``spec.hard``) -> the per-token statistics. Collectives over ``layout.group``."""
    cdt = compute_dtype(s.dtype)
    k = ids.shape[-1]
    bucket = has_tail(tail, k, layout.vocab_size)
    b = _scaled(s, spec.temperature, cdt)
    h = _scaled(s, 1.0, cdt) if spec.hard_apart else b
    local, mine = _local_ids(ids, layout)
    off = _off_ids(b, local, mine) if bucket else None
    rest = b.masked_fill(~off, float("-inf")) if bucket else None
    maxima = [_maxima(b)] + ([_maxima(rest)] if bucket else []) + ([_maxima(h)] if spec.hard_apart else [])
    m = comm.all_reduce_max_(torch.stack(maxima), layout.group)
    m_b, m_h = m[0], m[-1] if spec.hard_apart else m[0]
    sums = [torch.exp(b - finite_shift(m_b).unsqueeze(-1)).sum(-1)]
    if bucket:
        m_r = m[1]
        sums.append(torch.exp(rest - finite_shift(m_r).unsqueeze(-1)).sum(-1))
    hard_row = len(sums)
    sums += hard_sums(h, m_h, local_t, owned, spec)
    at_ids = b.gather(-1, local) if b.shape[-1] > 0 else torch.zeros(ids.shape, dtype=cdt, device=b.device)
    at_ids = torch.where(mine, at_ids, 0)
    packed = comm.all_reduce_sum_(torch.cat([torch.stack(sums), at_ids.T]), layout.group)
    b_ids = packed[len(sums):].T  # [c, k]: the student's b at every id, on every rank
    log_sb = torch.log(packed[0])
    lp = logprobs.to(cdt)
    if tail is TailMode.BUCKET:  # log q_i = b_i - m_b - log S_b, without exponentiating b_i
        log_norm = finite_shift(m_b) + log_sb
        log_q, log_p = b_ids - log_norm.unsqueeze(-1), lp
    if bucket:
        log_tail_q = finite_shift(m_r) + torch.log(packed[1]) - log_norm
        # 1 - sum p, exact near 1; a sum above 1 by rounding leaves no tail (clamped)
        tail_p = (-torch.expm1(torch.logsumexp(lp, -1))).clamp_min(0.0)
        log_q = torch.cat([log_q, log_tail_q.unsqueeze(-1)], -1)
        log_p = torch.cat([lp, torch.log(tail_p).unsqueeze(-1)], -1)
    elif tail is TailMode.RENORMALIZE:
        log_q = b_ids - torch.logsumexp(b_ids, -1, keepdim=True)
        log_p = lp - torch.logsumexp(lp, -1, keepdim=True)
    div, g = class_divergence(log_p, log_q, spec)
    grad = g - torch.exp(log_q) * g.sum(-1, keepdim=True)
    if not bucket:
        # a nan anywhere in the student's row makes the row's loss and gradient nan, as in the
        # dense op, though the renormalised divergence reads only the ids' logits
        bad = torch.isnan(log_sb)
        div = torch.where(bad, log_sb, div)
        grad = torch.where(bad.unsqueeze(-1), log_sb.unsqueeze(-1), grad)
    return TopKStats(m_b, log_sb, m_r if bucket else None, torch.log(packed[1]) if bucket else None,
                     grad[:, :k], grad[:, k] if bucket else None, div, *hard_stats(packed[hard_row:len(sums)], m_h,
                                                                                    log_sb, spec))


def topk_grad_student(s: torch.Tensor, ids: torch.Tensor, local_t: torch.Tensor, owned: torch.Tensor,
                      st: TopKStats, weight: torch.Tensor, spec: DistillSpec, layout, tail: TailMode,
                      out_dtype: torch.dtype | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Backward of one chunk: ``d (sum_i weight_i loss_i) / d s`` for the student's ``[c, V_loc]``
    logits from the chunk's ids and saved statistics (module docstring); rows whose weight is 0 get
    exactly 0. Local, no communication. ``out``: as :func:`vparallel_ce.divergence.finish_grad`'s."""
    cdt = compute_dtype(s.dtype)
    T = spec.temperature
    local, mine = _local_ids(ids, layout)
    if st.grad_tail is not None:
        b = _scaled(s, T, cdt)
        share = torch.exp(b - finite_shift(st.rest_max).unsqueeze(-1) - st.rest_log_s.unsqueeze(-1))
        g = torch.where(_off_ids(b, local, mine), share * (st.grad_tail * T).unsqueeze(-1), 0.0)
    else:
        g = torch.zeros(s.shape, dtype=cdt, device=s.device)
    if g.shape[-1] > 0:
        g.scatter_add_(-1, local, torch.where(mine, st.grad_ids * T, 0.0))
    return finish_grad(g, s, None, local_t, owned, st, weight, spec, out_dtype, out)
