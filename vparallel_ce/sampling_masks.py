r"""Trainer-side sampling masks: the kept set of a rollout sampled with ``top_k`` / ``top_p`` /
``min_p``, rebuilt from the logits the log-prob op sees, vocab-parallel and exact.

With ``z = logits / T`` over the GLOBAL vocab and ``m = max_j z_j``, the masks apply in the order
of vLLM's sampler (temperature, then min-p, then top-k, then top-p over what is left). Each keeps
every entry at or above a per-token value, so their intersection is one threshold ``tau`` and the
kept set is ``S = {j : z_j >= tau}``:

* ``min_p``: keep ``p_j >= min_p * p_max``, i.e. ``z_j >= m + log(min_p)``;
* ``top_k``: keep ``z_j >=`` the ``k``-th largest value -- every entry tied with the ``k``-th is
  kept (vLLM's comparison ``logits < kth value`` masks only what is strictly below it);
* ``top_p``: over ``S_0``, the entries the two masks above keep, with ``q_j = e^{z_j} / sum_{S_0}
  e^{z}``, keep ``j`` iff the mass of the entries STRICTLY above it is below ``p``:
  ``sum_{i in S_0, z_i > z_j} q_i < p``. Without ties at the boundary this is vLLM's rule (its
  ascending cumulative sum drops ``j`` iff the mass up to and including ``j`` is at most
  ``1 - p``); where entries tie at the boundary vLLM's choice depends on its sort's order of ties,
  and this rule keeps all of them. The most likely entry is always kept.

``top_p = 1``, ``min_p = 0`` and ``top_k >= V`` keep everything (as vLLM skips them). Masses are
summed in float64 from the compute-dtype logits; an entry within rounding of a boundary may fall
on the other side of it than in an engine that sums in fp32.

**What crosses ranks**, per token chunk: with ``min_p``, an all-reduce MAX of the chunk's maxima;
with ``top_k``, one all-gather of each rank's local top-``k`` (:func:`vparallel_ce.vocab_topk.global_topk`);
with ``top_p``, an all-reduce SUM of the kept mass of ``S_0`` and all-gathers of the ranks' local
top-``k'`` for ``k' = top_k`` (or 64 without it), doubled until the boundary lies among the
candidates -- usually one round; every rank sees the same candidates, so all take the same number.
No ``[c, V]`` tensor crosses.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import comm
from .layout import VocabLayout
from .vocab_topk import global_topk

__all__ = ["SamplingMasks", "thresholds"]

FIRST_TOP_P_CANDIDATES = 64  # per rank, before doubling: typical nucleus sizes at p <= 0.95


@dataclass(frozen=True)
class SamplingMasks:
    """The masks of a call (None or a no-op value: that mask keeps everything)."""

    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None

    def active(self, vocab_size: int) -> "SamplingMasks":
        """The masks that remove anything at a vocab of ``vocab_size``."""
        return SamplingMasks(self.top_k if self.top_k is not None and self.top_k < vocab_size else None,
                             self.top_p if self.top_p is not None and self.top_p < 1.0 else None,
                             self.min_p if self.min_p is not None and self.min_p > 0.0 else None)


def thresholds(z: torch.Tensor, masks: SamplingMasks, layout: VocabLayout) -> torch.Tensor:
    """Per row of ``z [c, V_loc]`` (this rank's shard of the temperature-scaled logits, the compute
    dtype) the value ``tau`` with kept set ``{j : z_j >= tau}``: ``-inf`` keeps everything. The same
    on every rank; every rank must call it with the same masks and rows."""
    masks = masks.active(layout.vocab_size)
    c = z.shape[0]
    tau = torch.full((c,), float("-inf"), dtype=z.dtype, device=z.device)
    sel = torch.where(torch.isnan(z), float("inf"), z)  # a nan row keeps all: its log-probs are nan
    if masks.min_p is not None or masks.top_p is not None:
        local_max = sel.amax(-1) if z.shape[1] else tau.clone()
        m = comm.all_reduce_max_(local_max, layout.group)
    if masks.min_p is not None:
        tau = torch.maximum(tau, m + math.log(masks.min_p))
    if masks.top_k is not None:
        tau = torch.maximum(tau, global_topk(sel, masks.top_k, layout).values[:, -1])
    if masks.top_p is not None:
        tau = _top_p(sel, tau, m, masks.top_p, masks.top_k, layout)
    return tau


def _top_p(z, tau, m, p: float, top_k: int | None, layout: VocabLayout) -> torch.Tensor:
    """The top-p threshold over ``S_0 = {z >= tau}`` (the module's rule), from the global top-``k'``
    candidates: every mass "strictly above a candidate" is exact, since all entries larger than a
    candidate are candidates too."""
    wide = torch.float64
    shift = torch.where(torch.isfinite(m), m, 0.0).to(wide)
    kept0 = z >= tau.unsqueeze(-1)
    mass0 = torch.where(kept0, torch.exp(z.to(wide) - shift.unsqueeze(-1)), 0.0).sum(-1)
    mass0 = comm.all_reduce_sum_(mass0, layout.group)
    k = min(top_k or FIRST_TOP_P_CANDIDATES, layout.vocab_size)
    while True:
        cand = global_topk(z, k, layout).values  # [c, k], descending
        in0 = cand >= tau.unsqueeze(-1)
        q = torch.where(in0, torch.exp(cand.to(wide) - shift.unsqueeze(-1)), 0.0) / mass0.unsqueeze(-1)
        cum = q.cumsum(-1)
        # entries strictly above candidate j: the first position of its value in the descending row
        neg = (-cand).contiguous()
        first = torch.searchsorted(neg, neg, right=False)
        above = torch.where(first > 0, cum.gather(1, (first - 1).clamp(min=0)), 0.0)
        keep = in0 & (above < p)
        # decided: a candidate of S_0 is dropped (the boundary is among them), S_0 is exhausted (its
        # smallest member is a candidate), or every entry is a candidate
        done = (in0 & ~keep).any(-1) | ~in0[:, -1] | (k >= layout.vocab_size)
        if bool(done.all()):
            break
        k = min(2 * k, layout.vocab_size)
    lowest_kept = torch.where(keep, cand, float("inf")).amin(-1)
    return torch.maximum(tau, torch.where(keep.any(-1), lowest_kept, tau))
