r"""Log-probs over the rollout's sampling set: ``token_logprobs(..., support=ids)`` and the
sampling masks (``top_k`` / ``top_p`` / ``min_p``), for logits or hidden states sharded along the vocab.

Per token with set ``S`` (``z = logits / T``)::

    logp = z_t - log sum_{j in S} e^{z_j},     H = -sum_{j in S} p_j log p_j,   p_j = e^{z_j} / sum_S e^{z}

and ``d/dz_j`` as the full-vocabulary op's with ``p`` renormalised over ``S`` and 0 off it. This is
the math of :mod:`vparallel_ce.stats` over the set's logits with every other entry ``-inf`` (a
masked entry), so the per-chunk steps are the loss ops' own (:func:`~vparallel_ce.stats.local_stats`,
:func:`~vparallel_ce.stats.combine`, :func:`~vparallel_ce.stats.grad_logits`) on a ``[c, K_loc]``
matrix of the kept ids this rank owns instead of its ``[c, V_loc]`` logits (one chunk's rows and
steps: :mod:`vparallel_ce.set_chunk`; the autograd Functions that walk the chunks: here).

**The set.** ``support [N, K]`` int64 GLOBAL ids padded with ``-1`` (a row of ``-1``: the whole
vocabulary), the same on every rank. Rule for the target: it must be one of its row's ids (a
token sampled from the set is); with ``check=True`` a valid token whose target is not is an
:class:`~vparallel_ce.InvalidInputError` naming the token, raised on every rank; with
``check=False`` its ``logp`` is ``-inf`` (its probability under the set) with no gradient. Ids
outside ``[-1, V)`` and an id repeated in a row are errors too (``check=True``). The masks build
the set from the logits instead (:mod:`vparallel_ce.sampling_masks`); a call takes one or the other.

**What crosses ranks.** Each rank gathers the logits of the ids in its shard (``-inf`` elsewhere);
per token chunk the statistics ride on the full op's two all-reduces (MAX, SUM). The ranks agree
on the set's ids in the call's one exchange (a position-sensitive checksum); the values are
checked after it, on every rank alike. The masks add their own exchanges (their module).

**The linear op** needs only the kept ids' logits. Per chunk, with ``K_loc`` the most kept ids
any row has in this shard, :func:`gathers` picks the mode: where ``GATHER_RATIO * K_loc <= V_loc``
the gather mode takes each token's own weight rows (:class:`~vparallel_ce.kernels.GatheredRows` of
the call's kernel backend: on a GPU the Triton kernels of :mod:`vparallel_ce.kernels.gathered_rows`,
which never make the ``[c, K_loc, H]`` rows -- the pairs of all the gather mode's chunks sorted
by weight row once, in forward, and kept for ``dW``; the logits of all those chunks in one pass
over them (a row read from memory once, by its first pairs), ``dh`` per (token, block of ``H``),
and ``dW`` once for all the chunks, after the last, one program per (weight row, block of ``H``)
that writes the row (zeros where it has no pairs: no fill of its own), no atomics; elsewhere the
torch version, :mod:`vparallel_ce.gathered_rows`, a chunk at a time); else the GEMM mode: one GEMM over
the shard (``O(c V_loc H)``) and a gather of its columns, kept for the backward, which then walks
vocab blocks over all the GEMM mode's tokens at once (:func:`~vparallel_ce.set_gemm.gemm_set_grads`: the ``dh`` and
``dW`` GEMMs of the full op, ``dW`` written once per block; three GEMMs per logit in all).

The rule, per kept pair against per logit of the GEMM mode (three GEMMs, ``3 x 2H`` FLOPs, ~40 ps
at ``H = 4096`` on an H100, the full op's measured cost): the kernels read one weight row from
memory for ``dh`` (``2H`` bytes) and one hidden row twice (logits, ``dW``; the weight rows
themselves about once per call), from cache where the hidden states fit it. That is ~4.8 ns a pair
with the hidden rows in cache and ~8.2 ns without (three reads from memory), a break-even
``V_loc / K_loc`` between ~110 and ~210: :data:`GATHER_RATIO` = 128
(``python -m launch.bench.rollout --set-modes auto,gather,gemm --ks ...`` times both modes around it).
Token chunks follow the mode (:func:`set_chunks`). The modes keep their ``[c, K_loc]`` logits from
the forward for the backward (no second gather or GEMM); with the kernels the gather mode holds
~40 bytes per kept pair of the whole call at once (logits, ids, gradient, the sort), and with
sequence parallelism every chunk's gathered hidden rows (the group's ``[N, H]``) and, in backward,
their fp32 partial ``dh`` until the GEMM mode's walk is done (a rank's modes are its own: the
reduce-scatters all follow it, in chunk order, on every rank). Rows with the
whole vocabulary (``-1`` rows, or the masks) take the GEMM. The rule reads two integers per chunk
on the host, all of them at once before the first chunk's kernels: every chunk's rows of the set
are mapped to the shard in one pass over the call's rows (:meth:`~vparallel_ce.set_chunk.SetRows.of_chunks`,
one launch with the kernels; each chunk's tensors are views of the call's), as the values check is
one (:func:`check_support_values`), so the host's small steps do not grow with the set or the
chunks; the set's row statistics and gradient are the call's backend's (one launch each per chunk
with the kernels). The GEMM mode's backward reads its vocab blocks' bounds in its sorted entries, once.

**Batch invariance** (``batch_invariant=True``, with ``support``): the gather mode's and the set
matrix's widths follow the chunk's largest set, so a row's sums would too. This mode takes the
whole shard's logits instead (the mode's own GEMM, :func:`vparallel_ce.gemm.logits`), masked to
each row's set (``-inf`` off it, :meth:`vparallel_ce.set_chunk.SetRows.over_shard`), through the
mode's row steps over the shard's fixed width; the gradient is the shard's ``[c, V_loc]`` and ``dh``
the mode's GEMM. It costs what the full-vocabulary op costs. The masks (``top_k`` / ``top_p`` / ``min_p``) are refused with
it: their thresholds come from sums over the vocabulary and the ranks, and from a candidate count
that a chunk's rows share, in no fixed order (:mod:`vparallel_ce.sampling_masks`).

Not here: ``torch.compile`` (refused; call the op outside the compiled region).
"""

from __future__ import annotations

import torch

from .call import Call
from .chunk_walk import Rows, invariant_dh, sum_dh_over_ranks
from .gemm import logits as lm_logits, matmul_inputs, mm_as, mm_into
from .kernels import TORCH_GATHERED, GatheredRows
from .sampling_masks import SamplingMasks
from .second_order import first_order_only
from .set_check import check_support_values
from .set_chunk import SetChunk, SetRows, chunk_outputs, set_grad_coefs
from .set_gemm import gemm_set_grads
from .stats import compute_dtype
from .validate import Problem

__all__ = ["check_support", "check_support_values", "set_chunks", "set_logprobs", "linear_set_logprobs",
           "gathers", "GATHER_RATIO"]

# The mode rule (module docstring): gather a chunk's kept rows where GATHER_RATIO * K_loc <= V_loc; a
# kept pair costs the kernels one weight row from memory and two hidden rows, partly from cache,
# against three GEMMs per logit in the GEMM mode: break-even between ~110 and ~210 on an H100/H200.
GATHER_RATIO = 128

# what one kept id of a row costs the gather mode in bytes beside the kernels' reads: its logit, its
# fp32 statistics and gradient temporaries, its ids as int64 in the set's rows and the dW sort
_GATHER_ID_BYTES = 96

# the per-chunk working set (fp32 logits or gathered rows of the chunk): chunks are made so that
# one holds about this many bytes
CHUNK_BYTES = 256 * 2**20


def check_support(support, target: torch.Tensor, masks: SamplingMasks, batch_invariant: bool) -> Problem | None:
    """The set's local checks (type, shape, device; what it combines with): a Problem or None."""
    if support is None:
        if masks.top_k is not None or masks.top_p is not None or masks.min_p is not None:
            if batch_invariant:
                return Problem(NotImplementedError, "batch_invariant=True with top_k/top_p/min_p is not supported "
                                                    "(their thresholds are not made in a fixed order): pass the "
                                                    "engine's kept ids as support= instead")
        return None
    if masks.top_k is not None or masks.top_p is not None or masks.min_p is not None:
        return Problem(ValueError, "pass either support= (the engine's kept ids) or top_k/top_p/min_p (rebuilt "
                                   "from the logits), not both")
    if not isinstance(support, torch.Tensor):
        return Problem(TypeError, f"support must be a tensor, got {type(support).__name__}")
    if support.dtype != torch.int64:
        return Problem(TypeError, f"support must hold int64 global vocab ids (-1 padding), got dtype {support.dtype}")
    if tuple(support.shape[:-1]) != tuple(target.shape) or support.dim() != target.dim() + 1:
        return Problem(ValueError, f"support shape {tuple(support.shape)} must be target's shape "
                                   f"{tuple(target.shape)} plus one dim of K ids")
    if support.device != target.device:
        return Problem(ValueError, f"support is on {support.device} but target is on {target.device}")
    if support.requires_grad:
        return Problem(ValueError, "support holds ids; it takes no gradient")
    return None


def set_chunks(call: Call, k: int, hidden_size: int, chunks, *, gathered: GatheredRows | None = None) -> int:
    """Token chunks of a set call, the same on every rank (from the group's token count, the set
    width ``k``, the largest shard and the hidden size): ``chunks`` if an int, else enough that one
    chunk's working set is about :data:`CHUNK_BYTES`. ``gathered``: the linear op's gather mode
    (:class:`~vparallel_ce.kernels.GatheredRows`); the torch one makes the ``[c, K, H]`` rows. With
    the kernels, which make none, a row holds its kept ids' ``~96`` bytes each where :func:`gathers`
    takes every chunk (``k`` bounds each chunk's ``K_loc``), else also the GEMM mode's ``[c, V_loc]``
    logits in their dtype (its backward walks vocab blocks over all the chunks' rows at once:
    :func:`~vparallel_ce.set_gemm.gemm_set_grads`). Fewer chunks are fewer small steps queued per call.
    ``k = 0`` (the masks: every row over the whole vocabulary) counts the ``[c, V_loc]`` logits' fp32
    statistics, as the torch path."""
    if chunks != "auto":
        return int(chunks)
    n = sum(call.counts)
    width = -(-call.layout.vocab_size // call.layout.world)
    if gathered is not None and gathered is not TORCH_GATHERED and hidden_size and k and not call.batch_invariant:
        x_bytes = (call.logits_dtype or call.matmul_dtype or torch.float32).itemsize  # a GEMM-mode chunk's logits
        per_row = _GATHER_ID_BYTES * k + (0 if gathers(k, width) else x_bytes * width)
    else:
        per_row = max(12 * width, 6 * k * max(hidden_size, 1))
    return max(1, min(n, -(-n * max(per_row, 1) // CHUNK_BYTES)))


def _masks(call_options) -> SamplingMasks:
    return SamplingMasks(call_options.top_k, call_options.top_p, call_options.min_p)


def _support_rows(support: torch.Tensor | None, n: int, device) -> torch.Tensor:
    return torch.full((n, 0), -1, dtype=torch.int64, device=device) if support is None else support.reshape(n, support.shape[-1])


class SetLogprobs(torch.autograd.Function):
    """Log-probs over the set from logits ``x [N, V_loc]``: per chunk the set's statistics (forward);
    the gradient scattered into the shard's columns (backward, local)."""

    @staticmethod
    def forward(ctx, x, target, support, call: Call, masks: SamplingMasks, chunks: int):
        rows = Rows(call, chunks)
        outs, saved = [], []
        srs = SetRows.of_chunks(support, target, rows.height, call)  # (the chunks: consecutive slices)
        for c, sr in enumerate(srs):
            sl = rows.local[c]
            ch = _logits_chunk(call, sr, x[sl])
            logp, ent, kept = chunk_outputs(ch, sr, call, masks)
            outs.append((logp, ent))
            saved.append(kept)
        ctx.save_for_backward(x)
        return _kept_for_backward(ctx, call, masks, rows, saved, outs)

    @staticmethod
    @first_order_only("token_logprobs")
    def backward(ctx, g_logp, g_entropy):
        (x,) = ctx.saved_tensors
        call = ctx.call
        if g_logp is None and g_entropy is None:
            return None, None, None, None, None, None
        dx = torch.zeros_like(x)
        for c, (sr, tau, m, log_s, ent) in enumerate(ctx.saved):
            sl = ctx.rows.local[c]
            ch = _logits_chunk(call, sr, x[sl])
            ch.masked(call, ctx.masks, tau)
            coefs = set_grad_coefs(None if g_logp is None else g_logp[sl], None if g_entropy is None else g_entropy[sl],
                           sr, ent, log_s, call)
            d_set, d_full = ch.grads(call, m, coefs)
            if call.batch_invariant:  # the whole shard's columns already
                dx[sl] = d_set.to(x.dtype)
                continue
            d = torch.zeros(x[sl].shape, dtype=d_set.dtype, device=x.device)
            d.scatter_add_(1, sr.cols, d_set)  # kept columns are distinct in a row; the rest add 0
            if d_full is not None:
                d[sr.full] = d_full
            dx[sl] = d.to(x.dtype)
        return dx, None, None, None, None, None


def _logits_chunk(call: Call, sr: SetRows, x_c: torch.Tensor) -> SetChunk:
    """A chunk of given logits: the kept ids' columns and the whole-vocab rows; in the
    batch-invariant mode the whole shard's logits masked to the set (:meth:`SetRows.over_shard`)
    and that mode's row steps."""
    if call.batch_invariant:
        return SetChunk(sr.over_shard(x_c.shape[1]), x_c, None, call.ops(x_c))
    return SetChunk(sr, x_c.gather(1, sr.cols), x_c[sr.full] if sr.full.numel() else None, call.ops(x_c))


def _kept_for_backward(ctx, call: Call, masks: SamplingMasks, rows: Rows, saved: list, outs: list):
    """What the backward reads besides the saved tensors, and the forward's ``(logp, entropy)`` of
    its chunks' ``outs``."""
    ctx.call, ctx.masks, ctx.rows, ctx.saved = call, masks, rows, saved
    ctx.set_materialize_grads(False)
    logp, ent = (torch.cat(p) for p in zip(*outs))
    return logp, ent




class LinearSetLogprobs(torch.autograd.Function):
    """Log-probs over the set from hidden states and this rank's lm_head shard: per chunk only the
    kept ids' logits (gathered weight rows) or one GEMM over the shard (module docstring's rule)."""

    @staticmethod
    def forward(ctx, h, w, b, target, support, call: Call, masks: SamplingMasks, chunks: int):
        hm, wm, bm = matmul_inputs(call, h, w, b)
        rows = Rows(call, chunks)
        # every chunk's rows of the set first, with one host read of their widths: it waits for these
        # small steps alone, not for the chunks' kernels
        srs = SetRows.of_chunks(*_call_rows(rows, support, target, call), call)
        # the gather mode's logits of all its chunks in one pass over the weight (GatheredRows.logits),
        # kept for the backward (no second gather). With sequence parallelism every chunk's rows are
        # gathered first, in chunk order on every rank (a rank's modes depend on its shard's K_loc:
        # the all-gathers must not), and held together: the group's [N, H] hidden rows
        h_all = [rows.gather(c, hm) for c in range(len(rows))] if call.sequence_parallel else None
        hcs = {c: h_all[c] if h_all else rows.gather(c, hm) for c, sr in enumerate(srs)
               if not call.batch_invariant and gathers(sr.cols.shape[1], wm.shape[0])}
        set_xs, kept_cols, by_row = [None] * len(srs), [None] * len(srs), None
        if hcs:
            gathered = call.ops(wm).gathered
            for c in hcs:
                kept_cols[c] = _kept_cols(srs[c])
            # the pairs sorted by weight row once, for the logits here and dW in backward
            by_row = gathered.pairs([kept_cols[c] for c in hcs], wm)
            xs = gathered.logits([(kept_cols[c], h_c) for c, h_c in hcs.items()], wm, bm,
                                 call.logits_dtype or hm.dtype, by_row=by_row)
            for c, x in zip(hcs, xs):
                set_xs[c] = x
        outs, saved = [], []
        for c, sr in enumerate(srs):
            h_c = hcs[c] if c in hcs else h_all[c] if h_all else rows.gather(c, hm)
            ch = _linear_chunk(call, sr, h_c, wm, bm, set_xs[c])
            if not call.batch_invariant:  # the GEMM mode's kept logits too: its backward makes no logits again
                set_xs[c] = ch.set_x
            logp, ent, kept = chunk_outputs(ch, sr, call, masks)
            outs.append((rows.own(c, logp), rows.own(c, ent)))
            saved.append(kept)
        ctx.save_for_backward(h, w, b, target, support)
        ctx.set_xs = set_xs  # each chunk's [c, K_loc] kept logits (None: batch invariant)
        ctx.gathered = [c in hcs for c in range(len(srs))]  # the chunks of the gather mode
        ctx.kept_cols, ctx.by_row = kept_cols, by_row  # their local weight rows (-1: none), sorted pairs
        return _kept_for_backward(ctx, call, masks, rows, saved, outs)

    @staticmethod
    @first_order_only("linear_token_logprobs")
    def backward(ctx, g_logp, g_entropy):
        h, w, b, target, support = ctx.saved_tensors
        call, rows = ctx.call, ctx.rows
        need = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], b is not None and ctx.needs_input_grad[2])
        none = (None,) * 8
        if not any(need):
            return none
        if call.layout.sharded:  # collectives follow (dh over the group, rows with SP): every rank runs them
            g_logp = torch.zeros(target.numel(), dtype=ctx.saved[0][2].dtype, device=h.device) \
                if g_logp is None else g_logp
        elif g_logp is None and g_entropy is None:
            return none
        hm, wm, bm = matmul_inputs(call, h, w, b)
        acc = compute_dtype(wm.dtype)
        gathered = call.ops(wm).gathered
        # (each chunk's rows zeroed below, unless the gather mode's dh writes them first)
        dh = torch.empty(h.shape, dtype=acc, device=h.device) if need[0] else None
        any_full = any(sr.full.numel() for sr, *_ in ctx.saved)
        both = any(ctx.gathered) and not all(ctx.gathered)
        # dW's fp32 sum where more than one pass adds to it (the batch-invariant chunks, the whole-vocab
        # rows' GEMMs of each chunk, both modes); else the one pass writes it, rounded once
        dw = None
        if need[1] and (call.batch_invariant or any_full or both):
            dw = torch.zeros(w.shape, dtype=acc, device=w.device)
        db = torch.zeros(w.shape[0], dtype=acc, device=w.device) if need[2] else None
        parts, gemm_parts, dh_parts = [], [], []  # gather mode (d, cols, h rows); GEMM mode (d, cols, h, dh rows)
        add_dh = invariant_dh(call, w) if call.batch_invariant else None
        for c, (sr, tau, m, log_s, ent) in enumerate(ctx.saved):
            h_c = rows.gather(c, hm)
            ch = _linear_chunk(call, sr, h_c, wm, bm, ctx.set_xs[c], masked=True)
            ch.masked(call, ctx.masks, tau)
            g_lp = None if g_logp is None else rows.gather(c, g_logp.reshape(-1))
            g_h = None if g_entropy is None else rows.gather(c, g_entropy.reshape(-1))
            coefs = set_grad_coefs(g_lp, g_h, sr, ent, log_s, call)
            d_set, d_full = ch.grads(call, m, coefs)
            # this chunk's rows of dh (fp32): its rows of dh, or (sequence parallel) the gathered
            # rows' partial sum, reduce-scattered once every chunk's GEMM-mode part is in
            # (fresh: the gather mode's dh writes the chunk's rows first; others add to zeros)
            dh_c, fresh = None, ctx.gathered[c] and not call.batch_invariant
            if dh is not None:
                dh_c = torch.empty(h_c.shape, dtype=acc, device=h.device) if call.sequence_parallel \
                    else dh[rows.local[c]]
                if not fresh:
                    dh_c.zero_()
            if call.batch_invariant:  # d_set: the whole shard's columns
                _shard_grads(d_set, h_c, wm, dw, db, add_dh, dh_c)
            else:
                _linear_grads(sr, d_set, d_full, h_c, wm, gathered if ctx.gathered[c] else None, dw, db,
                              parts, gemm_parts, dh_c, ctx.kept_cols[c])
            dh_parts.append(dh_c)
        if gemm_parts:  # the GEMM mode's set columns of all its chunks, by vocab blocks
            direct = dw is None and need[1]
            if direct:
                dw = torch.empty(w.shape, dtype=w.dtype, device=w.device)
            gemm_set_grads(gemm_parts, wm, dw, db, CHUNK_BYTES, accumulate=not direct)
        if dh is not None and call.sequence_parallel:
            for c, dh_c in enumerate(dh_parts):
                dh[rows.local[c]] = rows.scatter_grad(c, dh_c)
        elif dh is not None:
            sum_dh_over_ranks(rows, dh)
        if parts or (need[1] and dw is None):  # the gather mode's dW (into the sum so far, if any) and db
            dw = gathered.weight_grad(parts, w, w.dtype if need[1] else None, dw, db, by_row=ctx.by_row)
        out = tuple(None if g is None else g.to(t.dtype) for g, t in ((dh, h), (dw, w), (db, b)))
        return out + (None,) * 5


def _call_rows(rows: Rows, support: torch.Tensor, target: torch.Tensor, call: Call):
    """``(ids, target, heights)``: every chunk's rows of the set and the targets, stacked in chunk
    order (replicated hidden: the tensors themselves, the chunks being consecutive slices; sequence
    parallel: each chunk's rows gathered over the group), and each chunk's row count."""
    if not call.sequence_parallel:
        return support, target, rows.height
    parts = [(rows.gather(c, support, fill=-1), rows.gather(c, target, fill=call.spec.ignore_index))
             for c in range(len(rows))]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]), [p[1].shape[0] for p in parts]


def gathers(k_loc: int, width: int) -> bool:
    """The mode rule: the gather mode for a chunk whose rows keep at most ``k_loc`` ids of this
    ``width``-column shard where ``GATHER_RATIO * k_loc <= width`` (module docstring)."""
    return GATHER_RATIO * k_loc <= width


def _kept_cols(sr: SetRows) -> torch.Tensor:
    """The chunk's kept ids as local weight rows, ``-1`` where none (what :class:`GatheredRows` reads)."""
    return sr.cols.where(sr.kept, -1)


def _linear_chunk(call: Call, sr: SetRows, h_c, w, b, set_x, *, masked: bool = False):
    """The chunk's :class:`~vparallel_ce.set_chunk.SetChunk`: with ``set_x``, its kept ids'
    logits ``[c, K_loc]`` (the gather mode's; ``masked``: the forward's chunk's, -inf off the set,
    kept for the backward), those and the whole-vocab rows' GEMM, else the shard's GEMM and a
    gather of its columns (or, batch-invariant, the GEMM masked to the set)."""
    width = w.shape[0]
    if call.batch_invariant:  # the shard's GEMM, masked to the set (the gather's widths vary with the chunk)
        x_c = lm_logits(call, h_c, w, b)
        return SetChunk(sr.over_shard(width), x_c, None, call.ops(x_c))
    if set_x is not None:
        full_x = lm_logits(call, h_c[sr.full], w, b) if sr.full.numel() else None
        return SetChunk(sr, set_x, full_x, call.ops(set_x), masked=masked)
    x_c = lm_logits(call, h_c, w, b)
    return SetChunk(sr, x_c.gather(1, sr.cols), x_c[sr.full] if sr.full.numel() else None, call.ops(x_c))


def _linear_grads(sr: SetRows, d_set, d_full, h_c, w, gathered: GatheredRows | None, dw, db, parts: list,
                  gemm_parts: list, dh_c, cols=None):
    """Add the chunk's ``dW``/``db`` (fp32 sums) and ``dh`` rows (into ``dh_c``, fp32, or None): the
    set's columns through ``gathered`` (the gather mode: ``dh`` here, ``(d, cols, h)`` appended to
    ``parts`` for one ``dW`` of all the chunks) or, the GEMM mode, ``(d, cols, h, dh_c)`` appended
    to ``gemm_parts`` for :func:`~vparallel_ce.set_gemm.gemm_set_grads`; the whole-vocab rows through the GEMM.
    ``cols``: the chunk's :func:`_kept_cols`, if the forward kept them."""
    cols = _kept_cols(sr) if cols is None else cols
    if gathered is not None:
        if dh_c is not None:
            gathered.hidden_grad(d_set, cols, w, out=dh_c)  # (the chunk's first part of dh: written, not added)
        parts.append((d_set, cols, h_c))
    else:
        gemm_parts.append((d_set, cols, h_c, dh_c))
    if d_full is None:
        return
    if db is not None:
        db += d_full.sum(0)
    dm = d_full.to(w.dtype)  # the gradient GEMMs' operand, rounded once (as the full op's)
    if dh_c is not None:
        dh_c.index_add_(0, sr.full, mm_as(dm, w, dh_c.dtype))
    if dw is not None:
        mm_into(dw, dm.t(), h_c[sr.full], accumulate=True)


def _shard_grads(d, h_c, w, dw, db, add_dh, dh_c):
    """The batch-invariant mode's :func:`_linear_grads`: ``d [c, V_loc]`` the chunk's logits'
    gradient over the whole shard (fp32); ``dh`` rows through ``add_dh``
    (:func:`~vparallel_ce.chunk_walk.invariant_dh`) into ``dh_c`` (fp32, zero; or None),
    ``dW``/``db`` added to their fp32 sums."""
    if db is not None:
        db += d.sum(0)
    dm = d.to(w.dtype)  # the gradient GEMMs' operand, rounded once (as the full op's)
    if dh_c is not None:
        part = torch.zeros(h_c.shape, dtype=d.dtype, device=h_c.device)
        add_dh(part, dm, w)
        dh_c += part
    if dw is not None:
        mm_into(dw, dm.t(), h_c, accumulate=True)


def set_logprobs(x, target, support, call: Call, options, chunks: int):
    """``(logp, entropy)`` of the flat ``x [N, V_loc]``, ``target [N]``, ``support [N, K]`` (None
    with masks)."""
    return SetLogprobs.apply(x, target, _support_rows(support, target.numel(), x.device), call, _masks(options),
                             chunks)


def linear_set_logprobs(h, w, b, target, support, call: Call, options, chunks: int):
    """``(logp, entropy)`` of the flat hidden ``[N, H]`` (this rank's tokens with sequence
    parallelism), weight shard ``[V_loc, H]``, bias, ``target [N]``, ``support [N, K]`` (None with masks)."""
    return LinearSetLogprobs.apply(h, w, b, target, _support_rows(support, target.numel(), h.device), call,
                                   _masks(options), chunks)
