r"""Batch invariance (``batch_invariant=True``): a token's outputs do not depend on the other tokens
of the call.

Floating-point sums are not associative, so a row's result is bitwise the same in two calls only if
its every sum is taken in the same order. In the default mode three things change that order with
the number of tokens ``N``: the GEMM kernels (cuBLAS / MKL pick a kernel, split-K included, by the
shape ``[N_chunk, H] x [H, V]``), torch's reductions over the vocab (their strategy depends on the
shape too, e.g. ATen splits the reduced dim over threads when there are few rows), and the SUM
all-reduce of the ranks' partials (NCCL's ring or tree, chunked by message size). The default
plans also switch with ``N`` between paths that round a row differently. This mode fixes all of it,
on one of two paths chosen by device and dtype alone (:func:`ops_for`, a
:class:`vparallel_ce.kernels.KernelBackend`):

* **Kernels** (bf16 / fp16 on a GPU with Triton: :func:`vparallel_ce.kernels.invariant_ops`). The
  lm_head GEMMs -- the logits ``h W^T`` and the hidden gradient ``dx W``, a sum over the vocab --
  run as Triton GEMMs of ONE fixed tile config whatever the shape (:mod:`vparallel_ce.kernels.row_gemm`):
  each output tile is one program's fp32 accumulator over the whole of ``K`` in order, no split-K,
  no atomics, so an output element is the same sequence of MMA instructions wherever its row sits;
  the TMA-or-masked-loads choice, the only input that could change the config, is made a property
  of ``H``, ``V_local`` and the weight (an unaligned block of rows is copied). The row passes over
  the logits (statistics, gradient) are the Triton kernels of the default mode: one program per
  row, their tile width set by the vocab block's. ``dW = dx^T h`` stays cuBLAS: it sums over
  tokens. No padded tiles and no per-tile copies: near the default's speed.
* **Tiles** (CPU, fp32 / fp64 on a GPU, the ``torch`` kernel choice: :data:`OPS`). Every per-row
  GEMM and reduction runs on tiles of exactly :data:`TILE_ROWS` rows, the last one padded (zero
  rows, ignored target), each a fresh contiguous copy (the same alignment for every tile, so a
  kernel's vectorised loads never depend on where the rows sat in the caller's tensor). A kernel
  then only ever sees shapes made of ``TILE_ROWS``, ``H`` and the vocab block's width; where in a
  tile a row sits does not change the order of its own sums. Per-row sums over the vocab
  (:func:`block_row_sum`) are taken over :data:`VOCAB_BLOCK`-wide blocks of a zero-padded copy,
  then over the blocks (the max is exact in any order).

On both paths:

* **One walk.** Token chunks are whole tiles (:func:`vparallel_ce.stats.token_slices` with
  ``tile``); the linear ops walk the shard's vocab in the blocks of :func:`blocks`, a function of
  ``V_local`` alone, whichever walk the policy picks by ``N`` (token chunks, or one chunk of all
  tokens), and make the gradients in backward from logits kept or recomputed -- the same bits
  (:func:`plan`). ``chunks`` only groups rows between two exchanges: no sum crosses rows.
* **Rank order.** Sums over the TP group gather every rank's partials and add them in rank order
  (:func:`vparallel_ce.comm.all_reduce_sum_rank_ordered`); the MAX all-reduce stays (exact).

Sums over TOKENS (``weight.grad``, ``bias.grad``, a ``mean``/``sum`` loss) are deterministic for a
given batch but, by nature, not batch invariant. The sampling-set path (``support=``) runs on the
whole shard's logits masked to each row's set (:mod:`vparallel_ce.sampling_set`). ``docs/rl.md``
("Batch invariance") states what is guaranteed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from . import kernels, stats
from .layout import vocab_blocks
from .plan import local_vocab
from .policy import ChunkPolicy, GradMode, Plan

__all__ = ["TILE_ROWS", "VOCAB_BLOCK", "VOCAB_BLOCK_COLUMNS", "blocks", "tiles", "tile_of", "block_row_sum",
           "local_stats", "grad_logits", "rows_by_tiles", "add_rows_by_tiles", "plan", "ops_for", "OPS"]

#: Rows of every tile. 128 is the row-block height of the GEMM kernels (cuBLAS/CUTLASS and the
#: library's Triton kernels tile M by 64 or 128; MKL's micro-kernels by a few rows), so a tile is
#: whole row blocks and a per-tile GEMM runs at the speed of a large one; ``128 * width`` is a
#: multiple of every SIMD width, so an elementwise kernel over a tile has no scalar tail; and the
#: padding of a short call (one token: 127 zero rows) stays small next to the lm_head weight's read.
TILE_ROWS = 128

#: Width of the vocab blocks of :func:`block_row_sum`: a multiple of the SIMD and warp widths.
VOCAB_BLOCK = 256

#: The widest vocab block the linear ops walk (:func:`blocks`), whatever ``N``: wide enough that a
#: TP shard of a 128k-152k vocab is one block (whose ``dh`` one GEMM writes straight in ``h``'s
#: dtype) and a whole such vocab 4-5, whose logits at 8k tokens stay within the default policy's
#: budget (1 GiB, counted in fp32); at more tokens one block's logits grow with ``N``.
VOCAB_BLOCK_COLUMNS = 32768


def tiles(n: int) -> list[slice]:
    """The tiles of ``n`` rows: ``[0, 128), [128, 256), ...``, the last one possibly short."""
    return [slice(s, min(s + TILE_ROWS, n)) for s in range(0, n, TILE_ROWS)]


def tile_of(x: torch.Tensor | None, sl: slice, fill=0) -> torch.Tensor | None:
    """``x[sl]`` as a fresh contiguous ``[TILE_ROWS, ...]`` tensor, the rows past ``sl`` set to
    ``fill`` (None stays None)."""
    if x is None:
        return None
    out = x.new_full((TILE_ROWS, *x.shape[1:]), fill)
    out[: sl.stop - sl.start] = x[sl]
    return out


def block_row_sum(a: torch.Tensor) -> torch.Tensor:
    """``a.sum(-1)`` of a ``[TILE_ROWS, V]`` tile in an order set by ``V`` alone: within each
    :data:`VOCAB_BLOCK` column block of a zero-padded copy, then over the blocks. Every reduction
    sees the fixed shapes ``[TILE_ROWS, nb, VOCAB_BLOCK]`` and ``[TILE_ROWS, nb]``; adding the
    padding's zeros changes no sum."""
    rows, width = a.shape
    nb = max(1, -(-width // VOCAB_BLOCK))
    padded = a.new_zeros((rows, nb * VOCAB_BLOCK))
    padded[:, :width] = a
    return padded.view(rows, nb, VOCAB_BLOCK).sum(dim=-1).sum(dim=-1)


def local_stats(x: torch.Tensor, local_target: torch.Tensor, owned: torch.Tensor,
                spec: stats.LossSpec, *, col_offset: int | None = None,
                out: torch.Tensor | None = None) -> stats.ChunkStats:
    """:func:`vparallel_ce.stats.local_stats` of ``[c, V_block]`` logits, tile by tile with
    :func:`block_row_sum`: row ``i``'s statistics are bitwise the same whatever ``c`` and ``i``.
    ``col_offset``, ``out``: as there."""
    if x.shape[0] == 0:
        return stats.local_stats(x, local_target, owned, spec, col_offset=col_offset, out=out)
    if col_offset is not None:
        local_target, owned = stats.block_targets(local_target, owned, col_offset, col_offset + x.shape[-1])
    if out is not None:
        return stats.stats_into(local_stats(x, local_target, owned, spec), out)
    parts = []
    for sl in tiles(x.shape[0]):
        st = stats.local_stats(tile_of(x, sl), tile_of(local_target, sl), tile_of(owned, sl, False), spec,
                               row_sum=block_row_sum)
        parts.append([None if f is None else f[: sl.stop - sl.start] for f in st])
    return stats.ChunkStats(*(None if f[0] is None else torch.cat(f) for f in zip(*parts)))


def grad_logits(x: torch.Tensor, local_target: torch.Tensor, owned: torch.Tensor, shift: torch.Tensor,
                coefs: stats.GradCoefs, spec: stats.LossSpec, out_dtype: torch.dtype | None = None, *,
                col_offset: int | None = None) -> torch.Tensor:
    """:func:`vparallel_ce.stats.grad_logits` tile by tile (elementwise per row, but on CPU an
    elementwise kernel's scalar tail depends on the tensor's size: a tile's is fixed)."""
    if col_offset is not None:
        local_target, owned = stats.block_targets(local_target, owned, col_offset, col_offset + x.shape[-1])
    out = torch.empty(x.shape, dtype=out_dtype or x.dtype, device=x.device)
    for sl in tiles(x.shape[0]):
        part = stats.GradCoefs(*(tile_of(k, sl) for k in coefs))
        d = stats.grad_logits(tile_of(x, sl), tile_of(local_target, sl), tile_of(owned, sl, False),
                              tile_of(shift, sl), part, spec, out_dtype)
        out[sl] = d[: sl.stop - sl.start]
    return out


def rows_by_tiles(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``fn(x)`` for a row-wise ``fn`` (a GEMM ``x W^T``), run on one fixed-shape tile at a time:
    ``fn`` only ever sees ``[TILE_ROWS, ...]`` inputs, so the kernel it picks is the same for
    every call."""
    out = None
    for sl in tiles(x.shape[0]):
        y = fn(tile_of(x, sl))
        if out is None:
            out = y.new_empty((x.shape[0], *y.shape[1:]))
        out[sl] = y[: sl.stop - sl.start]
    return fn(x) if out is None else out


def add_rows_by_tiles(out: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> None:
    """``out += fn(x)`` with ``fn`` run tile by tile as in :func:`rows_by_tiles`; each tile's product
    is added to ``out`` (fp32) once, so a row's sum over vocab blocks runs in the blocks' order."""
    for sl in tiles(x.shape[0]):
        out[sl] += fn(tile_of(x, sl))[: sl.stop - sl.start]


def blocks(local_size: int) -> list[slice]:
    """The vocab blocks this mode walks a ``local_size``-column shard in, whatever ``N``, the plan's
    schedule or its chunks: ``ceil(local_size / VOCAB_BLOCK_COLUMNS)`` blocks
    (:func:`vparallel_ce.layout.vocab_blocks`)."""
    return vocab_blocks(local_size, -(-local_size // VOCAB_BLOCK_COLUMNS))


def plan(policy: ChunkPolicy, num_tokens: int, vocab_size: int, tp_degree: int, *, hidden_size: int,
         reduction: str, chunks: int | str, logits_dtype: torch.dtype | None) -> Plan:
    """The plan of a batch-invariant linear op. The policy chooses, by ``N`` as usual, between
    token chunks (the logits of one chunk kept for the backward where it keeps them) and one chunk
    over vocab blocks; both walk the vocab in the same :func:`blocks`, merging a row's statistics
    and summing its ``dh`` over them in their order, so a row's arithmetic is the same in every
    plan: logits kept from forward are the ones the backward would recompute, bit for bit (the same
    GEMM of the same row), and no sum crosses rows. What the default plans have and this one has
    not: gradients made in forward for an upstream gradient of 1 and scaled after, and the
    whole-vocab one-pass kernel (both round a row's gradient differently), vocab blocks that follow
    ``N``, and the fused GEMM kernels: their statistics come from the GEMM's fp32 accumulator while
    kept logits are rounded, so a mode that keeps logits where the policy does (the fastest point,
    one chunk) cannot also fuse where it recomputes. ``schedule`` and ``recompute`` are not the
    caller's to choose here."""
    p = policy.plan(num_tokens, vocab_size, tp_degree, hidden_size=hidden_size, reduction=reduction, chunks=chunks,
                    logits_dtype=logits_dtype)
    if p.grad_mode is GradMode.IN_FORWARD:
        p = replace(p, grad_mode=GradMode.RECOMPUTE)
    k = len(blocks(local_vocab(vocab_size, tp_degree)))
    if p.schedule == "vocab":
        p = replace(p, chunks=k)
    how = "logits kept from forward" if p.keep_logits else "logits recomputed in backward"
    return replace(p, why=p.why + (f"batch_invariant=True: {k} vocab block(s) of at most {VOCAB_BLOCK_COLUMNS} "
                                   f"columns whatever N, gradients made in backward ({how})",))


def ops_for(x: torch.Tensor, current: kernels.KernelSettings, dtype: torch.dtype | None = None
            ) -> kernels.KernelBackend:
    """This mode's implementation for tensors like ``x`` (in ``dtype``, default ``x``'s) under the
    call's kernel settings: the fixed-config Triton kernels (:func:`vparallel_ce.kernels.invariant_ops`:
    bf16/fp16 on a GPU), else :data:`OPS`, the torch path one tile at a time (CPU, fp32/fp64, the
    ``torch`` choice, a fake tensor)."""
    if kernels.is_fake(x):
        return OPS
    return kernels.invariant_ops(x.device, dtype or x.dtype, current) or OPS


#: The per-chunk steps of this mode's torch path (:class:`vparallel_ce.kernels.KernelBackend`): the
#: torch reference, tile by tile; its GEMMs are :func:`rows_by_tiles` (no ``row_gemm``). Its plans
#: never make the loss and its gradient in one pass (``loss_stats_grad_``) nor scale gradients made
#: in forward (``scale_rows``).
OPS = kernels.KernelBackend("invariant:tiles", local_stats, grad_logits, stats.loss_stats_grad_, stats.scale_rows)
