r"""The sampling set's rows, checked and mapped to this shard, one launch each.

:func:`bad_rows` -- the front door's check of the set's values
(:func:`vparallel_ce.set_check.check_support_values`): per valid token, an id outside ``[-1, V)``,
an id twice in its row (each id against the others where a row holds up to 64, else equal
neighbours of the row sorted first), a target not among its row's ids (unless the row is all
``-1``); the first such row of each kind (integer atomics), read by the host at once.

:func:`set_rows` -- the rows of :class:`vparallel_ce.set_chunk.SetRows` for all of a call's token
chunks. Per token ``n`` with ids ``ids[n, :]`` (``-1`` padding) and target ``t``: ``valid = t !=
ignore_index``; the ids this shard owns (``0 <= id - offset < local_size``, valid rows) moved to
the front of the row in their order, as local columns -- ``cols[n, j]`` the ``j``-th owned id's
column for ``j < count[n]``, 0 after, ``kept[n, j] = j < count[n]``; ``tpos``/``t_owned`` the
target's first position among them and whether there is one; ``full`` a valid row of padding only
(the whole vocabulary); ``in_set`` a valid row whose target is among its ids (any shard's) or that
is full. Per chunk of ``heights`` rows: the most owned ids of a row and its full rows' count
(integer atomics: the same on every run), what the host reads once.

The torch steps of :meth:`vparallel_ce.set_chunk.SetRows.of_chunks` and
:func:`vparallel_ce.set_check.check_support_values` are the reference (about forty and twenty
small launches for what these do in one each).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["set_rows", "bad_rows"]

# the most ids of a row that the values check compares pairwise (no sort of the rows first)
_PAIRWISE_K = 64


@triton.jit(do_not_specialize=["N", "K", "V", "ignore_index"])
def _bad_rows_kernel(IDS, ORDERED, TARGET, FIRST, N, K, V, ignore_index, s_ids, s_ord, BN: tl.constexpr,
                     BK: tl.constexpr, PAIRWISE: tl.constexpr):
    n = tl.program_id(0).to(tl.int64) * BN + tl.arange(0, BN)
    nin = n < N
    t = tl.load(TARGET + n, mask=nin, other=ignore_index).to(tl.int64)
    valid = nin & (t != ignore_index)
    out = tl.zeros((BN,), dtype=tl.int32)
    twice = tl.zeros((BN,), dtype=tl.int32)
    real = tl.zeros((BN,), dtype=tl.int32)
    hit = tl.zeros((BN,), dtype=tl.int32)
    kk = tl.arange(0, BK)
    for k0 in range(0, K, BK):
        ks = k0 + kk
        m = valid[:, None] & (ks < K)[None, :]
        ids = tl.load(IDS + n[:, None] * s_ids + ks[None, :], mask=m, other=-1)
        out = tl.maximum(out, tl.max(((ids < -1) | (ids >= V)).to(tl.int32), axis=1))
        if PAIRWISE:  # the whole row in one block: each id against the ids after it
            later = (kk[:, None] < kk[None, :])[None, :, :]
            same = (ids[:, :, None] == ids[:, None, :]) & later & (ids >= 0)[:, :, None]
            twice = tl.maximum(twice, tl.max(tl.max(same.to(tl.int32), axis=2), axis=1))
        else:  # the row sorted: equal neighbours
            o = tl.load(ORDERED + n[:, None] * s_ord + ks[None, :], mask=m, other=-1)
            prev = tl.load(ORDERED + n[:, None] * s_ord + (ks - 1)[None, :], mask=m & (ks >= 1)[None, :], other=-1)
            twice = tl.maximum(twice, tl.max(((o == prev) & (o >= 0)).to(tl.int32), axis=1))
        real = tl.maximum(real, tl.max((ids >= 0).to(tl.int32), axis=1))
        hit = tl.maximum(hit, tl.max((m & (ids == t[:, None])).to(tl.int32), axis=1))
    missing = valid & (real > 0) & (hit == 0)
    at = FIRST + tl.zeros((BN,), dtype=tl.int64)  # (a block of pointers: one slot for all the rows)
    tl.atomic_min(at, tl.where(valid & (out > 0), n, N), mask=nin)
    tl.atomic_min(at + 1, tl.where(valid & (twice > 0), n, N), mask=nin)
    tl.atomic_min(at + 2, tl.where(missing, n, N), mask=nin)


def bad_rows(ids: torch.Tensor, target: torch.Tensor, ignore_index: int, vocab_size: int) -> list[int | None]:
    """The first valid row of ``ids [n, K]`` int64 (``target [n]``) with an id outside ``[-1, V)``,
    with an id twice, with its target missing (not all ``-1``): three row indices or None, read on
    the host at once."""
    n, k = ids.shape
    ids = ids if ids.stride(-1) == 1 else ids.contiguous()
    pairwise = k <= _PAIRWISE_K  # (no sort: a row of up to 64 ids is compared with itself, 64 x 64)
    ordered = ids if pairwise else ids.sort(dim=-1).values
    first = torch.full((3,), n, dtype=torch.int64, device=ids.device)
    if n and k:
        bk = max(16, min(128, triton.next_power_of_2(k)))
        bn = max(1, (4096 // (bk * bk)) if pairwise else 2048 // bk)
        _bad_rows_kernel[(triton.cdiv(n, bn),)](ids, ordered, target, first, n, k, vocab_size, ignore_index,
                                                ids.stride(0), ordered.stride(0), BN=bn, BK=bk, PAIRWISE=pairwise)
    return [None if r == n else r for r in first.tolist()]


@triton.jit(do_not_specialize=["N", "K", "offset", "local_size", "ignore_index"])
def _set_rows_kernel(IDS, TARGET, TABLE, COLS, KEPT, TPOS, FLAGS, N, K, n_chunks, offset, local_size, ignore_index,
                     s_ids, BN: tl.constexpr, BK: tl.constexpr, BC: tl.constexpr):
    n = tl.program_id(0).to(tl.int64) * BN + tl.arange(0, BN)
    nin = n < N
    t = tl.load(TARGET + n, mask=nin, other=ignore_index).to(tl.int64)
    valid = nin & (t != ignore_index)
    count = tl.zeros((BN,), dtype=tl.int32)
    tpos = tl.full((BN,), 2**30, dtype=tl.int32)  # the owned target's first position (2**30: none)
    real = tl.zeros((BN,), dtype=tl.int32)
    hit = tl.zeros((BN,), dtype=tl.int32)
    kk = tl.arange(0, BK)
    for k0 in range(0, K, BK):
        m = nin[:, None] & (k0 + kk < K)[None, :]
        ids = tl.load(IDS + n[:, None] * s_ids + (k0 + kk)[None, :], mask=m, other=-1)
        local = ids - offset
        is_id = ids >= 0
        own = is_id & (local >= 0) & (local < local_size) & valid[:, None]
        pos = count[:, None] + tl.cumsum(own.to(tl.int32), axis=1) - 1  # its place among the owned ids
        tl.store(COLS + n[:, None] * K + pos, local, mask=own)
        is_t = is_id & (ids == t[:, None])
        tpos = tl.minimum(tpos, tl.min(tl.where(is_t & own, pos, 2**30), axis=1))
        hit = tl.maximum(hit, tl.max(is_t.to(tl.int32), axis=1))
        real = tl.maximum(real, tl.max(is_id.to(tl.int32), axis=1))
        count += tl.sum(own.to(tl.int32), axis=1)
    for k0 in range(0, K, BK):  # the rest of each row: column 0, not kept
        m = nin[:, None] & (k0 + kk < K)[None, :]
        after = (k0 + kk)[None, :] >= count[:, None]
        tl.store(COLS + n[:, None] * K + (k0 + kk)[None, :], tl.zeros((BN, BK), dtype=tl.int64), mask=m & after)
        tl.store(KEPT + n[:, None] * K + (k0 + kk)[None, :], (~after).to(tl.int8), mask=m)
    full = valid & (real == 0)
    t_owned = tpos < 2**30
    tl.store(TPOS + n, tl.where(t_owned, tpos, 0).to(tl.int64), mask=nin)
    tl.store(FLAGS + n, t_owned.to(tl.int8), mask=nin)
    tl.store(FLAGS + N + n, valid.to(tl.int8), mask=nin)
    tl.store(FLAGS + 2 * N + n, (valid & (full | (hit > 0))).to(tl.int8), mask=nin)
    tl.store(FLAGS + 3 * N + n, full.to(tl.int8), mask=nin)
    # each row's chunk: the chunk starts at or below it (TABLE[:n_chunks], then a huge pad), less one
    cs = tl.arange(0, BC)
    starts = tl.load(TABLE + cs, mask=cs < n_chunks, other=2**62)
    chunk = tl.sum((starts[None, :] <= n[:, None]).to(tl.int64), axis=1) - 1
    tl.atomic_max(TABLE + n_chunks + 2 * chunk, count.to(tl.int64), mask=nin)
    tl.atomic_add(TABLE + n_chunks + 2 * chunk + 1, full.to(tl.int64), mask=nin)


def set_rows(ids: torch.Tensor, target: torch.Tensor, heights: list[int], offset: int, local_size: int,
             ignore_index: int):
    """``(cols [n, K] int64, kept [n, K] bool, tpos [n] int64, (t_owned, valid, in_set, full) [n]
    bool, sizes)`` of ``ids [n, K]`` int64 and ``target [n]``, for consecutive chunks of ``heights``
    rows: ``sizes`` per chunk ``[most owned ids of a row, full rows]``, read on the host (the one wait)."""
    n, k = ids.shape
    dev = ids.device
    ids = ids if ids.stride(-1) == 1 else ids.contiguous()
    cols = torch.empty((n, k), dtype=torch.int64, device=dev)
    kept = torch.empty((n, k), dtype=torch.bool, device=dev)
    tpos = torch.empty(n, dtype=torch.int64, device=dev)
    flags = torch.empty((4, n), dtype=torch.bool, device=dev)
    starts = [0]
    for h in heights[:-1]:
        starts.append(starts[-1] + h)
    # the chunks' first rows, then their [width, full rows] (atomics start from 0): one chunk, a fill
    # (no copy from the host); else one host copy
    table = torch.zeros(3, dtype=torch.int64, device=dev) if len(heights) == 1 else \
        torch.tensor(starts + [0] * (2 * len(heights)), dtype=torch.int64, device=dev)
    if n:
        bk = max(16, min(128, triton.next_power_of_2(max(k, 1))))
        bn = max(1, 2048 // bk)
        _set_rows_kernel[(triton.cdiv(n, bn),)](
            ids, target, table, cols, kept.view(torch.int8), tpos, flags.view(torch.int8), n, k, len(heights),
            offset, local_size, ignore_index, ids.stride(0), BN=bn, BK=bk,
            BC=max(2, triton.next_power_of_2(len(heights))))
    sizes = table[len(heights):].view(len(heights), 2).tolist()
    return cols, kept, tpos, tuple(flags.unbind(0)), sizes
