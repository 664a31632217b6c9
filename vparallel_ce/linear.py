r"""``linear_cross_entropy``: lm_head matmul + vocab-parallel cross-entropy, never materialising the
logits of the whole local vocab for all tokens at once.

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

Under ``torch.autocast`` the matmuls run in the autocast dtype (``Call.matmul_dtype``), as
``F.linear`` would there; statistics are fp32 and each input's gradient comes back in its own dtype
(fp32 for fp32 master weights). Works with: any TP degree (uneven and empty shards), sequence
parallelism, DTensor weight ``Shard(0)`` / hidden, ``torch.compile`` (one custom op in the graph on
one rank, a graph break at the op under TP: :mod:`vparallel_ce.compiled`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from . import comm, compiled, invariant, policy as _policy
from .policy import GradMode
from .second_order import first_order_only
from .call import Call, autocast_off, linear_call, settles_check
from .options import Options
from .layout import aligned_parts, vocab_blocks
from .stats import (
    GradCoefs, block_targets, combine, compute_dtype, local_targets, merge, scale_coefs, token_loss,
    token_slices, unit_loss_coefs,
)

__all__ = ["linear_cross_entropy", "Schedule", "Rows", "ChunkTargets", "Grads", "Backward", "KeptLogits",
           "ChunkSaved", "Saved", "logits", "matmul_operand", "matmul_inputs", "grads_from_unit_dx",
           "scale_unit_grads", "scale_valid_unit_grads"]


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    group=None,
    sequence_parallel: bool = False,
    vocab_size: int | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    num_valid_tokens: int | torch.Tensor | None = None,
    z_loss: float = 0.0,
    softcap: float | None = None,
    chunks: int | str = "auto",
    schedule: str = "auto",
    recompute: bool | None = None,
    policy: _policy.ChunkPolicy | None = None,
    check: bool = True,
    check_replicated: bool = True,
    logits_dtype: torch.dtype | None = None,
    batch_invariant: bool = False,
) -> torch.Tensor:
    r"""``cross_entropy(hidden @ weight.T + bias, target)`` with ``weight`` sharded along the vocab.

    Args:
        hidden: ``[..., H]``, replicated over the group; with ``sequence_parallel=True``, this rank's
            token shard (any split of the tokens; ``target`` must be split the same way). A DTensor
            (Replicate, or sequence-sharded) is accepted.
        weight: ``[V_local, H]``, this rank's ``torch.chunk(W, world, 0)[rank]`` shard of the lm_head
            weight, or a DTensor ``Shard(0)`` (what ``ColwiseParallel`` gives), whose mesh sets the group.
        target: ``[...]`` (``hidden.shape[:-1]``) global class ids.
        bias: ``[V_local]`` shard, optional.
        group, vocab_size, ignore_index, reduction, label_smoothing, num_valid_tokens, z_loss, softcap,
        check: as in :func:`vparallel_ce.cross_entropy`. With ``sequence_parallel`` the ``sum``/``mean`` are over
            the tokens of the whole group (identical on every rank) and ``none`` returns this rank's
            tokens' losses.
        chunks: an int: that many token chunks (``chunks=1``: no chunking, the 3-matmul fast point),
            or vocab blocks with ``schedule="vocab"``; ``"auto"``: the policy sizes them and may pick
            the vocab schedule.
        schedule: ``"token"``, ``"vocab"`` or ``"auto"`` (token for an int ``chunks``, else the policy).
        recompute: ``True`` recomputes the logits in backward (flat forward memory: what a pipeline
            schedule holding several microbatches wants); ``False`` makes the gradients in forward
            (mean/sum only); ``None``, with one microbatch in flight: one token chunk keeps its logits
            for the backward (3 matmuls), several token chunks make the gradients in forward.
        policy: a :class:`vparallel_ce.policy.ChunkPolicy` (budget, microbatches in flight, ...).
            ``vparallel_ce.policy.explain`` with the same arguments prints the plan this call runs.
        check_replicated: with ``check`` on a group and without ``sequence_parallel``, check that
            ``hidden`` is the same on every rank (an integer sum of its bits rides on the call's
            exchange: one read of ``hidden``). ``False`` skips it, for a caller whose hidden states
            are known to differ on purpose (a pipeline's shape-inference call on uninitialised
            outputs, whose result is discarded).
        logits_dtype: ``None``: the logits are made in the matmul dtype (bf16 inputs round them to
            bf16 before the fp32 statistics). ``torch.float32``: the statistics, loss and the logits'
            gradient are made from the GEMM's fp32 result, never rounded (a no-op for fp32/fp64
            matmuls); the gradient GEMMs still take that gradient in the matmul dtype. See
            ``docs/rl.md`` ("Precision of the logits") for what it costs.
        batch_invariant: as in :func:`vparallel_ce.cross_entropy`, for the per-token loss and each
            token's row of ``hidden.grad``: the lm_head GEMMs run through torch one 128-row tile at a
            time (never the fused kernels), token chunks are whole tiles and the logits are
            recomputed in backward (``schedule`` and ``recompute`` are overridden); the hidden
            gradient is summed over the group in rank order. ``weight.grad``/``bias.grad`` sum over
            tokens and are not batch invariant. Not with ``sequence_parallel``.

    Returns:
        fp32 loss (fp64 for fp64 inputs): scalar for mean/sum, per-token for none. Gradients, each in
        its input's dtype: ``weight.grad``/``bias.grad`` are this shard's; ``hidden.grad`` is the full
        gradient (summed over the group), or this rank's token rows of it with ``sequence_parallel``.
    """
    options = Options(reduction=reduction, ignore_index=ignore_index, label_smoothing=label_smoothing,
                      num_valid_tokens=num_valid_tokens, z_loss=z_loss, softcap=softcap, chunks=chunks,
                      schedule=schedule, recompute=recompute, policy=policy, vocab_size=vocab_size,
                      sequence_parallel=sequence_parallel, check=check, check_replicated=check_replicated,
                      logits_dtype=logits_dtype, batch_invariant=batch_invariant)
    if torch.compiler.is_compiling():  # one custom op in the graph (vparallel_ce.compiled)
        out, shape = compiled.apply("linear_cross_entropy", (hidden, weight, target, bias), group, options)
    else:
        call, inp = linear_call(hidden, weight, target, bias, op="linear_cross_entropy", group=group, options=options)
        out, shape = _LinearCrossEntropy.apply(inp.h, inp.w, inp.b, inp.target, call), inp.shape
    return out.reshape(shape) if reduction == "none" else out


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


def _mm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, accumulate: bool) -> None:
    """``out (+)= a @ b`` with ``out`` possibly wider than ``a``/``b`` (fp32 vs bf16): the product
    is rounded at most once, and a running sum stays in ``out``'s precision."""
    if a.shape[-1] == 0:  # no rows in this chunk: nothing to add, and a sum that starts here is 0
        if not accumulate:
            out.zero_()
        return
    if a.dtype == out.dtype:
        if accumulate:
            out.addmm_(a, b)
        else:
            torch.mm(a, b, out=out)
    elif a.is_cuda and _CUDA_ADDMM_OUT_DTYPE:
        torch.ops.aten.addmm.dtype_out(out, a, b, out.dtype, beta=1 if accumulate else 0, out=out)
    elif accumulate:
        out.addmm_(a.to(out.dtype), b.to(out.dtype))
    else:
        torch.mm(a.to(out.dtype), b.to(out.dtype), out=out)


_CUDA_ADDMM_OUT_DTYPE = hasattr(torch.ops.aten.addmm, "dtype_out")


def _mm(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``a @ b`` as a new ``dtype`` tensor, rounded once (:func:`_mm_into`)."""
    out = torch.empty((a.shape[0], b.shape[1]), dtype=dtype, device=a.device)
    _mm_into(out, a, b, accumulate=False)
    return out


def _grad_in_place(ops, x, local_t, owned, shift, coefs, spec):
    """``grad_logits`` of a block's logits that this op owns (a temporary of ``F.linear``): written
    over them when the implementation can (one block-sized buffer less, no extra allocation)."""
    if ops.grad_logits_ is not None:
        return ops.grad_logits_(x, local_t, owned, shift, coefs, spec)
    return ops.grad_logits(x, local_t, owned, shift, coefs, spec)


def _in_block(local_t: torch.Tensor, owned: torch.Tensor, blk: slice, width: int):
    """Targets relative to a vocab block of a ``width``-column shard: (index clamped into the
    block, owned by the block)."""
    if blk.start == 0 and blk.stop >= width:  # the whole shard: nothing to launch
        return local_t, owned
    return block_targets(local_t, owned, blk.start, blk.stop)


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
    unsharded, not batch-invariant call with one vocab block -- is written straight into the
    input's dtype (one rounding either way, no fp32 buffer and no cast).

    ``kept_hidden`` (the plan's :attr:`~vparallel_ce.policy.WeightGrad.ONE_GEMM`, distillation): the
    call's ``[N, H]`` rows in the matmul dtype. Each chunk then writes its logits' gradient into
    its rows of one ``[N, V_loc]`` buffer (:meth:`kept_rows`), and :meth:`finish` makes ``dW`` from
    all of them in ONE GEMM with these rows, straight in the weight's dtype."""

    def __init__(self, h, w, b, need, *, acc_dtype, rows: Rows, schedule: "Schedule",
                 kept_hidden: torch.Tensor | None = None):
        need_h, need_w, need_b = need
        lay = rows.call.layout
        self.dtypes = (h.dtype, w.dtype, None if b is None else b.dtype)
        # batch invariant: one path whatever the chunk count (fp32 sums, dh by tiles, rank-ordered)
        self.invariant = rows.call.batch_invariant
        # (sequence parallelism implies a sharded vocab: its gathered rows are summed over the group)
        self.dh_direct = len(schedule.blocks) == 1 and not lay.sharded and not self.invariant
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
        if dh_rows is not None and self.invariant:
            invariant.add_rows_by_tiles(dh_rows, lambda tile: _mm(tile, w_blk, dh_rows.dtype), dx)
        elif dh_rows is not None:
            _mm_into(dh_rows, dx, w_blk, accumulate=not self.dh_direct)
        if self.dw is not None:  # (none with a kept buffer: dx is its rows, dW made at finish)
            begun = blk.start in self.dw_begun
            self.dw_begun.add(blk.start)
            _mm_into(_part(self.dw, blk), dx.t(), h_c, accumulate=begun)

    def end_chunk(self, rows: Rows, c: int, dh_rows) -> None:
        if dh_rows is not None and rows.call.sequence_parallel:
            self.dh[rows.local[c]] = rows.scatter_grad(c, dh_rows)

    def finish(self, rows: Rows) -> tuple:
        """Sum the replicated hidden's partial ``dh`` over the group; the gradients in the inputs' dtypes."""
        if self.kept is not None:  # allocated now, not beside the chunks' logits
            self.dw = torch.empty((self.kept.shape[1], self.kept_hidden.shape[1]), dtype=self.dtypes[1],
                                  device=self.kept.device)
            _mm_into(self.dw, self.kept.t(), self.kept_hidden, accumulate=False)
            self.kept = self.kept_hidden = None
        sp = rows.call.sequence_parallel  # then dh is this rank's rows, summed by end_chunk
        if self.dh is not None and self.invariant and rows.call.layout.sharded and not sp:
            # world x one chunk's rows at a time
            for sl in rows.local:
                self.dh[sl] = comm.all_reduce_sum_rank_ordered(self.dh[sl], rows.call.layout.group)
        elif self.dh is not None and not sp and not self.invariant:
            comm.all_reduce_sum_(self.dh, rows.call.layout.group)
        return tuple(g if g is None or g.dtype == dt else g.to(dt)
                     for g, dt in zip((self.dh, self.dw, self.db), self.dtypes))


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
        if call.plan.schedule == "token":
            return cls(call.plan.chunks, tuple(aligned_parts(call.layout.local_size)), keep_logits=keep_logits)
        return cls(1, tuple(vocab_blocks(call.layout.local_size, call.plan.chunks)), keep_logits=False)

    @staticmethod
    def keeps_for_backward(call: Call, need) -> bool:
        """Whether the forward keeps the logits for the backward (``Plan.keep_logits``)."""
        return call.plan.keep_logits and call.plan.schedule == "token" and any(need)

    def rows(self, call: Call) -> Rows:
        return Rows(call, self.row_chunks)

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
        chunk of one block, on a rank holding the whole vocab (no exchange between the statistics
        and the gradient), not sequence parallel; a bias only with a scalar upstream gradient."""
        return (self.keep_logits and self.row_chunks == 1 and len(self.blocks) == 1 and not call.layout.sharded
                and not call.sequence_parallel and not (b is not None and call.reduction == "none"))

    @staticmethod
    def fused(ops, call: Call, h_c, w) -> bool:
        """Whether the lm_head GEMM runs fused with the row passes (:mod:`vparallel_ce.kernels.fused_linear`)
        wherever logits are recomputed: their statistics or their gradient straight from the GEMM's
        epilogue, the logits never written."""
        return ops.fused is not None and ops.fused.covers(h_c, w, call.spec)

    def statistics(self, call: Call, ops, h_c, w, b, targets: "ChunkTargets"):
        """Global statistics of chunk ``c``'s rows ``h_c``: local statistics block by block, merged,
        one exchange. Returns them and the kept blocks' logits (empty unless ``keep_logits``).
        Fused, the whole shard is one GEMM whose epilogue makes the statistics (no logits, so no
        blocks: its memory is per-(256-column tile, row) partials). Unfused, the first block's GEMM
        is queued before the targets' small kernels, whose launches then overlap it."""
        if not self.keep_logits and self.fused(ops, call, h_c, w):
            local_t, owned, _ = targets()
            return combine(ops.fused.stats(h_c, w, b, local_t, owned, call.spec), call.layout,
                           rank_ordered=call.batch_invariant), []
        acc, kept = None, []
        for blk in self.blocks:
            x = logits(call, h_c, _part(w, blk), None if b is None else _part(b, blk))
            local_t, owned, _ = targets()
            idx, in_blk = _in_block(local_t, owned, blk, call.layout.local_size)
            st = ops.local_stats(x, idx, in_blk, call.spec)
            acc = st if acc is None else merge(acc, st)
            if self.keep_logits:
                kept.append(x)
            del x  # else the next block's logits are allocated while this one's are still alive
        return combine(acc, call.layout, rank_ordered=call.batch_invariant), kept

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
                idx, in_blk = _in_block(local_t, owned, blk, call.layout.local_size)
                x = kept[i] if kept else logits(call, h_c, w_blk, b_blk)
                if kept:
                    kept[i] = None  # its memory is reused by the gradient, then freed
                # fp32 logits (Call.logits_dtype) with no bias to sum their gradient in fp32: the
                # gradient is written once in the matmul dtype the two GEMMs take (the same single
                # rounding as an fp32 gradient copied down, without its write and read)
                narrow = h_c.dtype if x.dtype != h_c.dtype and grads.db is None else None
                if narrow is not None or (kept and compiled.KEPT_READ_ONLY.get()):  # (a compiled backward: read only)
                    dx = ops.grad_logits(x, idx, in_blk, shift, coefs, call.spec, narrow)
                else:
                    dx = _grad_in_place(ops, x, idx, in_blk, shift, coefs, call.spec)
                del x
            grads.add_block(blk, dx, h_c, w_blk, dh_rows)
            del dx  # free this block before the next one's is allocated
        grads.end_chunk(rows, c, dh_rows)


def logits(call: Call, h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """``h w^T + b`` (operands in the matmul dtype) in :attr:`Call.logits_dtype`: ``F.linear`` when
    that is the matmul dtype (None), else the GEMM's fp32 accumulator as it is -- ``mm``'s fp32
    output variant where the device has it (CUDA), else from operands upcast to fp32 here (CPU:
    exact products of bf16/fp16 values summed in fp32; the cost is an fp32 copy of this block of
    ``w`` and of ``h``'s rows per GEMM, and the slower fp32 GEMM). The bias is added in fp32."""
    if call.batch_invariant:  # one fixed-shape GEMM per tile: its kernel does not change with N
        return invariant.rows_by_tiles(lambda tile: _logits(call.logits_dtype, tile, w, b), h)
    return _logits(call.logits_dtype, h, w, b)


def _logits(wide: torch.dtype | None, h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    if wide is None:
        return F.linear(h, w, b)
    if h.is_cuda and _CUDA_MM_OUT_DTYPE:
        x = _mm_wide(h, w, wide)
    else:
        x = torch.mm(h.to(wide), w.to(wide).t())
    if b is not None:
        x += b
    return x


_CUDA_MM_OUT_DTYPE = hasattr(torch.ops.aten.mm, "dtype")

# A long K summed in the tensor cores' fp32 accumulator loses low bits (it truncates rather than
# rounds): against float64 the log-probs of one cuBLAS GEMM were 2.5-2.7e-6 off at H = 4096, and
# 1.1-1.3e-6 with K in two halves whose fp32 products add with round-to-nearest (addmm's beta = 1
# epilogue), for 1.15-1.24x the GEMM's time (H100; 4096 x 4096 x 151936 and 8192 x 4096 x 18992).
# Short sums gain little, so only a K of at least _SPLIT_K is split.
_SPLIT_K = 2048


def _mm_wide(h: torch.Tensor, w: torch.Tensor, wide: torch.dtype) -> torch.Tensor:
    """``h w^T`` in ``wide`` (fp32) from 16-bit operands on CUDA: ``mm``'s wide-output variant,
    over two halves of K where K is long (the second added by ``addmm`` into the first)."""
    k = h.shape[-1]
    if k < _SPLIT_K:
        return torch.ops.aten.mm.dtype(h, w.t(), wide)
    half = k // 2
    x = torch.ops.aten.mm.dtype(h[:, :half], w[:, :half].t(), wide)
    return torch.ops.aten.addmm.dtype_out(x, h[:, half:], w[:, half:].t(), wide, beta=1, out=x)


def matmul_operand(dx: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A logits' gradient as an operand of the gradient GEMMs: in the matmul ``dtype`` (fp32
    logits' fp32 gradient rounded once, as the matmul-dtype logits' gradient is made)."""
    return dx if dx.dtype == dtype else dx.to(dtype)


def matmul_inputs(call: Call, h, w, b):
    """The inputs cast to the matmul dtype (a no-op outside autocast)."""
    md = call.matmul_dtype

    def cast(x):  # a no-op cast still costs a dispatch: this runs twice per call
        return x if x is None or x.dtype == md else x.to(md)

    return cast(h), cast(w), cast(b)


class Backward(enum.Enum):
    """What a forward of :class:`_LinearCrossEntropy` leaves its backward, from the plan's
    :class:`~vparallel_ce.policy.GradMode` and the inputs that need a gradient."""

    #: ``GradMode.IN_FORWARD``: the gradients for an upstream gradient of 1; backward scales them
    SCALE = enum.auto()
    #: ``GradMode.FROM_KEPT_LOGITS`` on a rank holding the whole vocab (one chunk, one block): the
    #: kept logits were overwritten with their gradient for 1 by the statistics' kernel
    #: (:meth:`Schedule.grad_with_statistics`); backward scales the ``[N, H]`` side
    UNIT_LOGITS = enum.auto()
    #: ``GradMode.FROM_KEPT_LOGITS``: the gradient pass runs over the kept logits
    KEPT_LOGITS = enum.auto()
    #: ``GradMode.RECOMPUTE`` (or no input needs a gradient): the gradient pass recomputes them
    RECOMPUTE = enum.auto()

    @classmethod
    def of(cls, call: Call, need, b, schedule: "Schedule") -> "Backward":
        """``schedule``: the forward's (it keeps the logits unless this is ``RECOMPUTE``)."""
        if not any(need):
            return cls.RECOMPUTE
        if call.plan.grad_mode is GradMode.IN_FORWARD:
            return cls.SCALE
        if not Schedule.keeps_for_backward(call, need):
            return cls.RECOMPUTE
        return cls.UNIT_LOGITS if schedule.grad_with_statistics(call, b) else cls.KEPT_LOGITS

    @staticmethod
    def keeps_logits(call: Call, need) -> bool:
        """Whether the forward's schedule keeps its logits (for gradients in forward or backward)."""
        return any(need) and (call.plan.grad_mode is GradMode.IN_FORWARD or Schedule.keeps_for_backward(call, need))


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


@dataclass
class ChunkSaved:
    """What the backward needs of one token chunk: the global max ``shift`` and the loss' unit
    coefficients (:func:`~vparallel_ce.stats.unit_loss_coefs`) of its rows, and the forward's
    target maps ``(t_c, local_t, owned, valid)``. Under ``Backward.UNIT_LOGITS`` the coefficients
    are made only if a second backward recomputes (:meth:`coefs_for`), from ``unit``."""

    shift: torch.Tensor
    coefs: GradCoefs | None = None
    targets: tuple | None = None
    unit: tuple | None = None  # (statistics, t_c, n_valid)

    def coefs_for(self, call: Call) -> GradCoefs:
        if self.coefs is None:
            st, t_c, n_valid = self.unit
            valid = t_c != call.spec.ignore_index
            self.coefs = unit_loss_coefs(combine(st, call.layout, rank_ordered=call.batch_invariant), valid, n_valid, call.reduction, call.spec)
        return self.coefs


@dataclass
class Saved:
    """A forward's state for its backward (beside ``ctx.saved_tensors``: ``(h, w, b, t)``, or under
    ``Backward.SCALE`` the gradients for 1)."""

    call: Call
    mode: Backward
    need: tuple[bool, bool, bool]
    chunks: list[ChunkSaved] = field(default_factory=list)
    kept: KeptLogits = field(default_factory=KeptLogits)


class _LinearCrossEntropy(torch.autograd.Function):
    """Thin autograd wrapper: forward and backward walk the same :class:`Schedule`; what the
    forward leaves is a :class:`Saved` of one :class:`Backward` mode. Autocast is off inside; the
    matmul dtype comes from the :class:`Call`. The forward makes each chunk's gradient
    coefficients for an upstream gradient of 1 (:func:`~vparallel_ce.stats.unit_loss_coefs`); the
    backward scales them, or the gradients made from them."""

    @staticmethod
    def forward(ctx, h, w, b, t, call: Call):
        need = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], b is not None and ctx.needs_input_grad[2])
        with autocast_off(h.device.type):
            spec = call.spec
            hm, wm, bm = matmul_inputs(call, h, w, b)
            ops = call.ops(wm)
            sched = Schedule.of(call, keep_logits=Backward.keeps_logits(call, need))
            saved = Saved(call, Backward.of(call, need, b, sched), need)
            mode = saved.mode
            rows = sched.rows(call)
            grads = None
            if mode is Backward.SCALE:
                grads = Grads(h, w, b, need, acc_dtype=compute_dtype(wm.dtype), rows=rows, schedule=sched)
            n_valid, per_token = None, []
            for c, h_c, t_c, targets in sched.walk(call, rows, hm, t):
                if mode is Backward.UNIT_LOGITS:
                    # one kernel makes the chunk's target maps, statistics, loss, and the kept
                    # logits' gradient for 1 over them: besides it, the mean's divisor (at world 1 the
                    # target check's kernel, launched after this GEMM) and the reduction
                    x = logits(call, h_c, wm, bm)
                    n_valid = call.valid_count(t) if call.reduction == "mean" else None
                    st, loss_c = ops.loss_stats_grad_(x, t_c, n_valid, call.reduction, spec)
                    per_token.append(loss_c)
                    saved.kept.add([x])
                    # no kernels for the coefficients now; a recomputing walk makes the target maps again
                    saved.chunks.append(ChunkSaved(st.max, unit=(st, t_c, n_valid)))
                    continue
                st, kept = sched.statistics(call, ops, h_c, wm, bm, targets)
                local_t, owned, valid = targets()
                if n_valid is None:  # launched after the first GEMM too (mean's scale needs it from chunk 0)
                    whole = len(rows) == 1 and not call.sequence_parallel  # the chunk's mask is all of t's
                    n_valid = call.valid_count(t, valid if whole else None)
                coefs = unit_loss_coefs(st, valid, n_valid, call.reduction, spec)
                per_token.append(_keep(rows, c, token_loss(st, valid, spec), call.reduction))
                if mode is Backward.SCALE:
                    sched.gradients(call, ops, rows, c, h_c, wm, bm, local_t, owned, st.max, coefs, kept, grads)
                    continue
                saved.chunks.append(ChunkSaved(st.max, coefs, (t_c, local_t, owned, valid)))
                if mode is Backward.KEPT_LOGITS:
                    saved.kept.add(kept)
            if n_valid is None and call.reduction == "mean":
                n_valid = call.valid_count(t)
            ctx.saved = saved
            if mode is Backward.SCALE:  # only [N, H] / [V_loc, H] gradients (and the targets) are kept, no logits
                ctx.save_for_backward(*grads.finish(rows), t)
            else:
                ctx.save_for_backward(h, w, b, t)
            return call.loss_output(ctx, ops, _cat(per_token), n_valid)

    @staticmethod
    @first_order_only("linear_cross_entropy")
    @settles_check
    def backward(ctx, grad_out):
        saved: Saved = ctx.saved
        call = saved.call
        if saved.mode is Backward.SCALE:  # made in forward for grad_out == 1: scale by the scalar
            *grads, t = ctx.saved_tensors
            return scale_valid_unit_grads(call, grads, grad_out, t) + (None, None)
        h, w, b, t = ctx.saved_tensors
        with autocast_off(h.device.type):
            hm, wm, bm = matmul_inputs(call, h, w, b)
            ops = call.ops(wm)
            kept_chunks = saved.kept.take()  # empty on a second backward of the graph: it recomputes
            if saved.mode is Backward.UNIT_LOGITS and kept_chunks:
                g = grad_out
                if call.reduction == "none":  # an ignored token's rows stay 0 whatever its g (nan too)
                    g = torch.where(t != call.spec.ignore_index, g.reshape(-1), 0)
                return grads_from_unit_dx(ops, kept_chunks[0][0], h, w, b, hm, wm, g, saved.need, t,
                                          call.spec.ignore_index) + (None, None)
            sched = Schedule.of(call, keep_logits=False)
            rows = sched.rows(call)
            grads = Grads(h, w, b, saved.need, acc_dtype=compute_dtype(wm.dtype), rows=rows, schedule=sched)
            known = [chunk.targets for chunk in saved.chunks] if saved.mode is not Backward.UNIT_LOGITS else None
            for c, h_c, t_c, targets in sched.walk(call, rows, hm, t, known):
                local_t, owned, _ = targets()
                g = rows.gather(c, grad_out.reshape(-1)) if call.reduction == "none" else grad_out
                chunk = saved.chunks[c]
                sched.gradients(call, ops, rows, c, h_c, wm, bm, local_t, owned, chunk.shift,
                                scale_coefs(chunk.coefs_for(call), g), kept_chunks[c] if kept_chunks else [], grads)
            return grads.finish(rows) + (None, None)


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

def grads_from_unit_dx(ops, dx, h, w, b, hm, wm, g, need, target, ignore_index) -> tuple:
    """``(dh, dW, db)`` from ``dx [N, V]``, the logits' gradient for an upstream gradient of 1 that
    the forward made (:meth:`Schedule.grad_with_statistics`), and the upstream ``g`` (a scalar, or
    per token for ``none``)::

        dW = dx^T (g h),    dh = g (dx W),    db = g sum_i dx_i

    ``g`` goes on the ``[N, H]`` operand and result, never on ``dx`` (that would be one more pass
    over the logits). ``g h`` is formed in fp32, rounded once into the matmul dtype (exact for
    ``g = 1``) and freed before ``dh`` is allocated, so the peak is ``dx + dW + dh``, as with the
    gradient pass of the kept logits. fp32 logits (``Call.logits_dtype``) leave an fp32 ``dx`` here
    (the forward's kernel writes it over them): ``db`` sums it as it is, the GEMMs take a copy in
    the matmul dtype.

    An ignored token's (``target == ignore_index``) rows of ``g h`` and ``dh`` are not scaled: its
    row of ``dx`` is 0, so whatever ``g`` (nan, inf) it adds nothing to ``dW`` and its ``dh`` row
    stays ``0 W``, as ``F.cross_entropy``'s; ``db`` takes ``g`` only where some token is valid."""
    need_h, need_w, need_b = need
    dh = dw = db = None
    if need_b and b is not None:  # a scalar g: a bias with reduction="none" does not take this path
        cdt = compute_dtype(dx.dtype)
        g_b = torch.where((target != ignore_index).any(), g.to(cdt), torch.ones((), dtype=cdt, device=g.device))
        db = (dx.sum(0, dtype=cdt) * g_b).to(b.dtype)
    dx = matmul_operand(dx, hm.dtype)
    if need_w:
        gh = ops.scale_rows(hm, g, target=target, ignore_index=ignore_index)
        dw = torch.empty_like(w)
        _mm_into(dw, dx.t(), gh, accumulate=False)
        del gh
    if need_h:
        dh = torch.empty_like(h)
        _mm_into(dh, dx, wm, accumulate=False)
        ops.scale_rows(dh, g, out=dh, target=target, ignore_index=ignore_index)
    return dh, dw, db


def _keep(rows: Rows, c: int, per_token: torch.Tensor, reduction: str) -> torch.Tensor:
    """Per-token losses the output is made of: this rank's own tokens for ``none``; for mean/sum,
    all gathered tokens (with sequence parallelism the loss is over the whole group's tokens;
    padding rows are ignored tokens with loss 0)."""
    return rows.own(c, per_token) if reduction == "none" else per_token


def _part(x: torch.Tensor, sl: slice) -> torch.Tensor:
    """``x[sl]``, or ``x`` itself when ``sl`` spans all its rows (one chunk, one block: the common
    case), which saves a view op on the host path before the first GEMM."""
    return x if sl.start == 0 and sl.stop >= x.shape[0] and sl.step in (None, 1) else x[sl]


def _cat(parts: list, dim: int = 0) -> torch.Tensor:
    """``torch.cat`` without the copy kernel for one part (one chunk: the common case)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


compiled.register("linear_cross_entropy", _LinearCrossEntropy,
                  compiled.front_door(linear_call, lambda inp: (inp.h, inp.w, inp.b, inp.target)),
                  grad_of=(0, 1, 3, None, None), target=2, optional={3})
