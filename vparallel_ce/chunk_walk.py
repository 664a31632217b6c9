r"""The chunk walk the linear ops run on (``linear_cross_entropy``, ``linear_token_logprobs``,
``linear_distillation_loss``): the lm_head logits of this rank's vocab shard, never materialised
for all tokens at once, and the steps those ops share.

With ``x = h W^T + b`` the logits of this rank's vocab shard, a call walks ``x`` as **row chunks x
column blocks** and runs the same two steps for every chunk (:class:`Schedule`):

* **statistics**: per block ``x_b = h_c W_b^T`` (matmul 1), its local statistics, merged over the
  blocks (online softmax), then ONE exchange for the chunk (all-reduce MAX + SUM);
* **gradients**: per block ``dx_b`` from the global statistics (the kept ``x_b``, or recomputed: one more
  matmul), ``dh_c += dx_b W_b`` (matmul 2) and ``dW_b (+)= dx_b^T h_c`` (matmul 3).

The two schedules are two shapes of that walk:

**token** -- ``k`` chunks of tokens x the whole shard (two aligned parts for odd widths). With
gradients made in forward the statistics' logits feed the gradient step: 3 matmuls of
``2 N H V_loc`` FLOPs; with more than one chunk dW is summed over the chunks in an fp32 accumulator
(``4 V_loc H`` bytes). With ``recompute`` the backward recomputes ``x_c``: 4 matmuls.

**vocab** -- one chunk of all tokens x ``k`` blocks of the shard. Each dW block comes out of a
single matmul over all tokens (no accumulator); the logits are recomputed for the gradients: 4
matmuls, memory at the floor, 2 collectives per call.

``hidden.grad`` is the FULL gradient: the vocab shards' partial ``dh`` are all-reduced over the group
(Megatron's "f" operator); with ``sequence_parallel=True`` each chunk's rows are all-gathered from the
ranks' token shards and ``dh`` is reduce-scattered back. Sums of gradient contributions (over chunks,
blocks or ranks) are always fp32; a gradient made by one matmul is written in its input's dtype.

The matmuls themselves (their dtypes, the logits' precision) are :mod:`vparallel_ce.gemm`'s.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import comm, compiled, invariant
from .call import Call
from .gemm import logits, matmul_operand, mm_as, mm_into
from .layout import aligned_parts, vocab_blocks
from .stats import combine, compute_dtype, local_targets, token_slices

__all__ = ["Rows", "ChunkTargets", "Grads", "Schedule", "invariant_dh", "sum_dh_over_ranks", "KeptLogits",
           "scale_unit_grads", "scale_valid_unit_grads", "chunk_losses", "cat_parts"]


class Rows:
    """Which token rows a chunk holds. Replicated hidden: a slice of the local rows. Sequence
    parallel: every rank's c-th slice of its own rows, padded to a common height (padding rows get
    ``ignore_index`` and so contribute nothing) and all-gathered in rank order. Every rank makes
    the same number of chunks (each walks the per-chunk collectives)."""

    def __init__(self, call: Call, chunks: int):
        self.call = call
        lay = call.layout
        if call.sequence_parallel:
            k = max(1, min(int(chunks), max(call.counts)))
            per_rank = [token_slices(n, k, exact=True) for n in call.counts]
            self.local = per_rank[lay.rank]
            self.height = [max(s[c].stop - s[c].start for s in per_rank) for c in range(k)]
        else:
            self.local = token_slices(call.counts[0], chunks, tile=call.tile)
            self.height = [s.stop - s.start for s in self.local]

    def __len__(self):
        return len(self.local)

    def gather(self, c: int, x: torch.Tensor, fill=0) -> torch.Tensor:
        """Rows of chunk ``c`` of ``x`` (hidden, target or a per-token vector) over the group."""
        part = _part(x, self.local[c])
        if not self.call.sequence_parallel:
            return part
        pad = self.height[c] - part.shape[0]
        if pad:
            part = torch.cat([part, part.new_full((pad, *part.shape[1:]), fill)])
        return comm.all_gather_rows(part, self.call.layout.group)

    def own(self, c: int, rows: torch.Tensor) -> torch.Tensor:
        """This rank's rows out of chunk ``c``'s gathered per-row values (identical on all ranks)."""
        if not self.call.sequence_parallel:
            return rows
        start = self.call.layout.rank * self.height[c]
        return rows[start : start + self.local[c].stop - self.local[c].start]

    def scatter_grad(self, c: int, dh: torch.Tensor) -> torch.Tensor:
        """Chunk ``c``'s gathered partial hidden gradient -> this rank's rows, summed over the group
        (in rank order in batch-invariant mode)."""
        scatter = comm.reduce_scatter_rows_rank_ordered if self.call.batch_invariant else comm.reduce_scatter_rows
        return scatter(dh, self.call.layout.group)[: self.local[c].stop - self.local[c].start]


def _grad_in_place(ops, x, local_t, owned, shift, coefs, spec, col_offset):
    """``grad_logits`` of a block's logits that this op owns (a temporary of ``F.linear``): written
    over them when the implementation can (one block-sized buffer less, no extra allocation)."""
    if ops.grad_logits_ is not None:
        return ops.grad_logits_(x, local_t, owned, shift, coefs, spec, col_offset=col_offset)
    return ops.grad_logits(x, local_t, owned, shift, coefs, spec, col_offset=col_offset)


def _block_offset(blk: slice, width: int) -> int | None:
    """The ``col_offset`` of a block of a ``width``-column shard for the row passes (None: all of it)."""
    return None if blk.start == 0 and blk.stop >= width else blk.start


class ChunkTargets:
    """A chunk's targets mapped to this shard, ``(local_t, owned, valid)``
    (:func:`~vparallel_ce.stats.local_targets`), made on the first call: a forward asks for them
    once the chunk's first GEMM is queued, so the host launches their small kernels while the GPU
    runs it rather than before. ``known``: the forward's, reused by the backward."""

    def __init__(self, call: Call, t_c: torch.Tensor, known: tuple | None = None):
        self.call, self.t_c, self.known = call, t_c, known

    def __call__(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.known is None:
            lay, spec = self.call.layout, self.call.spec
            self.known = local_targets(self.t_c, lay.offset, lay.local_size, spec.ignore_index,
                                       all_owned=self.call.all_owned)
        return self.known


class Grads:
    """Gradient buffers of one call, in the dtypes of the inputs ``h, w, b`` they are returned for.

    Sums over row chunks, vocab blocks or ranks go into fp32 (fp64 for fp64) buffers, cast once at
    the end; the first chunk writes dW's sum (beta = 0) rather than adding to a zero-filled one. A
    gradient that ONE matmul makes -- dW without token chunks, each token chunk's rows of dh of an
    unsharded call with one vocab block (not on the batch-invariant torch path) -- is written
    straight into the input's dtype (one rounding either way, no fp32 buffer and no cast).

    ``kept_hidden`` (the plan's :attr:`~vparallel_ce.policy.WeightGrad.ONE_GEMM`, distillation): the
    call's ``[N, H]`` rows in the matmul dtype. Each chunk then writes its logits' gradient into
    its rows of one ``[N, V_loc]`` buffer (:meth:`kept_rows`), and :meth:`finish` makes ``dW`` from
    all of them in ONE GEMM with these rows, straight in the weight's dtype."""

    def __init__(self, h, w, b, need, *, acc_dtype, rows: Rows, schedule: "Schedule",
                 kept_hidden: torch.Tensor | None = None):
        need_h, need_w, need_b = need
        lay = rows.call.layout
        self.dtypes = (h.dtype, w.dtype, None if b is None else b.dtype)
        # batch invariant: one path whatever the chunk count (fp32 sums, dh by rows, rank-ordered)
        self.invariant = rows.call.batch_invariant
        self.row_gemm = invariant.ops_for(w, rows.call.kernels, rows.call.matmul_dtype).row_gemm \
            if self.invariant else None
        # (sequence parallelism implies a sharded vocab: its gathered rows are summed over the group;
        # the batch-invariant torch path adds tile by tile into fp32)
        self.dh_direct = (len(schedule.blocks) == 1 and not lay.sharded
                          and (not self.invariant or self.row_gemm is not None))
        self.kept_hidden = kept_hidden if need_w else None
        self.kept = None  # the [N, V_loc] logits' gradients, with kept_hidden
        if self.kept_hidden is not None:
            self.kept = torch.empty((kept_hidden.shape[0], w.shape[0]), dtype=kept_hidden.dtype, device=w.device)
        self.dw_accumulate = len(rows) > 1 and self.kept is None
        self.dw_begun: set[int] = set()  # the vocab blocks whose dW sum a chunk has started
        self.dh = self.dw = self.db = None
        if need_h:
            self.dh = torch.empty_like(h) if self.dh_direct else torch.zeros(h.shape, dtype=acc_dtype, device=h.device)
        if need_w and self.kept is None:  # (kept: dW is made, and allocated, at finish)
            self.dw = torch.empty(w.shape, dtype=acc_dtype if self.dw_accumulate else w.dtype, device=w.device)
        if need_b and b is not None:
            self.db = torch.zeros(w.shape[0], dtype=acc_dtype, device=w.device)

    def rows_of(self, rows: Rows, c: int, h_c: torch.Tensor) -> torch.Tensor | None:
        """The buffer chunk ``c``'s ``dh`` is summed into: this chunk's rows of ``dh``, or a buffer
        of the gathered rows (sequence parallel) that :meth:`end_chunk` reduce-scatters."""
        if self.dh is None:
            return None
        if rows.call.sequence_parallel:
            return torch.zeros(h_c.shape, dtype=self.dh.dtype, device=h_c.device)
        return _part(self.dh, rows.local[c])

    def kept_rows(self, rows: Rows, c: int) -> torch.Tensor | None:
        """Where chunk ``c``'s logits' gradient is to be written: its rows of the kept buffer (None
        without one: the chunk makes its own)."""
        return None if self.kept is None else _part(self.kept, rows.local[c])

    def add_block(self, blk: slice, dx: torch.Tensor, h_c: torch.Tensor, w_blk: torch.Tensor, dh_rows) -> None:
        """``dx``: the block's logits' gradient, in the matmul dtype or (fp32 logits) fp32: ``db``
        sums it as it is, the two GEMMs take it rounded to the matmul dtype."""
        if self.db is not None:
            self.db[blk] += dx.to(self.db.dtype).sum(0)
        dx = matmul_operand(dx, h_c.dtype)
        if dh_rows is not None and self.row_gemm is not None:
            self.row_gemm.add_rows_mm_(dh_rows, dx, w_blk, accumulate=not self.dh_direct)
        elif dh_rows is not None and self.invariant:
            _add_dh_by_tiles(dh_rows, dx, w_blk)
        elif dh_rows is not None:
            mm_into(dh_rows, dx, w_blk, accumulate=not self.dh_direct)
        if self.dw is not None:  # (none with a kept buffer: dx is its rows, dW made at finish)
            begun = blk.start in self.dw_begun
            self.dw_begun.add(blk.start)
            mm_into(_part(self.dw, blk), dx.t(), h_c, accumulate=begun)

    def add_chunk(self, rows: Rows, c: int, h_c: torch.Tensor, blk: slice, w_blk: torch.Tensor,
                  dx: torch.Tensor) -> None:
        """Chunk ``c``'s gradients from ``dx``, the gradient of its logits in one block ``blk``."""
        dh_rows = self.rows_of(rows, c, h_c)
        self.add_block(blk, dx, h_c, w_blk, dh_rows)
        self.end_chunk(rows, c, dh_rows)

    def end_chunk(self, rows: Rows, c: int, dh_rows) -> None:
        if dh_rows is not None and rows.call.sequence_parallel:
            self.dh[rows.local[c]] = rows.scatter_grad(c, dh_rows)

    def finish(self, rows: Rows) -> tuple:
        """Sum the replicated hidden's partial ``dh`` over the group; the gradients in the inputs' dtypes."""
        if self.kept is not None:  # allocated now, not beside the chunks' logits
            self.dw = torch.empty((self.kept.shape[1], self.kept_hidden.shape[1]), dtype=self.dtypes[1],
                                  device=self.kept.device)
            mm_into(self.dw, self.kept.t(), self.kept_hidden, accumulate=False)
            self.kept = self.kept_hidden = None
        if self.dh is not None and not rows.call.sequence_parallel:  # (else summed by end_chunk)
            sum_dh_over_ranks(rows, self.dh)
        return tuple(g if g is None or g.dtype == dt else g.to(dt)
                     for g, dt in zip((self.dh, self.dw, self.db), self.dtypes))


def invariant_dh(call: Call, w: torch.Tensor):
    """The batch-invariant ``add(dh_rows, dx, w_blk)``: ``dh_rows += dx w_blk`` (fp32 rows, ``dx``
    and ``w_blk`` in the matmul dtype), a row's sum over the vocab from its own row of ``dx`` alone
    -- the fixed-config Triton GEMM, or one torch GEMM per fixed-shape tile."""
    fixed = invariant.ops_for(w, call.kernels, call.matmul_dtype).row_gemm
    return fixed.add_rows_mm_ if fixed is not None else _add_dh_by_tiles


def _add_dh_by_tiles(dh_rows: torch.Tensor, dx: torch.Tensor, w_blk: torch.Tensor) -> None:
    invariant.add_rows_by_tiles(dh_rows, lambda tile: mm_as(tile, w_blk, dh_rows.dtype), dx)


def sum_dh_over_ranks(rows: Rows, dh: torch.Tensor) -> None:
    """A replicated hidden's partial ``dh`` (fp32) summed over the group in place: one all-reduce,
    or in the batch-invariant mode in rank order, world x one chunk's rows at a time."""
    lay = rows.call.layout
    if rows.call.batch_invariant:
        if lay.sharded:
            for sl in rows.local:
                dh[sl] = comm.all_reduce_sum_rank_ordered(dh[sl], lay.group)
    else:
        comm.all_reduce_sum_(dh, lay.group)


@dataclass(frozen=True)
class Schedule:
    """A walk over the ``[N, V_loc]`` logits: ``row_chunks`` token chunks x ``blocks`` of the local
    vocab, with the two steps below for each chunk. ``keep_logits``: the statistics step keeps each
    block's logits for the gradient step (token schedule: gradients made in forward, or in backward
    from logits kept since forward; 3 matmuls); else the gradient step recomputes them."""

    row_chunks: int
    blocks: tuple[slice, ...]
    keep_logits: bool

    @classmethod
    def of(cls, call: Call, *, keep_logits: bool) -> "Schedule":
        """The call's schedule; ``keep_logits``: the statistics step keeps the logits for a gradient
        step (right after it, or in backward: ``Plan.keep_logits``). Vocab blocks never keep them."""
        token = call.plan.schedule == "token"
        if call.batch_invariant:  # the same blocks whatever N (invariant.plan)
            return cls(call.plan.chunks if token else 1, tuple(invariant.blocks(call.layout.local_size)),
                       keep_logits=keep_logits and token)
        if token:
            return cls(call.plan.chunks, tuple(aligned_parts(call.layout.local_size)), keep_logits=keep_logits)
        return cls(1, tuple(vocab_blocks(call.layout.local_size, call.plan.chunks)), keep_logits=False)

    @staticmethod
    def keeps_for_backward(call: Call, need) -> bool:
        """Whether the forward keeps the logits for the backward (``Plan.keep_logits``)."""
        return call.plan.keep_logits and call.plan.schedule == "token" and any(need)

    def rows(self, call: Call) -> Rows:
        return Rows(call, self.row_chunks)

    @staticmethod
    def call_targets(call: Call, rows: Rows, t: torch.Tensor) -> list | None:
        """Each chunk's ``(t_c, local_t, owned, valid)`` for :meth:`walk`, mapped once for the call's
        rows; None with sequence parallelism (the chunks' targets are gathered chunk by chunk)."""
        if call.sequence_parallel:
            return None
        known = ChunkTargets(call, t)()
        return [(_part(t, sl), *(_part(k, sl) for k in known)) for sl in rows.local]

    @staticmethod
    def walk(call: Call, rows: Rows, h: torch.Tensor, t: torch.Tensor, targets: list | None = None):
        """The row chunks: yields ``(c, h_c, t_c, targets_c)`` with ``h_c``/``t_c`` chunk ``c``'s
        rows (gathered over the group with sequence parallelism) and ``targets_c()`` their
        :func:`~vparallel_ce.stats.local_targets` ``(local_t, owned, valid)``. ``targets``: the
        ``(t_c, local_t, owned, valid)`` of each chunk from an earlier walk (the forward's, for the
        backward: no second gather and no small kernels to launch again)."""
        for c in range(len(rows)):
            h_c = rows.gather(c, h)
            if targets:
                t_c, *known = targets[c]
                yield c, h_c, t_c, ChunkTargets(call, t_c, tuple(known))
                continue
            t_c = rows.gather(c, t, fill=call.spec.ignore_index)
            yield c, h_c, t_c, ChunkTargets(call, t_c)

    def grad_with_statistics(self, call: Call, b) -> bool:
        """Whether a kept chunk's logits are turned into their gradient (for an upstream gradient of
        1) by the statistics' own kernel, in forward (:func:`~vparallel_ce.stats.loss_stats_grad_`:
        one pass over the logits instead of two, and the backward's first kernel is a GEMM): one
        chunk (:meth:`unit_grad_with_statistics`)."""
        return self.row_chunks == 1 and self.unit_grad_with_statistics(call, b)

    def unit_grad_with_statistics(self, call: Call, b) -> bool:
        """Whether each kept chunk's statistics, loss and gradient for an upstream gradient of 1 can
        come out of one kernel (:func:`~vparallel_ce.stats.loss_stats_grad_`): one block, on a rank
        holding the whole vocab (no exchange between the statistics and the gradient), not
        sequence parallel; a bias only with a scalar upstream gradient."""
        return (self.keep_logits and len(self.blocks) == 1 and not call.layout.sharded
                and not call.sequence_parallel and not (b is not None and call.reduction == "none")
                and not call.batch_invariant)  # (its g is applied to dx W, not to dx: another rounding)

    @staticmethod
    def fused(ops, call: Call, h_c, w) -> bool:
        """Whether the lm_head GEMM runs fused with the row passes (:mod:`vparallel_ce.kernels.fused_linear`)
        wherever logits are recomputed: their statistics or their gradient straight from the GEMM's
        epilogue, the logits never written."""
        return ops.fused is not None and ops.fused.covers(h_c, w, call.spec)

    def statistics(self, call: Call, ops, h_c, w, b, targets: "ChunkTargets", *, on_block=None, join=True):
        """Global statistics of chunk ``c``'s rows ``h_c``: local statistics block by block, merged,
        one exchange. Returns them and the kept blocks' logits (empty unless ``keep_logits``).
        Fused, the whole shard is one GEMM whose epilogue makes the statistics (no logits, no blocks:
        its memory is per-(256-column tile, row) partials); unfused, a GEMM per block.
        ``on_block(blk, x)``: also shown each block's logits ``x`` (read only), in block order;
        the statistics are then never fused (their logits must exist). ``join=False``: on one rank
        the local ``ChunkStats``, for a caller joining its chunks' once (``stats.whole_vocab``)."""
        st, parts, kept = None, None, []
        if not self.keep_logits and on_block is None and self.fused(ops, call, h_c, w):
            local_t, owned, _ = targets()
            st = ops.fused.stats(h_c, w, b, local_t, owned, call.spec)
        for i, blk in enumerate(self.blocks if st is None else ()):
            x = logits(call, h_c, _part(w, blk), None if b is None else _part(b, blk))
            local_t, owned, _ = targets()
            if parts is None and len(self.blocks) > 1:  # each block's statistics, merged once after the last
                parts = torch.empty((len(self.blocks), 5, x.shape[0]), dtype=compute_dtype(x.dtype), device=x.device)
            st = ops.local_stats(x, local_t, owned, call.spec, col_offset=_block_offset(blk, call.layout.local_size),
                                 out=None if parts is None else parts[i])
            if on_block is not None:
                on_block(blk, x)
            if self.keep_logits:
                kept.append(x)
            del x  # else the next block's logits are allocated while this one's are still alive
        st = st if parts is None else ops.merge_blocks(parts, call.spec)
        if join or call.layout.sharded:
            st = combine(st, call.layout, rank_ordered=call.batch_invariant)
        return st, kept

    def gradients(self, call: Call, ops, rows: Rows, c: int, h_c, w, b, local_t, owned, shift, coefs,
                  kept: list, grads: Grads) -> None:
        """Chunk ``c``'s gradients, block by block, into ``grads``: each block's ``dx`` from its kept
        logits or recomputed (``shift``, ``coefs``: the global max and the
        :class:`vparallel_ce.stats.GradCoefs` of the chunk's rows),
        then ``dh += dx W_b``, ``dW_b (+)= dx^T h_c``, ``db_b += sum dx``."""
        dh_rows = grads.rows_of(rows, c, h_c)
        # Recompute fused only where the forward's statistics were fused too: a plan that kept the
        # logits took its statistics from cuBLAS's logits (bf16 unless Call.logits_dtype is fp32),
        # and a second backward of its graph (kept logits used up) must recompute the same logits,
        # not the fp32 accumulator's.
        fused = not kept and not call.plan.keep_logits and self.fused(ops, call, h_c, w)
        if fused:  # the chunk's kernel arguments made once, not per block
            grad_of = ops.fused.grad_logits_for(h_c, local_t, owned, shift, coefs, call.spec)
        for i, blk in enumerate(self.blocks):
            if blk.stop == blk.start:
                continue
            w_blk, b_blk = _part(w, blk), None if b is None else _part(b, blk)
            if fused:  # the recomputed logits only ever exist as tiles in the GEMM's registers
                dx = grad_of(w_blk, b_blk, col_offset=blk.start)
            else:
                col = _block_offset(blk, call.layout.local_size)
                x = kept[i] if kept else logits(call, h_c, w_blk, b_blk)
                if kept:
                    kept[i] = None  # its memory is reused by the gradient, then freed
                # fp32 logits (Call.logits_dtype) with no bias to sum their gradient in fp32: the
                # gradient is written once in the matmul dtype the two GEMMs take (the same single
                # rounding as an fp32 gradient copied down, without its write and read)
                narrow = h_c.dtype if x.dtype != h_c.dtype and grads.db is None else None
                if narrow is not None or (kept and compiled.KEPT_READ_ONLY.get()):  # (a compiled backward: read only)
                    dx = ops.grad_logits(x, local_t, owned, shift, coefs, call.spec, narrow, col_offset=col)
                else:
                    dx = _grad_in_place(ops, x, local_t, owned, shift, coefs, call.spec, col)
                del x
            grads.add_block(blk, dx, h_c, w_blk, dh_rows)
            del dx  # free this block before the next one's is allocated
        grads.end_chunk(rows, c, dh_rows)


class KeptLogits:
    """The logits a forward kept for its backward (per chunk, its blocks), handed over once: the
    gradient step writes over them, so a second backward of the same graph (zero-bubble pipeline
    schedules run the input and the weight pass separately) finds none and recomputes."""

    def __init__(self):
        self._chunks: list = []

    def add(self, blocks: list) -> None:
        self._chunks.append(blocks)

    def take(self) -> list:
        chunks, self._chunks = self._chunks, []
        return chunks


def scale_unit_grads(ops, grads, grad_out: torch.Tensor, *, target: torch.Tensor | None = None,
                     ignore_index: int = -100, counted: torch.Tensor | None = None) -> tuple:
    """Gradients ``(dh, dW, db)`` made in forward for an upstream gradient of 1 (in their inputs'
    dtypes: the fp32 sums are cast in forward, so what a microbatch holds until its backward is no
    larger than its gradients), times the scalar ``grad_out``: the product formed in fp32
    (``ops.scale_rows``: one Triton pass per 2-D gradient on a GPU, a broadcast multiply of a 0-dim
    CUDA tensor being a slow elementwise path) and rounded into the gradient's dtype -- exact for
    ``grad_out = 1``. None stays None; a new tensor each time, so a second backward of a retained
    graph scales the same gradients.

    What holds no contribution keeps its value, as ``F.cross_entropy``'s gradient does for a nan or
    inf ``grad_out``: the rows of ``dh`` whose ``target`` (this rank's tokens) is ``ignore_index``,
    and ``dW`` and ``db`` where ``counted`` (the valid tokens of the whole call, 0-dim) is 0."""
    dh, *rest = grads
    g_rest = grad_out if counted is None else torch.where(counted > 0, grad_out, torch.ones_like(grad_out))
    out = [None if dh is None else ops.scale_rows(dh, grad_out, out=torch.empty_like(dh), target=target,
                                                  ignore_index=ignore_index)]
    return tuple(out + [None if g is None else ops.scale_rows(g, g_rest, out=torch.empty_like(g)) for g in rest])


def scale_valid_unit_grads(call: Call, grads, grad_out: torch.Tensor, target: torch.Tensor) -> tuple:
    """:func:`scale_unit_grads` of a call's gradients made in forward, whose tokens count where
    ``target`` (this rank's) is not ignored: the ignored tokens' ``dh`` rows and, where the call
    (the whole group with sequence parallelism) has no valid token, ``dW`` and ``db`` keep their
    value."""
    return scale_unit_grads(call.ops(grad_out), grads, grad_out, target=target, ignore_index=call.spec.ignore_index,
                            counted=call.count_valid(target))


def chunk_losses(rows: Rows, c: int, per_token: torch.Tensor, reduction: str) -> torch.Tensor:
    """Per-token losses the output is made of: this rank's own tokens for ``none``; for mean/sum,
    all gathered tokens (with sequence parallelism the loss is over the whole group's tokens;
    padding rows are ignored tokens with loss 0)."""
    return rows.own(c, per_token) if reduction == "none" else per_token


def _part(x: torch.Tensor, sl: slice) -> torch.Tensor:
    """``x[sl]``, or ``x`` itself when ``sl`` spans all its rows (one chunk, one block: the common
    case), which saves a view op on the host path before the first GEMM."""
    return x if sl.start == 0 and sl.stop >= x.shape[0] and sl.step in (None, 1) else x[sl]


def cat_parts(parts: list, dim: int = 0) -> torch.Tensor:
    """``torch.cat`` without the copy kernel for one part (one chunk: the common case)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)
