r"""``linear_cross_entropy``: lm_head matmul + vocab-parallel cross-entropy, never materialising the
logits of the whole local vocab for all tokens at once.

Two exact schedules over the same per-chunk math (:mod:`vparallel_ce.stats`), with ``x = h W^T + b``
the logits of this rank's vocab shard:

**token** -- split the tokens into chunks. Per chunk ``c``: ``x_c = h_c W^T`` (matmul 1), statistics
and their two all-reduces, then (when gradients are made in forward) ``dx_c``, ``dh_c = dx_c W``
(matmul 2, each row block out of one matmul) and ``dW += dx_c^T h_c`` (matmul 3) into an fp32
accumulator (``4 V_loc H`` bytes; skipped with one chunk, where dW is one matmul). 3 matmuls of
``2 N H V_loc`` FLOPs with grads in forward; 4 when the backward recomputes ``x_c``.

**vocab** -- split the local vocab into blocks. Pass 1 (forward): ``x_b = h W_b^T`` over all tokens,
merge per-token ``(max, sumexp)`` across blocks (online softmax), then ONE all-reduce pair for all
tokens. Pass 2 (backward): recompute ``x_b``, ``dx_b``; ``dW_b = dx_b^T h`` comes out of a single
matmul over all tokens (no accumulation); ``dh += dx_b W_b`` in fp32. 4 matmuls, memory at the
floor, 2 collectives per call.

``hidden.grad`` is the FULL gradient: the vocab shards' partial ``dh`` are all-reduced over the group
(Megatron's "f" operator); with ``sequence_parallel=True`` each chunk's rows are all-gathered from the
ranks' token shards and ``dh`` is reduce-scattered back. Gradient accumulations across chunks or
blocks are always fp32; each is cast once at the end to the parameter's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from . import kernels, policy as _policy
from .layout import (
    VocabLayout, all_gather_rows, all_reduce_sum_, reduce_scatter_rows, resolve_group, unwrap_linear, vocab_layout,
)
from .stats import (
    LossSpec, combine, compute_dtype, local_targets, merge, reduce, token_grad_scale, token_loss,
    token_slices,
)
from .validate import Problem, check_linear, check_options, check_owned

__all__ = ["linear_cross_entropy"]

SCHEDULES = ("auto", "token", "vocab")


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
    z_loss: float = 0.0,
    softcap: float | None = None,
    chunks: int | str = "auto",
    schedule: str = "auto",
    recompute: bool | None = None,
    policy: _policy.ChunkPolicy | None = None,
    check: bool = True,
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
        group, vocab_size, ignore_index, reduction, label_smoothing, z_loss, softcap, check: as in
            :func:`vparallel_ce.cross_entropy`. With ``sequence_parallel`` the ``sum``/``mean`` are over
            the tokens of the whole group (identical on every rank) and ``none`` returns this rank's
            tokens' losses.
        chunks: token chunks (``token`` schedule) or vocab blocks (``vocab``), or ``"auto"``.
        schedule: ``"token"``, ``"vocab"`` or ``"auto"`` (the policy picks from the memory budget).
        recompute: ``True`` recomputes the logits in backward (flat forward memory: what a pipeline
            schedule holding several microbatches wants); ``False`` makes the gradients in forward
            (mean/sum only: 3 matmuls); ``None``: the policy decides. ``reduction="none"`` always
            recomputes.
        policy: a :class:`vparallel_ce.policy.ChunkPolicy` (budget, microbatches in flight, ...).

    Returns:
        fp32 loss (fp64 for fp64 inputs): scalar for mean/sum, per-token for none. Gradients:
        ``weight.grad``/``bias.grad`` are this shard's; ``hidden.grad`` is the full gradient (summed
        over the group), or this rank's token rows of it with ``sequence_parallel``.
    """
    hidden, weight, target, bias, group, dt_vocab = unwrap_linear(hidden, weight, target, bias, group, sequence_parallel)
    vocab_size = vocab_size if dt_vocab is None else dt_vocab
    group = resolve_group(group)
    problem = check_options(
        reduction=reduction, label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap, chunks=chunks
    ) or check_linear(hidden, weight, target, bias)
    if problem is None and schedule not in SCHEDULES:
        problem = Problem(ValueError, f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    ok = problem is None
    device = weight.device if isinstance(weight, torch.Tensor) else torch.device("cpu")
    agree = {
        "chunks option": (-1 if chunks == "auto" else chunks) if ok else 0,
        "schedule option": SCHEDULES.index(schedule) if ok else 0,
        "hidden size": weight.shape[-1] if ok else 0,
        "sequence_parallel": int(bool(sequence_parallel)),
    }
    if not sequence_parallel:  # the same keys on every rank, valid input or not
        agree["token count"] = target.numel() if ok else 0
        agree["target checksum"] = target.sum() if ok else 0
    lay = vocab_layout(
        weight.shape[0] if ok else 0, group, device=device, vocab_size=vocab_size,
        check=check, agree=agree, problem=problem,
    )
    spec = LossSpec(lay.vocab_size, ignore_index, float(label_smoothing), float(z_loss), softcap)
    h = hidden.reshape(-1, hidden.shape[-1])
    t = target.reshape(-1)
    counts = _token_counts(t.numel(), lay, device) if sequence_parallel and lay.sharded else [t.numel()]
    pol = policy or _policy.DEFAULT_POLICY
    if recompute is not None:
        pol = replace(pol, grad_in_forward=not recompute)
    plan = pol.plan(sum(counts), lay.vocab_size, lay.world, hidden_size=h.shape[-1], reduction=reduction,
                    schedule=schedule)
    if chunks != "auto":
        plan = replace(plan, chunks=int(chunks))
    cfg = _Config(lay, spec, reduction, plan, bool(sequence_parallel) and lay.sharded, tuple(counts), check)
    out = _LinearCrossEntropy.apply(h, weight, bias, t, cfg)
    return out.reshape(target.shape) if reduction == "none" else out


@dataclass(frozen=True)
class _Config:
    lay: VocabLayout
    spec: LossSpec
    reduction: str
    plan: _policy.Plan
    sequence_parallel: bool
    counts: tuple  # token count of every rank (sequence parallel) or of this rank
    check: bool


def _token_counts(n: int, lay: VocabLayout, device) -> list[int]:
    rows = all_gather_rows(torch.tensor([n], dtype=torch.int64, device=device), lay)
    return rows.tolist()


class _Rows:
    """Which token rows a chunk holds. Replicated hidden: a slice of the local rows. Sequence
    parallel: every rank's c-th slice of its own rows, padded to a common height (padding rows get
    ``ignore_index`` and so contribute nothing) and all-gathered in rank order."""

    def __init__(self, cfg: _Config, chunks: int):
        self.cfg = cfg
        lay = cfg.lay
        n_local = cfg.counts[lay.rank] if cfg.sequence_parallel else cfg.counts[0]
        self.local = token_slices(n_local, chunks)
        if cfg.sequence_parallel:
            per_rank = [token_slices(n, len(self.local)) for n in cfg.counts]
            self.height = [max(s[c].stop - s[c].start for s in per_rank) for c in range(len(self.local))]
        else:
            self.height = [s.stop - s.start for s in self.local]

    def __len__(self):
        return len(self.local)

    def gather(self, c: int, x: torch.Tensor, fill=0) -> torch.Tensor:
        """Rows of chunk ``c`` of ``x`` (hidden, target or a per-token vector) over the group."""
        part = x[self.local[c]]
        if not self.cfg.sequence_parallel:
            return part
        pad = self.height[c] - part.shape[0]
        if pad:
            part = torch.cat([part, part.new_full((pad, *part.shape[1:]), fill)])
        return all_gather_rows(part, self.cfg.lay)

    def own(self, c: int, rows: torch.Tensor) -> torch.Tensor:
        """This rank's rows out of chunk ``c``'s gathered per-row values (identical on all ranks)."""
        if not self.cfg.sequence_parallel:
            return rows
        start = self.cfg.lay.rank * self.height[c]
        return rows[start : start + self.local[c].stop - self.local[c].start]

    def scatter_grad(self, c: int, dh: torch.Tensor) -> torch.Tensor:
        """Chunk ``c``'s partial hidden gradient -> this rank's rows (summed over the group with
        sequence parallelism; replicated hidden is all-reduced once, in :meth:`finish`)."""
        if not self.cfg.sequence_parallel:
            return dh
        return reduce_scatter_rows(dh, self.cfg.lay)[: self.local[c].stop - self.local[c].start]

    def finish(self, dh_local: torch.Tensor) -> torch.Tensor:
        if not self.cfg.sequence_parallel:
            all_reduce_sum_(dh_local, self.cfg.lay)
        return dh_local


def _addmm_fp32_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` with ``acc`` fp32/fp64 and a, b possibly bf16: the product is rounded at most
    once, and the running sum stays in ``acc``'s precision."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    elif a.is_cuda and _CUDA_ADDMM_OUT_DTYPE:
        torch.ops.aten.addmm.dtype_out(acc, a, b, acc.dtype, out=acc)
    else:
        acc.addmm_(a.to(acc.dtype), b.to(acc.dtype))


_CUDA_ADDMM_OUT_DTYPE = hasattr(torch.ops.aten.addmm, "dtype_out")


def _grad_in_place(ops, x, local_t, owned, lse, gscale, spec):
    """``grad_logits`` of a chunk's logits that this op owns (a temporary of ``F.linear``): written
    over them when the implementation can (one chunk-sized buffer less, no extra allocation)."""
    in_place = getattr(ops, "grad_logits_", None)
    if in_place is not None:
        return in_place(x, local_t, owned, lse, gscale, spec)
    return ops.grad_logits(x, local_t, owned, lse, gscale, spec)


class _Grads:
    """fp32 gradient buffers of one call, cast once to the inputs' dtypes at the end."""

    def __init__(self, h, w, b, need, rows_total, acc_dtype, dw_accumulate: bool):
        self.need_h, self.need_w, self.need_b = need
        self.dh = torch.zeros(rows_total, h.shape[-1], dtype=acc_dtype, device=h.device) if self.need_h else None
        wdt = acc_dtype if dw_accumulate else w.dtype
        self.dw = (torch.zeros if dw_accumulate else torch.empty)(w.shape, dtype=wdt, device=w.device) if self.need_w else None
        self.db = torch.zeros(w.shape[0], dtype=acc_dtype, device=w.device) if (self.need_b and b is not None) else None

    def cast(self, h, w, b):
        return (
            None if self.dh is None else self.dh.to(h.dtype),
            None if self.dw is None else self.dw.to(w.dtype),
            None if self.db is None else self.db.to(b.dtype),
        )


def _aligned_parts(local_size: int) -> list[slice]:
    """The token schedule's vocab parts: the whole shard, or -- when its width is not a multiple of
    8 -- a 128-aligned main part and a narrow tail. cuBLAS runs GEMMs whose leading dimension is
    odd on slow kernels (~120 TFLOP/s at V=32777 on an H200); the split keeps the main part's three
    GEMMs aligned without copying or padding the weight."""
    main = local_size - local_size % 128
    if local_size % 8 == 0 or main == 0:
        return [slice(0, local_size)]
    return [slice(0, main), slice(main, local_size)]


def _vocab_blocks(local_size: int, blocks: int) -> list[slice]:
    """About ``blocks`` contiguous blocks of the local vocab, their starts and widths multiples of
    128 where the shard is wide enough (aligned leading dimensions keep cuBLAS on its fast
    kernels); the count may come out lower than asked. Blocks need no agreement across ranks."""
    if not local_size:
        return [slice(0, 0)]
    k = max(1, min(int(blocks), local_size))
    unit = 128 if local_size >= 128 * k else 1
    per = -(-(-(-local_size // k)) // unit) * unit
    return [slice(s, min(s + per, local_size)) for s in range(0, local_size, per)]


def _in_block(local_t: torch.Tensor, owned: torch.Tensor, blk: slice):
    """Targets relative to a vocab block: (index clamped into the block, owned by the block)."""
    in_blk = owned & (local_t >= blk.start) & (local_t < blk.stop)
    return (local_t - blk.start).clamp(0, max(blk.stop - blk.start - 1, 0)), in_blk


def _block_stats(h, w, b, local_t, owned, blocks, spec, ops, keep: bool):
    """Local statistics of the rows ``h`` over the given vocab blocks, merged (online softmax).
    ``keep``: also return each block's logits, for a gradient pass that must not recompute them."""
    acc, kept = None, []
    for blk in blocks:
        x = F.linear(h, w[blk], None if b is None else b[blk])
        idx, in_blk = _in_block(local_t, owned, blk)
        st = ops.local_stats(x, idx, in_blk, spec)
        acc = st if acc is None else merge(acc, st)
        if keep:
            kept.append(x)
        del x  # else the next block's logits are allocated while this one's are still alive
    return acc, kept


def _block_grads(h, w, b, local_t, owned, blocks, kept, lse, gscale, spec, ops, grads, dh_rows, dw_accumulate):
    """Gradients of the rows ``h`` over the vocab blocks: ``dh_rows += dx_b W_b`` (fp32), and each
    block's dW from one matmul (``dW_b = dx_b^T h``, or ``+=`` into the fp32 accumulator when the
    token schedule visits the block once per chunk). ``kept``: the blocks' logits, else recomputed."""
    for i, blk in enumerate(blocks):
        if blk.stop == blk.start:
            continue
        x = kept[i] if kept else F.linear(h, w[blk], None if b is None else b[blk])
        if kept:
            kept[i] = None  # its memory is reused by the gradient, then freed
        idx, in_blk = _in_block(local_t, owned, blk)
        dx = _grad_in_place(ops, x, idx, in_blk, lse, gscale, spec)
        if dh_rows is not None:
            _addmm_fp32_(dh_rows, dx, w[blk])
        if grads.dw is not None:
            if dw_accumulate:
                _addmm_fp32_(grads.dw[blk], dx.t(), h)
            else:
                torch.mm(dx.t(), h, out=grads.dw[blk])
        if grads.db is not None:
            grads.db[blk] += dx.to(grads.db.dtype).sum(0)
        del x, dx  # free this block before the next one's logits are allocated


def _token_pass(h, w, b, t, cfg: _Config, *, saved_lse=None, gscale_of=None, need=(True, True, True)):
    """The token schedule. Forward (``saved_lse is None``): statistics and per-token losses; with
    ``gscale_of`` also the gradients, from the same logits (3 matmuls). Backward: ``saved_lse``
    given, the logits are recomputed for the gradients."""
    lay, spec = cfg.lay, cfg.spec
    ops = kernels.ops_for(w)
    rows = _Rows(cfg, cfg.plan.chunks)
    parts = _aligned_parts(lay.local_size)
    grads = None
    if gscale_of is not None:
        grads = _Grads(h, w, b, need, h.shape[0], compute_dtype(w.dtype), dw_accumulate=len(rows) > 1)
    lse_parts, loss_parts, checks = [], [], []
    lse_at = 0
    for c in range(len(rows)):
        h_c = rows.gather(c, h)
        t_c = rows.gather(c, t, fill=spec.ignore_index)
        local_t, owned, valid = local_targets(t_c, lay.offset, lay.local_size, spec.ignore_index)
        kept = []
        if saved_lse is None:
            local, kept = _block_stats(h_c, w, b, local_t, owned, parts, spec, ops, keep=grads is not None)
            st = combine(local, lay)
            lse_c = st.lse
            lse_parts.append(lse_c)
            loss_parts.append(_keep(rows, c, token_loss(st, valid, spec), cfg.reduction))
            checks.append((st.owned, valid, t_c))
        else:
            lse_c = saved_lse[lse_at : lse_at + t_c.shape[0]]
            lse_at += t_c.shape[0]
        if grads is None:
            continue
        dh_rows = None
        if grads.dh is not None:
            # replicated hidden: this chunk's rows of the fp32 buffer (all-reduced in finish);
            # sequence parallel: the gathered rows, reduce-scattered back to this rank's rows
            dh_rows = torch.zeros_like(h_c, dtype=grads.dh.dtype) if cfg.sequence_parallel else grads.dh[rows.local[c]]
        _block_grads(h_c, w, b, local_t, owned, parts, kept, lse_c, gscale_of(rows, c, valid), spec, ops,
                     grads, dh_rows, dw_accumulate=len(rows) > 1)
        if cfg.sequence_parallel and dh_rows is not None:
            grads.dh[rows.local[c]] = rows.scatter_grad(c, dh_rows)
    if grads is not None and grads.dh is not None:
        rows.finish(grads.dh)
    if saved_lse is None and cfg.check:
        check_owned(*(torch.cat(parts) for parts in zip(*checks)), spec.vocab_size)
    lse = torch.cat(lse_parts) if lse_parts else None
    per_token = torch.cat(loss_parts) if loss_parts else None
    return lse, per_token, grads


def _vocab_pass1(h_all, t_all, w, b, cfg: _Config):
    """Statistics over all tokens, one vocab block at a time; one exchange at the end."""
    lay, spec = cfg.lay, cfg.spec
    local_t, owned, valid = local_targets(t_all, lay.offset, lay.local_size, spec.ignore_index)
    blocks = _vocab_blocks(lay.local_size, cfg.plan.chunks)
    local, _ = _block_stats(h_all, w, b, local_t, owned, blocks, spec, kernels.ops_for(w), keep=False)
    return combine(local, lay), valid


def _vocab_pass2(rows: _Rows, h_all, t_all, w, b, lse, gscale_of, cfg: _Config, need):
    """Gradients: each dW block from ONE matmul over all tokens; dh summed over blocks in fp32,
    then summed over the group (all-reduce, or reduce-scatter to this rank's rows with SP)."""
    lay, spec = cfg.lay, cfg.spec
    local_t, owned, valid = local_targets(t_all, lay.offset, lay.local_size, spec.ignore_index)
    grads = _Grads(h_all, w, b, need, h_all.shape[0], compute_dtype(w.dtype), dw_accumulate=False)
    blocks = _vocab_blocks(lay.local_size, cfg.plan.chunks)
    _block_grads(h_all, w, b, local_t, owned, blocks, [], lse, gscale_of(rows, 0, valid), spec, kernels.ops_for(w),
                 grads, grads.dh, dw_accumulate=False)
    if grads.dh is not None:
        grads.dh = rows.finish(rows.scatter_grad(0, grads.dh))
    return grads


def _all_rows(h, t, cfg: _Config):
    """The vocab schedule works on every token at once: all of them, gathered with SP."""
    rows = _Rows(cfg, 1)
    return rows, rows.gather(0, h), rows.gather(0, t, fill=cfg.spec.ignore_index)


class _LinearCrossEntropy(torch.autograd.Function):
    """Thin autograd wrapper over the two schedules' passes."""

    @staticmethod
    def forward(ctx, h, w, b, t, cfg: _Config):
        need = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], b is not None and ctx.needs_input_grad[2])
        n_valid = _valid_count(t, cfg)
        in_forward = cfg.plan.grad_in_forward and cfg.reduction != "none" and any(need)
        one = torch.ones((), dtype=compute_dtype(w.dtype), device=w.device)
        gscale_of = _gscale_fn(one, n_valid, cfg) if in_forward else None
        if cfg.plan.schedule == "token":
            lse, per_token, grads = _token_pass(h, w, b, t, cfg, gscale_of=gscale_of, need=need)
        else:
            rows, h_all, t_all = _all_rows(h, t, cfg)
            st, valid = _vocab_pass1(h_all, t_all, w, b, cfg)
            if cfg.check:
                check_owned(st.owned, valid, t_all, cfg.spec.vocab_size)
            lse = st.lse
            per_token = _keep(rows, 0, token_loss(st, valid, cfg.spec), cfg.reduction)
            grads = None
            if in_forward:
                grads = _vocab_pass2(rows, h_all, t_all, w, b, lse, gscale_of, cfg, need)
        ctx.cfg, ctx.need, ctx.in_forward = cfg, need, grads is not None
        if grads is not None:  # only [N, H] / [V_loc, H] gradients are kept, no logits
            ctx.save_for_backward(*grads.cast(h, w, b))
        else:
            ctx.save_for_backward(h, w, b, t, lse, n_valid)
        return reduce(per_token, n_valid, cfg.reduction)

    @staticmethod
    def backward(ctx, grad_out):
        cfg = ctx.cfg
        if ctx.in_forward:  # made in forward for grad_out == 1: scale by the scalar
            grads = tuple(None if g is None else g * grad_out.to(g.dtype) for g in ctx.saved_tensors)
            return grads + (None, None)
        h, w, b, t, lse, n_valid = ctx.saved_tensors
        gscale_of = _gscale_fn(grad_out, n_valid, cfg)
        if cfg.plan.schedule == "token":
            _, _, grads = _token_pass(h, w, b, t, cfg, saved_lse=lse, gscale_of=gscale_of, need=ctx.need)
        else:
            rows, h_all, t_all = _all_rows(h, t, cfg)
            grads = _vocab_pass2(rows, h_all, t_all, w, b, lse, gscale_of, cfg, ctx.need)
        return grads.cast(h, w, b) + (None, None)


def _keep(rows: _Rows, c: int, per_token: torch.Tensor, reduction: str) -> torch.Tensor:
    """Per-token losses the output is made of: this rank's own tokens for ``none``; for mean/sum,
    all gathered tokens (with sequence parallelism the loss is over the whole group's tokens;
    padding rows are ignored tokens with loss 0)."""
    return rows.own(c, per_token) if reduction == "none" else per_token


def _valid_count(t: torch.Tensor, cfg: _Config) -> torch.Tensor:
    n = (t != cfg.spec.ignore_index).sum()
    if cfg.sequence_parallel:  # mean over the tokens of the whole group
        all_reduce_sum_(n, cfg.lay)
    return n


def _gscale_fn(grad_out: torch.Tensor, n_valid, cfg: _Config):
    """``(rows, c, valid) -> g`` for the gathered rows of chunk ``c``."""
    cdt = grad_out.dtype  # the loss' dtype: fp32, or fp64 for fp64 inputs

    def gscale_of(rows: _Rows, c: int, valid: torch.Tensor) -> torch.Tensor:
        g = grad_out
        if cfg.reduction == "none":
            g = rows.gather(c, grad_out.reshape(-1))
        return token_grad_scale(g, valid, n_valid, cfg.reduction, cdt)

    return gscale_of
