r"""The per-chunk math of vocab-parallel cross-entropy, written once for every op and schedule.

Notation for one token ``i`` (a row of a chunk). ``x`` are the raw logits of this rank's vocab shard
(ids ``[o, o + V_loc)`` of the global vocab ``[0, V)``), ``t`` the global target id, ``s`` the soft
cap, ``eps`` the label smoothing and ``zl`` the z-loss weight::

    z_j   = s * tanh(x_j / s)             (z = x without softcap)
    lse   = log sum_{j<V} exp(z_j)         (over the GLOBAL vocab)
    loss  = lse - (1 - eps) * z_t - (eps / V) * sum_j z_j + zl * lse**2      (0 for ignored tokens)

This is ``F.cross_entropy(z, t, label_smoothing=eps)`` per token, plus the PaLM z-loss.

Forward, per chunk -- the only data that crosses ranks are four floats per token:

1. local pass (one read of the chunk): ``m_r = max_j z_j``, ``S_r = sum_j exp(z_j - m_r)``,
   ``z_t`` if this rank owns ``t`` (else 0), ``sum_j z_j`` (with smoothing), ``owned`` in {0, 1};
2. ``m = all_reduce_MAX(m_r)``;
3. ``all_reduce_SUM([S_r * exp(m_r - m), z_t, sum z, owned])`` -> ``lse = m + log S``.
   ``owned`` summed over the group must be 1 for every valid token: that is the out-of-range
   target check, at no extra collective.

Backward, per chunk, with ``g_i`` = d(total)/d(loss_i) (``0`` for ignored tokens) -- local only::

    dL/dz_j = g_i * ( p_j * (1 + 2 zl lse) - eps / V - (1 - eps) [j == t] ),  p_j = exp(z_j - lse)
    dL/dx_j = dL/dz_j * (1 - (z_j / s)**2)        (softcap; identity without)

The same ``(m, S)`` pairs merge across vocab blocks of one rank (:func:`merge`), which is how the
vocab-blocked schedule of ``linear_cross_entropy`` builds its statistics before the one exchange.

Statistics are fp32 whatever the logits' dtype (fp64 for fp64 logits, so tests can check to 1e-10).
CUDA kernels in ``vparallel_ce.kernels`` are drop-ins for :func:`local_stats` and
:func:`grad_logits` with the same signatures.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from . import comm

__all__ = ["LossSpec", "ChunkStats", "TokenStats", "local_stats", "merge", "combine", "token_loss", "grad_logits"]


@dataclass(frozen=True)
class LossSpec:
    """The loss' mathematical options (``F.cross_entropy`` names), and the GLOBAL vocab size."""

    vocab_size: int
    ignore_index: int = -100
    label_smoothing: float = 0.0
    z_loss: float = 0.0
    softcap: float | None = None


class ChunkStats(NamedTuple):
    """Per-token statistics of one rank's (part of the) vocab; all ``[c]`` in the compute dtype."""

    max: torch.Tensor  # m_r = max_j z_j  (-inf for an empty shard)
    sumexp: torch.Tensor  # S_r = sum_j exp(z_j - m_r)
    target: torch.Tensor  # z_t where this shard owns t, else 0
    sum: torch.Tensor  # sum_j z_j (zeros unless label smoothing)
    owned: torch.Tensor  # 1 where this shard owns t, else 0


class TokenStats(NamedTuple):
    """Per-token statistics over the GLOBAL vocab (identical on every rank of the group)."""

    lse: torch.Tensor
    target: torch.Tensor
    sum: torch.Tensor
    owned: torch.Tensor


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Statistics are fp32, except for fp64 inputs (kept exact for reference tests)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def local_targets(target: torch.Tensor, offset: int, local_size: int, ignore_index: int):
    """Map global ids to this shard: ``(local index clamped into range, owned mask, valid mask)``."""
    valid = target != ignore_index
    local = target - offset
    owned = valid & (local >= 0) & (local < local_size)
    return local.clamp(0, max(local_size - 1, 0)), owned, valid


def _transform(x: torch.Tensor, spec: LossSpec) -> torch.Tensor:
    z = x.to(compute_dtype(x.dtype))
    if spec.softcap is not None:
        z = torch.tanh(z / spec.softcap) * spec.softcap
    return z


def local_stats(x: torch.Tensor, local_target: torch.Tensor, owned: torch.Tensor, spec: LossSpec) -> ChunkStats:
    """Step 1: one pass over a ``[c, V_block]`` block of logits (any float dtype)."""
    z = _transform(x, spec)
    c, width = z.shape
    if width == 0:
        neg_inf = torch.full((c,), float("-inf"), dtype=z.dtype, device=z.device)
        zeros = torch.zeros((c,), dtype=z.dtype, device=z.device)
        return ChunkStats(neg_inf, zeros, zeros, zeros, owned.to(z.dtype))
    m = z.amax(dim=-1)
    sumexp = torch.exp(z - m.unsqueeze(-1)).sum(dim=-1)
    picked = z.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
    tgt = torch.where(owned, picked, torch.zeros_like(picked))
    total = z.sum(dim=-1) if spec.label_smoothing > 0 else torch.zeros_like(m)
    return ChunkStats(m, sumexp, tgt, total, owned.to(z.dtype))


def _rescale(sumexp: torch.Tensor, m_from: torch.Tensor, m_to: torch.Tensor) -> torch.Tensor:
    # exp(-inf - m) is 0 as wanted; guard only the -inf - (-inf) = nan case (both empty).
    return torch.where(sumexp > 0, sumexp * torch.exp(m_from - m_to), torch.zeros_like(sumexp))


def merge(a: ChunkStats, b: ChunkStats) -> ChunkStats:
    """Statistics of the union of two disjoint vocab blocks of the same tokens (online softmax)."""
    m = torch.maximum(a.max, b.max)
    sumexp = _rescale(a.sumexp, a.max, m) + _rescale(b.sumexp, b.max, m)
    return ChunkStats(m, sumexp, a.target + b.target, a.sum + b.sum, a.owned + b.owned)


def combine(stats: ChunkStats, layout) -> TokenStats:
    """Steps 2-3: join the ranks' statistics -- one all-reduce MAX and one fused all-reduce SUM."""
    m = comm.all_reduce_max_(stats.max.clone(), layout.group)
    packed = torch.stack([_rescale(stats.sumexp, stats.max, m), stats.target, stats.sum, stats.owned])
    comm.all_reduce_sum_(packed, layout.group)
    sumexp, target, total, owned = packed.unbind(0)
    return TokenStats(m + torch.log(sumexp), target, total, owned)


def token_loss(st: TokenStats, valid: torch.Tensor, spec: LossSpec) -> torch.Tensor:
    """Per-token loss (0 for ignored tokens) from the global statistics."""
    eps = spec.label_smoothing
    loss = st.lse - (1.0 - eps) * st.target
    if eps > 0:
        loss = loss - (eps / spec.vocab_size) * st.sum
    if spec.z_loss > 0:
        loss = loss + spec.z_loss * st.lse.square()
    return torch.where(valid, loss, torch.zeros_like(loss))


def grad_logits(
    x: torch.Tensor,
    local_target: torch.Tensor,
    owned: torch.Tensor,
    lse: torch.Tensor,
    gscale: torch.Tensor,
    spec: LossSpec,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Backward of one ``[c, V_block]`` block: ``d total / d x`` given the global ``lse`` and the
    per-token upstream scale ``gscale`` (``0`` on ignored tokens). Local, no communication."""
    z = _transform(x, spec)
    coef = gscale
    if spec.z_loss > 0:
        coef = gscale * (1.0 + 2.0 * spec.z_loss * lse)
    d = torch.exp(z - lse.unsqueeze(-1)) * coef.unsqueeze(-1)
    eps = spec.label_smoothing
    if eps > 0:
        d = d - (gscale * (eps / spec.vocab_size)).unsqueeze(-1)
    if z.shape[-1] > 0:
        hit = torch.where(owned, gscale * (1.0 - eps), torch.zeros_like(gscale))
        d.scatter_add_(-1, local_target.unsqueeze(-1), -hit.unsqueeze(-1))
    if spec.softcap is not None:
        d = d * (1.0 - (z / spec.softcap).square())
    return d.to(out_dtype or x.dtype)


# ---------------------------------------------------------------------------------------------
# Reductions shared by both ops: value of the reduced loss and the per-token upstream gradient.

REDUCTIONS = ("mean", "sum", "none")


def token_slices(n: int, chunks: int, *, exact: bool = False) -> list[slice]:
    """Contiguous slices of ``n`` rows in ``chunks`` near-equal parts (``torch.tensor_split`` sizes):
    at most ``n`` of them, or exactly ``chunks`` (some empty) with ``exact``."""
    k = max(1, int(chunks) if exact else min(int(chunks), max(n, 1)))
    q, r = divmod(n, k)
    bounds = [0]
    for i in range(k):
        bounds.append(bounds[-1] + q + (1 if i < r else 0))
    return [slice(bounds[i], bounds[i + 1]) for i in range(k)]


def reduce(per_token: torch.Tensor, n_valid: torch.Tensor, reduction: str) -> torch.Tensor:
    if reduction == "none":
        return per_token
    total = per_token.sum()
    return total / n_valid if reduction == "mean" else total


def token_grad_scale(grad_out: torch.Tensor, valid: torch.Tensor, n_valid, reduction: str, dtype) -> torch.Tensor:
    """``g_i = d(output)/d(loss_i) * grad_out`` for each token (0 on ignored tokens)."""
    v = valid.to(dtype)
    if reduction == "none":
        return grad_out.reshape(-1).to(dtype) * v
    g = grad_out.to(dtype)
    if reduction == "mean":
        g = g / n_valid
    return v * g
