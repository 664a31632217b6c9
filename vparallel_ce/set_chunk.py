r"""One chunk of a sampling-set call on this shard: its rows of the set mapped to the shard's
columns (:class:`SetRows`), and the loss ops' per-chunk steps (:mod:`vparallel_ce.stats`) over the
set's logits (:class:`SetChunk`): ``[c, K_loc]`` kept ids' logits, ``-inf`` off them, beside the
whole-vocabulary rows' ``[f, V_loc]`` logits, whose masks' thresholds apply here. The autograd
Functions that walk the chunks are :mod:`vparallel_ce.sampling_set`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from . import kernels
from .call import Call
from .sampling_masks import SamplingMasks, thresholds
from .stats import ChunkStats, GradCoefs, combine, grad_logits, local_stats, logprob_grad_coefs, scaled_logits

__all__ = ["SetRows", "SetChunk", "chunk_outputs", "set_grad_coefs"]


@dataclass
class SetRows:
    """One chunk's rows of the set, mapped to this shard. ``cols [c, K_loc]``: the local column of
    each kept id this shard owns (first in each row; 0 where none); ``kept``: which are;
    ``tpos``/``t_owned``: the target's position among them and whether this shard owns it;
    ``in_set``: a valid token whose target is in its set (any rank's part); ``full``: the rows (of
    the chunk) over the whole vocab, valid, with ``full_t``/``full_owned`` their targets here."""

    cols: torch.Tensor
    kept: torch.Tensor
    tpos: torch.Tensor
    t_owned: torch.Tensor
    valid: torch.Tensor
    in_set: torch.Tensor
    full: torch.Tensor
    full_t: torch.Tensor
    full_owned: torch.Tensor

    @classmethod
    def of(cls, ids: torch.Tensor, target: torch.Tensor, call: Call) -> "SetRows":
        return cls.of_chunks(ids, target, [target.shape[0]], call)[0]

    @classmethod
    def of_chunks(cls, ids: torch.Tensor, target: torch.Tensor, heights: list[int], call: Call) -> list["SetRows"]:
        """The rows of consecutive chunks of ``heights`` rows of ``ids [n, K]`` / ``target [n]``,
        made for all of them at once (with the kernels one launch, :func:`vparallel_ce.kernels.set_rows_on_shard`;
        else the torch steps over all the rows) and one host read of the chunks' widths, which
        waits for these steps alone rather than for kernels queued between chunks. Each chunk's
        tensors are views of the call's: no per-chunk steps but a whole-vocabulary row's."""
        lay = call.layout
        made = kernels.set_rows_on_shard(ids, target, heights, lay.offset, lay.local_size, call.spec.ignore_index,
                                         call.kernels)
        cols, kept, tpos, (t_owned, valid, in_set, full_row), sizes = made or _rows_torch(ids, target, heights, call)
        k_max = max((k for k, _ in sizes), default=0)
        if 2 * k_max <= cols.shape[1]:  # (the kernel's rows are K wide: kept for the backward, keep K_loc)
            cols, kept = cols[:, :k_max].contiguous(), kept[:, :k_max].contiguous()
        none = torch.empty((0,), dtype=torch.int64, device=ids.device)
        out, lo = [], 0
        for height, (k_loc, n_full) in zip(heights, sizes):
            sl = slice(lo, lo + height)
            lo += height
            full, full_t, full_owned = none, none, valid[:0]
            if n_full:
                full = full_row[sl].nonzero()[:, 0]
                full_t = target[sl][full] - lay.offset
                full_owned = (full_t >= 0) & (full_t < lay.local_size)
                full_t = full_t.clamp(0, max(lay.local_size - 1, 0))
            out.append(cls(cols[sl, :k_loc], kept[sl, :k_loc], tpos[sl], t_owned[sl], valid[sl], in_set[sl], full,
                           full_t, full_owned))
        return out

    def over_shard(self, width: int) -> "SetRows":
        """These rows' sets over the whole ``width``-column shard (the batch-invariant mode's, whose
        row sums must run over a width fixed by the shard, not by the chunk's largest set):
        ``kept [c, width]`` marks the kept ids (every column of a whole-vocabulary row), ``tpos``
        the target's local column; no rows apart (``full`` empty) and no ``cols``."""
        c, dev = self.valid.shape[0], self.valid.device
        hits = torch.zeros((c, width), dtype=torch.int32, device=dev)
        hits.scatter_add_(1, self.cols, self.kept.to(torch.int32))  # (a column not kept adds 0)
        kept = hits > 0
        kept[self.full] = True
        tcol = self.cols.gather(1, self.tpos.unsqueeze(1)).squeeze(1) if self.cols.shape[1] else \
            torch.zeros_like(self.tpos)
        t_owned = self.t_owned.clone()
        tcol[self.full], t_owned[self.full] = self.full_t, self.full_owned
        none = self.full[:0]
        return replace(self, cols=self.cols[:, :0], kept=kept, tpos=tcol, t_owned=t_owned, full=none,
                       full_t=none, full_owned=t_owned[:0])


def _rows_torch(ids: torch.Tensor, target: torch.Tensor, heights: list[int], call: Call):
    """The torch steps of :meth:`SetRows.of_chunks` over all the rows (what the kernel of
    :mod:`vparallel_ce.kernels.set_rows` does in one launch): ``(cols, kept, tpos, (t_owned, valid,
    in_set, full), sizes)``, ``cols``/``kept`` as wide as the chunks' largest ``K_loc``."""
    lay = call.layout
    valid = target != call.spec.ignore_index
    full_row = (ids < 0).all(-1) & valid
    local = ids - lay.offset
    owned = (ids >= 0) & (local >= 0) & (local < lay.local_size) & (valid & ~full_row).unsqueeze(-1)
    count = owned.sum(-1)
    widths, lo = [], 0
    for height in heights:
        part = count[lo:lo + height]
        most = part.amax() if part.numel() else count.new_zeros(())
        widths.append(torch.stack([most, full_row[lo:lo + height].sum()]))
        lo += height
    sizes = torch.stack(widths).tolist()
    k_max = max((k for k, _ in sizes), default=0)
    is_t = (ids == target.unsqueeze(-1)) & (ids >= 0)
    in_set = valid & (full_row | is_t.any(-1))
    order = owned.to(torch.int8).sort(dim=-1, descending=True, stable=True).indices[:, :k_max]
    kept = owned.gather(1, order)
    cols = torch.where(kept, local.gather(1, order), 0)
    t_here = is_t.gather(1, order) & kept
    tpos = t_here.to(torch.uint8).argmax(-1) if k_max else torch.zeros_like(target)
    return cols, kept, tpos, (t_here.any(-1), valid, in_set, full_row), sizes


class SetChunk:
    """A chunk's set logits ``[c, K_loc]`` (``-inf`` off the kept ids) and whole-vocab rows'
    logits ``[f, V_loc]`` (``-inf`` below their mask's threshold), in the logits' dtype."""

    def __init__(self, rows: SetRows, set_x: torch.Tensor, full_x: torch.Tensor | None, ops=None, *,
                 masked: bool = False):
        self.rows = rows
        # (masked: ``set_x`` is already -inf off the kept ids, as a forward's kept for its backward)
        self.set_x = set_x if masked else set_x.where(rows.kept, float("-inf"))
        self.full_x = full_x
        # the row steps of the call's backend (one launch each with the kernels), or the batch-invariant
        # mode's (over whole shard rows); None: the torch reference
        self.local_stats = local_stats if ops is None else ops.local_stats
        self.grad_logits = grad_logits if ops is None else ops.grad_logits

    def masked(self, call: Call, masks: SamplingMasks, tau: torch.Tensor | None):
        """Apply the masks' thresholds to the whole-vocab rows (made here in forward: ``tau``
        None), returning them."""
        if self.full_x is None or self.full_x.shape[0] == 0:
            return tau
        z = scaled_logits(self.full_x, call.spec)
        if tau is None:
            tau = thresholds(z, masks, call.layout)
        self.full_x = self.full_x.masked_fill(z < tau.unsqueeze(-1), float("-inf"))
        return tau

    def stats(self, call: Call) -> ChunkStats:
        r = self.rows
        st = self.local_stats(self.set_x, r.tpos, r.t_owned, call.spec)
        if self.full_x is not None and r.full.numel():
            st_f = local_stats(self.full_x, r.full_t, r.full_owned, call.spec)
            st = ChunkStats(*(None if a is None else a.index_copy(0, r.full, b) for a, b in zip(st, st_f)))
        return st

    def grads(self, call: Call, m: torch.Tensor, coefs: GradCoefs):
        """``(d set_x [c, K_loc], d full_x [f, V_loc] or None)`` in the compute dtype."""
        r, cdt = self.rows, m.dtype
        d_set = self.grad_logits(self.set_x, r.tpos, r.t_owned, m, coefs, call.spec, cdt)
        d_full = None
        if self.full_x is not None and r.full.numel():
            sub = GradCoefs(*(None if k is None else k[r.full] for k in coefs))
            d_full = grad_logits(self.full_x, r.full_t, r.full_owned, m[r.full], sub, call.spec, cdt)
        return d_set, d_full


def _outputs(st, rows: SetRows):
    # in its set: z_t - m - log S; a valid token whose target is not: -inf; an ignored token: 0
    logp = torch.where(rows.in_set, (st.target - st.max) - st.log_s, torch.where(rows.valid, float("-inf"), 0.0))
    entropy = torch.where(rows.valid, st.entropy, 0.0) if st.entropy is not None else torch.zeros_like(st.lse)
    return logp, entropy


def set_grad_coefs(g_logp, g_entropy, rows: SetRows, entropy, log_s, call: Call) -> GradCoefs:
    """As the full-vocabulary op's; a target outside its set (check=False) takes no log-prob gradient."""
    g_lp = torch.zeros_like(log_s) if g_logp is None else torch.where(rows.in_set, g_logp.to(log_s.dtype), 0.0)
    g_h = None
    if g_entropy is not None and call.spec.entropy:
        g_h = torch.where(rows.valid, g_entropy.to(log_s.dtype), 0.0)
    return logprob_grad_coefs(g_lp, g_h, entropy, log_s, rows.valid)


def chunk_outputs(ch: SetChunk, sr: SetRows, call: Call, masks: SamplingMasks):
    """One chunk's ``(logp, entropy)`` over its sets (the masks applied, the statistics joined over
    the group) and what its backward reads again: ``(rows, mask threshold, max, log-sum, entropy)``."""
    tau = ch.masked(call, masks, None)
    st = combine(ch.stats(call), call.layout, rank_ordered=call.batch_invariant)
    sr.in_set = sr.in_set & (st.target != float("-inf"))  # a target the masks drop: p = 0
    logp, ent = _outputs(st, sr)
    return logp, ent, (sr, tau, st.max, st.log_s, ent)
