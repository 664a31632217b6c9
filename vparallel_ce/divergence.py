r"""The per-chunk math of vocab-parallel distillation: a divergence between the teacher's and the
student's softmax over the GLOBAL vocab, from logits chunks sharded along the vocab.

Notation for one token (a row of a chunk), ``T`` the temperature::

    a_j = t_j / T,  b_j = s_j / T                (teacher, student logits of this rank's shard)
    p = softmax(a),  q = softmax(b)              (over the whole vocab)
    forward_kl = KL(p || q) = sum_j p_j (log p_j - log q_j)
    reverse_kl = KL(q || p)
    jsd        = beta KL(p || m) + (1 - beta) KL(q || m),   m = beta p + (1 - beta) q
    loss       = T**2 * divergence + hard_weight * CE(s, target)      (0 for ignored tokens)

``CE(s, target)`` is the plain cross-entropy of the student at temperature 1.

Forward, per token chunk -- what crosses ranks is a few floats per token, never logits:

1. local pass: the shard's maxima ``[max_j a_j, max_j b_j]`` (and ``max_j s_j`` when
   ``hard_weight > 0`` and ``T != 1``; at ``T = 1`` the student's softmax is the CE's);
2. ``all_reduce_MAX`` of that one ``[2 or 3, chunk]`` tensor -> the global maxima ``m_a, m_b``;
3. local pass relative to them (``u_j = a_j - m_a``, ``v_j = b_j - m_b``, exact for logits of any
   magnitude): ``S_a = sum e^{u_j}``, ``S_b = sum e^{v_j}``, the divergence's partial sum
   (forward KL: ``sum e^{u_j} (u_j - v_j)``; reverse KL: ``sum e^{v_j} (v_j - u_j)``; JSD: none
   here) and, for the hard term, ``S_s`` and ``s_t - m_s`` where this rank owns the target;
4. ``all_reduce_SUM`` of those in one ``[2..5, chunk]`` tensor. Then
   ``KL(p||q) = F / S_a - log S_a + log S_b`` and ``KL(q||p) = R / S_b - log S_b + log S_a``;
5. JSD only: ``log m_j = logaddexp(log beta + log p_j, log(1 - beta) + log q_j)`` is elementwise,
   so local once both ``log S`` are known -- a second local pass makes
   ``P = sum p_j (log p_j - log m_j)`` and ``Q = sum q_j (log q_j - log m_j)``, joined by a second
   ``all_reduce_SUM`` of ``[2, chunk]``: ``jsd = beta P + (1 - beta) Q``.

So a chunk costs one MAX and one SUM all-reduce (two SUMs for JSD) of ``O(chunk)`` floats.

Backward, per chunk -- local only. With the per-token statistics saved by the forward, the
student's gradient has a closed form (``d/ds = (1/T) d/db``, times the ``T**2`` of the loss)::

    forward_kl:  T (q_j - p_j)
    reverse_kl:  T q_j (log q_j - log p_j - KL(q||p))
    jsd:         (1 - beta) T q_j (log q_j - log m_j - Q)
    hard term:   hard_weight (softmax(s)_j - [j == target])

(from ``d q_k / d b_j = q_k ([k == j] - q_j)``; for JSD, ``d jsd / d q_k = (1 - beta)
(log q_k - log m_k)`` since ``beta p + (1 - beta) q = m`` makes the ``d log m`` terms cancel). The
teacher is a constant: it gets no gradient.

Every function takes chunks of logits (``[c, V_block]``) and per-token vectors, so an op that makes
its logits chunk by chunk (a fused lm_head variant) reuses them as they are. A sparse top-k teacher
has its own per-chunk math (:mod:`vparallel_ce.topk`), which shares the hard term's steps here
(:func:`hard_sums`, :func:`hard_stats`, :func:`finish_grad`). Statistics are fp32 whatever the logits' dtype (fp64 for fp64).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from . import comm
from .stats import compute_dtype, finite_shift

__all__ = ["Divergence", "DIVERGENCES", "DistillSpec", "DistillStats", "DistillSteps", "TORCH_STEPS", "statistics",
           "local_maxima", "local_sums", "local_mixture_sums", "target_logit", "token_loss", "grad_student",
           "hard_sums", "hard_stats", "finish_grad"]


class Divergence(str, enum.Enum):
    """Which divergence between teacher ``p`` and student ``q`` the loss is."""

    FORWARD_KL = "forward_kl"  # KL(p || q): mass-covering, the classic Hinton distillation
    REVERSE_KL = "reverse_kl"  # KL(q || p): mode-seeking
    JSD = "jsd"  # beta KL(p || m) + (1 - beta) KL(q || m), m = beta p + (1 - beta) q


DIVERGENCES = tuple(d.value for d in Divergence)


@dataclass(frozen=True)
class DistillSpec:
    """The math options of a distillation call."""

    divergence: Divergence
    beta: float = 0.5
    temperature: float = 1.0
    hard_weight: float = 0.0

    @classmethod
    def of(cls, options) -> "DistillSpec":
        """The math options of a call's (checked) :class:`~vparallel_ce.options.Options`."""
        o = options
        return cls(Divergence(o.divergence), float(o.beta), float(o.temperature), float(o.hard_weight))

    @property
    def hard(self) -> bool:
        return self.hard_weight > 0

    @property
    def hard_apart(self) -> bool:
        """The hard term needs its own softmax (temperature 1) besides the student's at ``T``."""
        return self.hard and self.temperature != 1.0


class DistillStats(NamedTuple):
    """Per-token statistics over the GLOBAL vocab (the same on every rank), ``[c]`` each."""

    t_max: torch.Tensor  # m_a
    t_log_s: torch.Tensor  # log S_a
    s_max: torch.Tensor  # m_b
    s_log_s: torch.Tensor  # log S_b
    divergence: torch.Tensor  # the divergence (without T**2)
    inner: torch.Tensor | None  # reverse KL: KL(q||p); JSD: Q = sum q (log q - log m); else None
    hard_max: torch.Tensor | None  # the hard CE's softmax (the student's own at T = 1)
    hard_log_s: torch.Tensor | None
    hard_loss: torch.Tensor | None  # CE(s, target) per token, with hard_weight > 0


def _scaled(x: torch.Tensor, temperature: float, dtype: torch.dtype) -> torch.Tensor:
    z = x.to(dtype)
    return z * (1.0 / temperature) if temperature != 1.0 else z  # a product, as the CE's transform


def _maxima(z: torch.Tensor) -> torch.Tensor:
    if z.shape[-1] == 0:  # an empty shard: -inf, which the MAX all-reduce ignores
        return torch.full(z.shape[:1], float("-inf"), dtype=z.dtype, device=z.device)
    return z.amax(dim=-1)  # nan where the row holds a nan: it then reaches the sums


def _weighted(w: torch.Tensor, diff: torch.Tensor) -> torch.Tensor:
    """``w * diff`` with the term of a zero weight exactly 0 (a masked entry: ``0 * -inf``), while
    a nan weight (a nan logit) stays nan."""
    return torch.where(w == 0, 0.0, w * diff)


def _log_probs(z: torch.Tensor, m: torch.Tensor, log_s: torch.Tensor) -> torch.Tensor:
    return z - finite_shift(m).unsqueeze(-1) - log_s.unsqueeze(-1)


def _log_mixture(log_p: torch.Tensor, log_q: torch.Tensor, beta: float) -> torch.Tensor:
    lb = math.log(beta) if beta > 0 else float("-inf")
    l1b = math.log1p(-beta) if beta < 1 else float("-inf")
    return torch.logaddexp(log_p + lb, log_q + l1b)


def local_maxima(s: torch.Tensor, t: torch.Tensor, spec: DistillSpec) -> torch.Tensor:
    """Step 1: the shard's row maxima ``[max a, max b (, max s)]``, ``[2 or 3, c]`` (the third only
    with :attr:`DistillSpec.hard_apart`); -inf for an empty shard."""
    cdt = compute_dtype(s.dtype)
    T = spec.temperature
    maxima = [_maxima(_scaled(t, T, cdt)), _maxima(_scaled(s, T, cdt))]
    if spec.hard_apart:
        maxima.append(_maxima(_scaled(s, 1.0, cdt)))
    return torch.stack(maxima)


def local_sums(s: torch.Tensor, t: torch.Tensor, m: torch.Tensor, spec: DistillSpec) -> torch.Tensor:
    """Step 3 but the target's logit: relative to the global maxima ``m`` (step 2's), the shard's
    ``[S_a, S_b (, F or R) (, S_s)]`` -- the divergence's partial sum for the KLs, the hard term's
    own sum-exp with :attr:`DistillSpec.hard_apart` -- ``[2..4, c]``."""
    cdt = compute_dtype(s.dtype)
    T = spec.temperature
    u = _scaled(t, T, cdt) - finite_shift(m[0]).unsqueeze(-1)
    v = _scaled(s, T, cdt) - finite_shift(m[1]).unsqueeze(-1)
    eu, ev = torch.exp(u), torch.exp(v)
    sums = [eu.sum(-1), ev.sum(-1)]
    if spec.divergence is Divergence.FORWARD_KL:
        sums.append(_weighted(eu, u - v).sum(-1))
    elif spec.divergence is Divergence.REVERSE_KL:
        sums.append(_weighted(ev, v - u).sum(-1))
    if spec.hard_apart:
        sums.append(torch.exp(_scaled(s, 1.0, cdt) - finite_shift(m[2]).unsqueeze(-1)).sum(-1))
    return torch.stack(sums)


def local_mixture_sums(s: torch.Tensor, t: torch.Tensor, st: DistillStats, spec: DistillSpec) -> torch.Tensor:
    """Step 5 (JSD): the shard's ``[P, Q]`` partial sums, ``[2, c]``, from the global maxima and
    log sum-exps in ``st``."""
    cdt = compute_dtype(s.dtype)
    T = spec.temperature
    log_p = _log_probs(_scaled(t, T, cdt), st.t_max, st.t_log_s)
    log_q = _log_probs(_scaled(s, T, cdt), st.s_max, st.s_log_s)
    log_m = _log_mixture(log_p, log_q, spec.beta)
    return torch.stack([_weighted(torch.exp(log_p), log_p - log_m).sum(-1),
                        _weighted(torch.exp(log_q), log_q - log_m).sum(-1)])


def statistics(s: torch.Tensor, t: torch.Tensor, local_t: torch.Tensor, owned: torch.Tensor, spec: DistillSpec,
               layout, steps: "DistillSteps | None" = None) -> DistillStats:
    """Forward steps 1-5 of one chunk: student ``s`` and teacher ``t`` ``[c, V_loc]`` logits of this
    rank's shard, the targets mapped to it (:func:`vparallel_ce.stats.local_targets`; ignored when
    ``spec.hard`` is off) -> the global per-token statistics. Collectives over ``layout.group``; the
    local passes are ``steps``' (default :data:`TORCH_STEPS`)."""
    steps = steps or TORCH_STEPS
    m = comm.all_reduce_max_(steps.maxima(s, t, spec), layout.group)
    m_a, m_b = m[0], m[1]
    m_h = m[2] if spec.hard_apart else m_b
    sums = steps.sums(s, t, m, spec)
    if spec.hard:  # the target's shifted logit, where this rank owns it
        sums = torch.cat([sums, target_logit(s, m_h, local_t, owned).unsqueeze(0)])
    packed = comm.all_reduce_sum_(sums, layout.group)
    log_sa, log_sb = torch.log(packed[0]), torch.log(packed[1])
    kind = spec.divergence
    hard_rows = packed[2 if kind is Divergence.JSD else 3:]
    hard = hard_stats(hard_rows, m_h, log_sb, spec)
    if kind is Divergence.FORWARD_KL:
        return DistillStats(m_a, log_sa, m_b, log_sb, packed[2] / packed[0] - log_sa + log_sb, None, *hard)
    if kind is Divergence.REVERSE_KL:
        inner = packed[2] / packed[1] - log_sb + log_sa
        return DistillStats(m_a, log_sa, m_b, log_sb, inner, inner, *hard)
    st = DistillStats(m_a, log_sa, m_b, log_sb, None, None, *hard)
    pq = comm.all_reduce_sum_(steps.mixture_sums(s, t, st, spec), layout.group)
    return st._replace(divergence=spec.beta * pq[0] + (1.0 - spec.beta) * pq[1], inner=pq[1])


def target_logit(s: torch.Tensor, m_h: torch.Tensor, local_t: torch.Tensor, owned: torch.Tensor) -> torch.Tensor:
    """The hard term's row of the forward's SUM all-reduce: ``s_t - m_h`` where this rank owns the
    target, else 0 (``[c]``, in the statistics' dtype)."""
    if s.shape[-1] == 0:
        return torch.zeros_like(m_h)
    picked = s.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).to(m_h.dtype) - finite_shift(m_h)
    return torch.where(owned, picked, 0.0)


def hard_sums(h: torch.Tensor, m_h: torch.Tensor, local_t: torch.Tensor, owned: torch.Tensor,
              spec: DistillSpec) -> list:
    """The hard term's rows of the forward's SUM all-reduce: its own sum-exp (only apart from the
    student's at ``T != 1``) and the target's shifted logit where this rank owns it."""
    sums = []
    if spec.hard_apart:
        sums.append(torch.exp(h - finite_shift(m_h).unsqueeze(-1)).sum(-1))
    if spec.hard:
        sums.append(target_logit(h, m_h, local_t, owned))
    return sums


def hard_stats(rows: torch.Tensor, m_h: torch.Tensor, log_sb: torch.Tensor, spec: DistillSpec) -> tuple:
    """``(hard_max, hard_log_s, hard_loss)`` from the reduced rows of :func:`hard_sums` (``log_sb``:
    the student's log sum-exp at ``T``, the hard term's own at ``T = 1``); Nones without one."""
    if not spec.hard:
        return None, None, None
    log_s = torch.log(rows[0]) if spec.hard_apart else log_sb
    return m_h, log_s, log_s - rows[-1]


def token_loss(st: DistillStats, valid: torch.Tensor, spec: DistillSpec) -> torch.Tensor:
    """Per-token loss, ``T**2 * divergence (+ hard_weight * CE)``; exactly 0 on ignored tokens."""
    loss = st.divergence * (spec.temperature ** 2)
    if spec.hard:
        loss = loss + spec.hard_weight * st.hard_loss
    return torch.where(valid, loss, 0.0)


def grad_student(s: torch.Tensor, t: torch.Tensor, local_t: torch.Tensor, owned: torch.Tensor, st: DistillStats,
                 weight: torch.Tensor, spec: DistillSpec, out_dtype: torch.dtype | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """Backward of one chunk: ``d (sum_i weight_i loss_i) / d s`` for the student's ``[c, V_loc]``
    logits, from the chunk's inputs and its saved statistics (closed forms in the module
    docstring). Rows whose ``weight`` is exactly 0 (ignored tokens) get exactly 0, whatever their
    logits hold. Local, no communication. ``out``: written there (its dtype), as ``finish_grad``."""
    cdt = compute_dtype(s.dtype)
    T = spec.temperature
    a, b = _scaled(t, T, cdt), _scaled(s, T, cdt)
    log_p = _log_probs(a, st.t_max, st.t_log_s)
    log_q = _log_probs(b, st.s_max, st.s_log_s)
    q = torch.exp(log_q)
    kind = spec.divergence
    if kind is Divergence.FORWARD_KL:
        g = (q - torch.exp(log_p)) * T
    elif kind is Divergence.REVERSE_KL:
        g = _weighted(q, log_q - log_p - st.inner.unsqueeze(-1)) * T
    else:
        log_m = _log_mixture(log_p, log_q, spec.beta)
        g = _weighted(q, log_q - log_m - st.inner.unsqueeze(-1)) * ((1.0 - spec.beta) * T)
    return finish_grad(g, s, q if not spec.hard_apart else None, local_t, owned, st, weight, spec, out_dtype, out)


def finish_grad(g: torch.Tensor, s: torch.Tensor, soft: torch.Tensor | None, local_t: torch.Tensor,
                owned: torch.Tensor, st, weight: torch.Tensor, spec: DistillSpec,
                out_dtype: torch.dtype | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """The divergence's gradient ``g`` (``[c, V_loc]``, in the statistics' dtype) plus the hard
    term's ``hard_weight (softmax(s) - onehot(target))`` (``soft``: that softmax if already made,
    else remade from ``st.hard_max``/``st.hard_log_s``), times each row's ``weight`` -- exactly 0
    where the weight is 0 -- in ``out_dtype`` (default ``s.dtype``), or written into ``out`` (a
    ``[c, V_loc]`` tensor, e.g. rows of a buffer that keeps every chunk's gradient) and returned."""
    cdt = g.dtype
    if spec.hard:
        if soft is None:
            soft = torch.exp(_log_probs(_scaled(s, 1.0, cdt), st.hard_max, st.hard_log_s))
        g = g + spec.hard_weight * soft
        if g.shape[-1] > 0:
            hit = torch.where(owned, -spec.hard_weight, torch.zeros_like(st.hard_max))
            g.scatter_add_(-1, local_t.unsqueeze(-1), hit.unsqueeze(-1))
    w = weight.to(cdt).unsqueeze(-1)
    d = torch.where(w == 0, 0.0, g * w)
    if out is not None:
        return out.copy_(d)
    return d.to(out_dtype or s.dtype)


@dataclass(frozen=True)
class DistillSteps:
    """The local passes over a chunk's logits, one implementation (a field of
    :class:`vparallel_ce.kernels.KernelBackend`): :func:`local_maxima`, :func:`local_sums`,
    :func:`local_mixture_sums` and :func:`grad_student`, or drop-ins of exactly their signatures
    (:mod:`vparallel_ce.kernels.triton_distill`). :func:`statistics` runs the collectives between them."""

    maxima: Callable
    sums: Callable
    mixture_sums: Callable
    grad: Callable


#: The torch reference of the local passes (and the CPU path).
TORCH_STEPS = DistillSteps(local_maxima, local_sums, local_mixture_sums, grad_student)
