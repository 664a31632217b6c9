r"""The per-chunk math of vocab-parallel cross-entropy and log-probs, written once for every op
and schedule.

Notation for one token ``i`` (a row of a chunk). ``x`` are the raw logits of this rank's vocab shard
(ids ``[o, o + V_loc)`` of the global vocab ``[0, V)``), ``t`` the global target id, ``s`` the soft
cap, ``T`` the temperature, ``eps`` the label smoothing and ``zl`` the z-loss weight::

    z_j   = s * tanh(x_j / s) / T          (z = x without softcap and temperature)
    lse   = log sum_{j<V} exp(z_j)         (over the GLOBAL vocab)
    loss  = lse - (1 - eps) * z_t - (eps / V) * sum_j z_j + zl * lse**2      (0 for ignored tokens)
    logp  = z_t - lse,    H = -sum_j p_j log p_j,    p_j = exp(z_j - lse)

``loss`` is ``F.cross_entropy(z, t, label_smoothing=eps)`` per token plus the PaLM z-loss; ``logp``
and the entropy ``H`` are what RL post-training needs (:mod:`vparallel_ce.logprobs`).

Forward, per chunk -- the only data that crosses ranks are a few floats per token:

1. local pass (one read of the chunk): ``m_r = max_j z_j``, ``S_r = sum_j exp(z_j - m_r)``,
   ``z_t`` if this rank owns ``t`` (else 0), ``sum_j z_j`` (with smoothing), and for the entropy
   ``E_r = sum_j exp(z_j - m_r) (z_j - m_r)``;
2. ``m = all_reduce_MAX(m_r)``;
3. ``all_reduce_SUM([S_r e^{m_r - m}, z_t, sum z, e^{m_r - m} (E_r + (m_r - m) S_r)])``
   -> ``lse = m + log S`` and ``H = log S - E / S`` (every term is relative to the max, so logits
   of large magnitude lose nothing to cancellation). Exactly one rank owns each valid target, so
   the summed ``z_t`` is the target's logit (targets are range-checked,
   :func:`vparallel_ce.agreement.agree`).

Backward, per chunk -- local only. Every op's gradient has the one form::

    d obj/d z_j = p_j * (a_i + b_i * log p_j) - c_i [j == t] - d_i,   log p_j = (z_j - m) - log S
    d obj/d x_j = d obj/d z_j * (1 - (T z_j / s)**2) / T       (softcap; 1 / T without)

with per-token coefficients from the upstream gradients (0 on ignored tokens):

* loss, upstream ``g``: ``a = g (1 + 2 zl lse)``, ``b = 0``, ``c = g (1 - eps)``, ``d = g eps / V``;
* log-prob ``g_lp`` and entropy ``g_H``: ``a = -g_lp - g_H H``, ``b = -g_H``, ``c = -g_lp``,
  ``d = 0`` (from ``d logp / d z_j = [j == t] - p_j`` and ``d H / d z_j = -p_j (log p_j + H)``).

The kernels evaluate it relative to the global max ``m``, never to ``lse``: with
``p_j = e^{z_j - m} / S`` it is ``e^{z_j - m} (A + B (z_j - m)) - c [j == t] - d`` with
``A = (a - b log S) / S``, ``B = b / S`` (:class:`GradCoefs`). ``z_j - m`` is exact in fp32 even for
logits of magnitude 1e4, where ``lse = m + log S`` is not (its rounding, ~1e-3 there, would move
every ``p_j`` by that much); the loss and ``logp`` are formed the same way, from ``z_t - m`` and
``log S``.

The same ``(m, S, E)`` merge across vocab blocks of one rank (:func:`merge`), which is how the
vocab-blocked schedule of ``linear_cross_entropy`` builds its statistics before the one exchange.
A rank holding the whole vocab has nothing to exchange, so its forward can make the loss'
gradient for an upstream gradient of 1 right after the statistics (:func:`loss_stats_grad_`, one
pass); the backward then applies the upstream gradient to the ``[N, H]`` side (:func:`scale_rows`).

Statistics are fp32 whatever the logits' dtype (fp64 for fp64 logits, so tests can check to 1e-10).
CUDA kernels in ``vparallel_ce.kernels`` are drop-ins for :func:`local_stats` and
:func:`grad_logits` with the same signatures.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from . import comm, top1

__all__ = ["LossSpec", "ChunkStats", "TokenStats", "GradCoefs", "local_targets", "block_targets", "local_stats",
           "finite_shift", "merge", "merge_blocks", "stats_into", "combine", "whole_vocab", "token_loss",
           "loss_grad_coefs", "token_weights",
           "unit_loss_coefs", "scale_coefs", "loss_stats_grad_", "scale_rows", "logprob_grad_coefs", "grad_logits",
           "scaled_logits"]


@dataclass(frozen=True)
class LossSpec:
    """The math options of a call (``F.cross_entropy`` names), and the GLOBAL vocab size.
    ``entropy``: the statistics also carry what the entropy needs."""

    vocab_size: int
    ignore_index: int = -100
    label_smoothing: float = 0.0
    z_loss: float = 0.0
    softcap: float | None = None
    temperature: float = 1.0
    entropy: bool = False


class ChunkStats(NamedTuple):
    """Per-token statistics of one rank's (part of the) vocab; all ``[c]`` in the compute dtype."""

    max: torch.Tensor  # m_r = max_j z_j  (-inf for an empty shard)
    sumexp: torch.Tensor  # S_r = sum_j exp(z_j - m_r)
    target: torch.Tensor  # z_t where this shard owns t, else 0
    sum: torch.Tensor  # sum_j z_j (zeros unless label smoothing)
    zexp: torch.Tensor | None = None  # E_r = sum_j exp(z_j - m_r) (z_j - m_r), with spec.entropy


class TokenStats(NamedTuple):
    """Per-token statistics over the GLOBAL vocab (identical on every rank of the group)."""

    lse: torch.Tensor  # m + log S
    target: torch.Tensor  # z_t
    sum: torch.Tensor
    entropy: torch.Tensor | None  # H, with spec.entropy
    max: torch.Tensor  # m, the global max: the shift of the gradient pass
    log_s: torch.Tensor  # log S = log sum_j exp(z_j - m)


class GradCoefs(NamedTuple):
    """Per-token ``[c]`` coefficients of ``d obj/d z_j = e^{u_j} (a + b u_j) - c [j == t] - d`` with
    ``u_j = z_j - m`` (``m`` the global max, passed as ``shift``); ``b`` and ``d`` are None where
    they are zero."""

    a: torch.Tensor
    b: torch.Tensor | None
    c: torch.Tensor
    d: torch.Tensor | None


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Statistics are fp32, except for fp64 inputs (kept exact for reference tests)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def local_targets(target: torch.Tensor, offset: int, local_size: int, ignore_index: int, *,
                  all_owned: bool = False):
    """Map global ids to this shard: ``(local index clamped into range, owned mask, valid mask)``.
    ``all_owned``: the shard is the whole vocab and the ids were range-checked, so every valid id
    is owned here (two kernels instead of six: this runs on every call)."""
    valid = target != ignore_index
    if all_owned:
        return target.clamp(0, max(local_size - 1, 0)), valid, valid
    local = target - offset if offset else target
    owned = valid & (local >= 0) & (local < local_size)
    return local.clamp(0, max(local_size - 1, 0)), owned, valid


def block_targets(local_target: torch.Tensor, owned: torch.Tensor, start: int, stop: int):
    """Shard-relative targets -> relative to the vocab block ``[start, stop)`` of the shard:
    ``(index clamped into the block, owned by the block)``."""
    in_block = owned & (local_target >= start) & (local_target < stop)
    return (local_target - start).clamp(0, max(stop - start - 1, 0)), in_block


def scaled_logits(x: torch.Tensor, spec: LossSpec) -> torch.Tensor:
    """``z`` of the notation above: the logits in the compute dtype, soft-capped and divided by the
    temperature (a product, rounded as the kernels round it)."""
    return _transform(x, spec)


def _transform(x: torch.Tensor, spec: LossSpec) -> torch.Tensor:
    z = x.to(compute_dtype(x.dtype))
    if spec.softcap is not None:
        z = torch.tanh(z / spec.softcap) * spec.softcap
    if spec.temperature != 1.0:
        z = z * (1.0 / spec.temperature)  # a product, as in the kernels: the two paths round alike
    return z


def _row_sum(a: torch.Tensor) -> torch.Tensor:
    return a.sum(dim=-1)


def local_stats(x: torch.Tensor, local_target: torch.Tensor, owned: torch.Tensor, spec: LossSpec, *,
                row_sum=_row_sum, col_offset: int | None = None, out: torch.Tensor | None = None) -> ChunkStats:
    """Step 1: one pass over a ``[c, V_block]`` block of logits (any float dtype). ``row_sum``: the
    per-row sum over the block (:func:`vparallel_ce.invariant.block_row_sum`: in a fixed order).
    ``col_offset``: ``x`` is the block of a shard starting at that column, and ``local_target`` /
    ``owned`` are relative to the shard (:func:`block_targets` maps them); None: to ``x`` itself.
    ``out``: a ``[5, c]`` compute-dtype buffer for the statistics (:class:`ChunkStats` order)."""
    if col_offset is not None:
        local_target, owned = block_targets(local_target, owned, col_offset, col_offset + x.shape[-1])
    st = _local_stats(x, local_target, owned, spec, row_sum)
    return st if out is None else stats_into(st, out)


def stats_into(st: ChunkStats, out: torch.Tensor) -> ChunkStats:
    """``st`` copied into the rows of a ``[5, c]`` buffer (:func:`local_stats`' ``out``), as views of it."""
    for row, f in zip(out, st):
        if f is not None:
            row.copy_(f)
    return ChunkStats(*out[:4], out[4] if st.zexp is not None else None)


def _local_stats(x, local_target, owned, spec, row_sum) -> ChunkStats:
    z = _transform(x, spec)
    c, width = z.shape
    if width == 0:
        neg_inf = torch.full((c,), float("-inf"), dtype=z.dtype, device=z.device)
        zeros = torch.zeros((c,), dtype=z.dtype, device=z.device)
        return ChunkStats(neg_inf, zeros, zeros, zeros, zeros if spec.entropy else None)
    m = z.amax(dim=-1)  # nan where the row holds a nan: it then reaches the sum-exp below
    u = z - finite_shift(m).unsqueeze(-1)
    e = torch.exp(u)
    sumexp = row_sum(e)
    picked = z.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
    tgt = torch.where(owned, picked, 0.0)
    total = row_sum(z) if spec.label_smoothing > 0 else torch.zeros_like(m)
    # a -inf logit (a masked vocab entry) has e = 0: its term is 0, not 0 * -inf
    zexp = row_sum(torch.where(e > 0, e * u, 0.0)) if spec.entropy else None
    return ChunkStats(m, sumexp, tgt, total, zexp)


def finite_shift(m: torch.Tensor) -> torch.Tensor:
    """The shift of ``exp(z - m)``: ``m``, or 0 where ``m = -inf`` (every logit of the row masked:
    their terms are then ``exp(-inf) = 0``, not ``exp(-inf + inf) = nan``)."""
    return m.masked_fill(m == float("-inf"), 0.0)


# Non-finite values. A row whose logits hold a nan or a +inf has a nan sum-exp on the rank that
# holds it (exp(nan) / exp(inf - inf)); the rescalings below keep it nan -- they zero only a sum
# that IS zero (a fully masked block or shard) -- so the joined sum, and with it the token's loss and
# every rank's gradient row, is nan whatever the MAX all-reduce made of the nan, as F.cross_entropy
# on the gathered logits gives. A -inf logit is a masked entry: exp(-inf) = 0.


def _rescale(sumexp: torch.Tensor, m_from: torch.Tensor, m_to: torch.Tensor) -> torch.Tensor:
    # exp(-inf - m) is 0 as wanted; a zero sum stays 0 (an empty or masked part: -inf - (-inf) = nan)
    return torch.where(sumexp == 0, sumexp, sumexp * torch.exp(m_from - m_to))


def _rescale_zexp(zexp, sumexp, m_from, m_to):
    """``E`` relative to ``m_from`` -> relative to ``m_to``: ``e^{m_from - m_to} (E + (m_from - m_to) S)``."""
    empty = sumexp == 0
    shifted = zexp + torch.where(empty, 0.0, m_from - m_to) * sumexp
    return torch.where(empty, 0.0, shifted * torch.exp(m_from - m_to))


def merge(a: ChunkStats, b: ChunkStats) -> ChunkStats:
    """Statistics of the union of two disjoint vocab blocks of the same tokens (online softmax)."""
    m = torch.maximum(a.max, b.max)
    sumexp = _rescale(a.sumexp, a.max, m) + _rescale(b.sumexp, b.max, m)
    zexp = None
    if a.zexp is not None:
        zexp = _rescale_zexp(a.zexp, a.sumexp, a.max, m) + _rescale_zexp(b.zexp, b.sumexp, b.max, m)
    return ChunkStats(m, sumexp, a.target + b.target, a.sum + b.sum, zexp)


def merge_blocks(parts: torch.Tensor, spec: LossSpec) -> ChunkStats:
    """The statistics of ``k`` disjoint vocab blocks of the same ``c`` tokens, ``parts [k, 5, c]``
    (each block's :func:`local_stats` ``out``), merged left to right: ``merge(merge(p_0, p_1), p_2)...``."""
    acc = None
    for p in parts:
        st = ChunkStats(*p[:4], p[4] if spec.entropy else None)
        acc = st if acc is None else merge(acc, st)
    return acc


def combine(stats: ChunkStats, layout, *, rank_ordered: bool = False) -> TokenStats:
    """Steps 2-3: join the ranks' statistics -- one all-reduce MAX and one fused all-reduce SUM.
    ``rank_ordered``: the SUM adds the ranks' partials in rank order whatever the message size
    (:func:`vparallel_ce.comm.all_reduce_sum_rank_ordered`; batch invariance)."""
    if not layout.sharded:  # one rank: its statistics are the global ones (no rescaling to launch)
        return whole_vocab(stats)
    m = comm.all_reduce_max_(stats.max.clone(), layout.group)
    parts = [_rescale(stats.sumexp, stats.max, m), stats.target, stats.sum]
    if stats.zexp is not None:
        parts.append(_rescale_zexp(stats.zexp, stats.sumexp, stats.max, m))
    sum_ = comm.all_reduce_sum_rank_ordered if rank_ordered else comm.all_reduce_sum_
    packed = sum_(torch.stack(parts), layout.group)
    sumexp, target, total = packed[:3].unbind(0)
    log_s = torch.log(sumexp)
    entropy = log_s - packed[3] / sumexp if stats.zexp is not None else None
    return TokenStats(m + log_s, target, total, entropy, m, log_s)


def whole_vocab(stats: ChunkStats) -> TokenStats:
    """The :class:`TokenStats` of statistics that already cover the whole vocab (one rank)."""
    log_s = torch.log(stats.sumexp)
    entropy = log_s - stats.zexp / stats.sumexp if stats.zexp is not None else None
    return TokenStats(stats.max + log_s, stats.target, stats.sum, entropy, stats.max, log_s)


def token_loss(st: TokenStats, valid: torch.Tensor, spec: LossSpec) -> torch.Tensor:
    """Per-token loss (0 for ignored tokens) from the global statistics."""
    # lse - (1 - eps) z_t - (eps / V) sum z, each term relative to the max (exact for large logits)
    eps = spec.label_smoothing
    loss = st.log_s - (1.0 - eps) * (st.target - st.max)
    if eps > 0:
        loss = loss - eps * (st.sum / spec.vocab_size - st.max)
    if spec.z_loss > 0:
        loss = loss + spec.z_loss * st.lse.square()
    return torch.where(valid, loss, 0.0)


def _on_valid(valid: torch.Tensor | None, coef: torch.Tensor) -> torch.Tensor:
    """``coef`` on valid tokens, exactly 0 on ignored ones: an ignored token's statistics may be
    nan (its logits hold a nan, or are all masked) and ``0 * nan`` would put nan in its gradient."""
    return coef if valid is None else torch.where(valid, coef, 0.0)


def loss_grad_coefs(m: torch.Tensor, log_s: torch.Tensor, gscale: torch.Tensor, spec: LossSpec,
                    valid: torch.Tensor | None = None) -> GradCoefs:
    """Coefficients of the loss' gradient for the per-token upstream scale ``gscale``, given the
    global max ``m`` and ``log S`` of the tokens (``valid``: the non-ignored tokens, whose
    coefficients are exactly 0 otherwise)."""
    a = gscale * (1.0 + 2.0 * spec.z_loss * (m + log_s)) if spec.z_loss > 0 else gscale
    eps = spec.label_smoothing
    return GradCoefs(_on_valid(valid, a * torch.exp(-log_s)), None, gscale * (1.0 - eps),
                     gscale * (eps / spec.vocab_size) if eps > 0 else None)


def logprob_grad_coefs(g_logp: torch.Tensor, g_entropy: torch.Tensor | None, entropy, log_s,
                       valid: torch.Tensor | None = None) -> GradCoefs:
    """Coefficients of the gradient of ``sum_i g_logp_i logp_i + g_entropy_i H_i`` (exactly 0 on
    tokens outside ``valid``)."""
    inv_s = torch.exp(-log_s)
    if g_entropy is None:
        return GradCoefs(_on_valid(valid, -g_logp * inv_s), None, -g_logp, None)
    a, b = -g_logp - g_entropy * entropy, -g_entropy
    return GradCoefs(_on_valid(valid, (a - b * log_s) * inv_s), _on_valid(valid, b * inv_s), -g_logp, None)


def grad_logits(
    x: torch.Tensor,
    local_target: torch.Tensor,
    owned: torch.Tensor,
    shift: torch.Tensor,
    coefs: GradCoefs,
    spec: LossSpec,
    out_dtype: torch.dtype | None = None,
    *,
    col_offset: int | None = None,
) -> torch.Tensor:
    """Backward of one ``[c, V_block]`` block: ``d obj / d x`` given the per-token ``shift`` (the
    global max ``m``) and coefficients (all 0 on ignored tokens). Local, no communication.
    ``col_offset``: as in :func:`local_stats`."""
    if col_offset is not None:
        local_target, owned = block_targets(local_target, owned, col_offset, col_offset + x.shape[-1])
    z = _transform(x, spec)
    u = z - shift.unsqueeze(-1)
    a = coefs.a.unsqueeze(-1)
    factor = a if coefs.b is None else a + coefs.b.unsqueeze(-1) * u
    # a -inf logit has p = 0 and so gradient 0 * a, not 0 * -inf; a nan one (u nan) also 0 * a,
    # which is nan on a valid row (its a is nan, from the nan sum) and 0 on an ignored one (a = 0)
    d = torch.where(u > float("-inf"), torch.exp(u) * factor, a * 0.0)
    if coefs.d is not None:
        d = d - coefs.d.unsqueeze(-1)
    if z.shape[-1] > 0:
        hit = torch.where(owned, coefs.c, 0.0)
        d.scatter_add_(-1, local_target.unsqueeze(-1), -hit.unsqueeze(-1))
    if spec.softcap is not None:
        # an exact 0 (every entry of an ignored row) stays 0 where z is nan: not 0 * (1 - nan^2)
        d = torch.where(d == 0, d, d * (1.0 - (z * (spec.temperature / spec.softcap)).square()))
    if spec.temperature != 1.0:
        d = d * (1.0 / spec.temperature)
    return d.to(out_dtype or x.dtype)


# ---------------------------------------------------------------------------------------------
# Reductions shared by both ops: value of the reduced loss and the per-token upstream gradient.

REDUCTIONS = ("mean", "sum", "none")


def token_slices(n: int, chunks: int, *, exact: bool = False, tile: int = 1) -> list[slice]:
    """Contiguous slices of ``n`` rows in ``chunks`` near-equal parts (``torch.tensor_split`` sizes):
    at most ``n`` of them, or exactly ``chunks`` (some empty) with ``exact``. ``tile``: the parts
    are whole tiles of ``tile`` rows (the last one cut at ``n``), at most one per tile."""
    if tile > 1:
        return [slice(s.start * tile, min(s.stop * tile, n)) for s in token_slices(-(-n // tile), chunks)]
    k = max(1, int(chunks) if exact else min(int(chunks), max(n, 1)))
    if k == 1:  # one chunk (every call of the fast point)
        return [slice(0, n)]
    q, r = divmod(n, k)
    bounds = [0]
    for i in range(k):
        bounds.append(bounds[-1] + q + (1 if i < r else 0))
    return [slice(bounds[i], bounds[i + 1]) for i in range(k)]


def reduce(per_token: torch.Tensor, n_valid: torch.Tensor, reduction: str) -> torch.Tensor:
    if reduction == "none":
        return per_token
    total = per_token.sum()
    # the count in the loss' dtype: a float64 divisor (a given count) must not promote the loss
    return total / n_valid.to(total.dtype) if reduction == "mean" else total


def token_weights(valid: torch.Tensor, n_valid: torch.Tensor | None, reduction: str,
                  dtype: torch.dtype) -> torch.Tensor:
    """``r_i = d(output) / d(loss_i)`` of the reduced output: ``1 / n_valid`` for mean, 1 for sum and
    none (``n_valid`` is not read there); exactly 0 on ignored tokens (all ignored: loss 0/0 as
    ``F.cross_entropy``, gradient 0, not nan; a given ``n_valid`` of 0 with valid tokens: inf, the
    derivative of the infinite mean)."""
    if reduction == "mean":  # two launches, where a 0/1 weight divided by the count takes four
        return torch.where(valid, torch.reciprocal(n_valid.to(dtype)), 0.0)
    return valid.to(dtype)


def unit_loss_coefs(st: TokenStats, valid: torch.Tensor, n_valid: torch.Tensor | None, reduction: str,
                    spec: LossSpec) -> GradCoefs:
    """The loss' :class:`GradCoefs` for an upstream gradient of 1: ``loss_grad_coefs(m, log S, r)``
    with ``r`` the :func:`token_weights`. Every coefficient is linear in the upstream gradient, so
    the forward makes these and the backward only scales them (:func:`scale_coefs`): one small
    kernel per coefficient between the backward's start and its gradient pass."""
    return loss_grad_coefs(st.max, st.log_s, token_weights(valid, n_valid, reduction, st.max.dtype), spec, valid)


def loss_stats_grad_(x: torch.Tensor, target: torch.Tensor, n_valid: torch.Tensor | None, reduction: str,
                     spec: LossSpec, *, with_top1: bool = False):
    """Step 1, the loss and the backward in one go, for a rank that holds the WHOLE vocab (nothing
    to exchange between them) and one chunk of the call's tokens. ``x [c, V]`` is overwritten with
    ``d(sum_i r_i loss_i) / d x`` (in ``x``'s dtype), the loss' gradient for an upstream gradient
    of 1: ``r`` are the :func:`token_weights` (``1 / n_valid`` on the valid tokens for mean, 1 for
    sum and none; ``n_valid``, the call's valid-token count, is read for mean only). ``target
    [c]``: the global ids (an id outside ``[0, V)`` owns no logit, as :func:`local_targets` has
    it). Returns the statistics and the per-token loss (0 on ignored tokens; :func:`token_loss`),
    and with ``with_top1`` each row's greedy token read before the gradient is written
    (:func:`vparallel_ce.top1.local` of ``x``, a whole shard at column 0).

    Everything per token is made from the row in the one kernel of the Triton version (no
    kernels for the target maps, the weights or the loss): it reads each row twice (the second
    time mostly from cache) and writes it once."""
    best = top1.local(x, 0) if with_top1 else None
    local_t, owned, valid = local_targets(target, 0, x.shape[-1], spec.ignore_index)
    st = local_stats(x, local_t, owned, spec)
    coefs = loss_grad_coefs(st.max, torch.log(st.sumexp), token_weights(valid, n_valid, reduction, st.max.dtype),
                            spec, valid)
    x.copy_(grad_logits(x, local_t, owned, st.max, coefs, spec))
    loss = token_loss(whole_vocab(st), valid, spec)
    return (st, loss, best) if with_top1 else (st, loss)


def scale_rows(x: torch.Tensor, g: torch.Tensor, out: torch.Tensor | None = None, *,
               target: torch.Tensor | None = None, ignore_index: int = -100) -> torch.Tensor:
    """``g * x`` rounded once into ``out``'s dtype (``x``'s by default; ``out=x``: in place): the
    product is formed in fp32 (fp64 for fp64), so a ``g`` such as 1/3 is not rounded to bf16 first.
    ``g``: a scalar tensor, or one value per row of ``x [c, n]``. ``target`` (``[c]``): a row whose
    target is ``ignore_index`` keeps its value, whatever ``g`` -- an ignored token's row of a
    gradient made for an upstream gradient of 1 holds no contribution to scale (0, or nan from a
    non-finite weight), as ``F.cross_entropy`` leaves an ignored row's gradient even for a nan or
    inf upstream gradient."""
    cdt = compute_dtype(x.dtype)
    g = g.to(cdt)
    g = g.reshape(-1, 1) if g.dim() else g
    if target is not None:
        g = torch.where((target != ignore_index).reshape(-1, 1), g, torch.ones((), dtype=cdt, device=x.device))
    prod = x.to(cdt) * g
    if out is None:
        return prod.to(x.dtype)
    return out.copy_(prod)


def scale_coefs(coefs: GradCoefs, grad_out: torch.Tensor) -> GradCoefs:
    """Coefficients for 1 -> for the upstream gradient ``grad_out`` (a scalar for mean/sum, the
    chunk's per-token gradients ``[c]`` for none). A coefficient that is exactly 0 (an ignored
    token's) stays 0 whatever the upstream gradient, nan included, as ``F.cross_entropy``'s
    gradient of an ignored token is 0."""
    g = grad_out.to(coefs.a.dtype)
    return GradCoefs(*(None if k is None else torch.where(k == 0, k, k * g) for k in coefs))
