"""The front door's target range check, target checksum and replication checksum, one launch each
(:func:`vparallel_ce.agreement.agree`).

``[lo, hi, checksum, valid]`` with ``lo = min(0, smallest valid id)`` and ``hi = max(0, largest valid id)`` (ignored
ids count as 0): every valid id lies in ``[0, V)`` exactly when ``lo >= 0`` and ``hi < V``, and an
out-of-range id, if any, is ``lo`` (when negative) or ``hi``, and ``valid`` counts the valid ids. ``checksum`` is what the ranks of a group
compare: a sum over positions of a mix of (position, id) (:func:`vparallel_ce.checksums.target_checksum`,
whose torch version this kernel reproduces bit for bit), exact in any order since integer sums
wrap, and changed by any permutation or shift of the ids. Given the vocab size, the same launch
writes whether an id is out of range and the valid ids' count, the ``"mean"``'s divisor (NaN on a
bad id, so a mean divided by it needs no masking pass). The torch version of the check is
several small kernels; at world 1 they run before the op's first GEMM on every call, where a host
that spends ~40 us per launched op leaves the GPU idle for each of them. One program walks the
whole target vector (8 KiB per 1024 tokens), so the GPU time is a few microseconds at training sizes.

:func:`word_checksum` is the same idea over the 32-bit words of the hidden states
(:func:`vparallel_ce.checksums.word_checksum`), in one read at memory speed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["target_facts", "word_checksum"]

from ..checksums import TARGET_MIX, WORD_MIX

# the mixing constants of vparallel_ce.checksums.target_checksum / word_checksum, as constexpr (a
# kernel may read no other global)
_K1, _K2, _K3 = (tl.constexpr(k) for k in TARGET_MIX)
_W1, _W2 = (tl.constexpr(k) for k in WORD_MIX)

BLOCK = 2048


@triton.jit
def _facts_kernel(T, N, ignore_index, vocab_size, OUT, BAD, COUNT, BLOCK: tl.constexpr, FLAG: tl.constexpr):
    lo = tl.zeros([BLOCK], dtype=tl.int64)  # 0 is in range: it stands for ignored ids and the tail
    hi = tl.zeros([BLOCK], dtype=tl.int64)
    acc = tl.zeros([BLOCK], dtype=tl.int64)
    valid = tl.zeros([BLOCK], dtype=tl.int64)
    for start in range(0, N, BLOCK):
        idx = start + tl.arange(0, BLOCK)
        live = idx < N
        t = tl.load(T + idx, mask=live, other=0).to(tl.int64)
        mix = t * _K1 + (idx.to(tl.int64) + 1) * _K2  # wraps mod 2^64, as torch's int64 ops do
        mix = mix ^ (mix >> 32)
        mix = mix * _K3
        acc += tl.where(live, mix ^ (mix >> 29), 0)
        valid += (live & (t != ignore_index)).to(tl.int64)
        t = tl.where(t == ignore_index, 0, t)
        lo = tl.minimum(lo, t)
        hi = tl.maximum(hi, t)
    # one vector store of all four (Triton 3.6's interpreter would not store a reduced scalar alone);
    # with FLAG the fourth slot is not written (at world 1 OUT is the pinned span, whose last slot
    # holds a tensor num_valid_tokens)
    slot = tl.arange(0, 4)
    least, most = tl.min(lo, axis=0), tl.max(hi, axis=0)
    vals = tl.where(slot == 0, least, tl.where(slot == 1, most,
                                               tl.where(slot == 2, tl.sum(acc, axis=0), tl.sum(valid, axis=0))))
    tl.store(OUT + slot, vals, mask=slot < (3 if FLAG else 4))
    if FLAG:
        bad = (least < 0) | (most >= vocab_size)
        tl.store(BAD + slot, tl.where(slot == 0, bad, False), mask=slot < 1)
        # the valid count as the mean's fp32 divisor, NaN where an id is out of range
        count = tl.where(bad, float("nan"), tl.sum(valid, axis=0).to(tl.float32))
        tl.store(COUNT + slot, tl.where(slot == 0, count, 0.0), mask=slot < 1)


def target_facts(target: torch.Tensor, ignore_index: int, vocab_size: int | None = None, *,
                 out: torch.Tensor | None = None):
    """``[lo, hi, checksum, valid]`` (int64, on ``target``'s device) of ``target``, in one launch
    (``valid``: the count of ids that are not ``ignore_index``, which ignored-token compaction reads
    from a group's exchange); with ``vocab_size``, ``(facts, bad, count)`` (``facts`` the first three): ``bad`` a 0-dim bool on the device, whether a valid id
    lies outside ``[0, vocab_size)`` (what a device-side guard masks with, no further launch), and
    ``count`` the number of valid ids as a 0-dim fp32, NaN where ``bad`` (a mean divided by it
    comes out NaN on a bad id with no masking pass). ``out``: an int64 ``[3]`` (``[4]`` without
    ``vocab_size``) the facts are written
    into instead -- pinned host memory, which the kernel writes across the bus with no copy
    launched after it."""
    t = target.reshape(-1)
    if not t.is_contiguous():
        t = t.contiguous()
    flag = vocab_size is not None
    out = torch.empty(3 if flag else 4, dtype=torch.int64, device=t.device) if out is None else out
    bad = torch.empty(1, dtype=torch.bool, device=t.device) if flag else out
    count = torch.empty(1, dtype=torch.float32, device=t.device) if flag else out
    _facts_kernel[(1,)](t, t.numel(), ignore_index, vocab_size if flag else 0, out, bad, count, BLOCK=BLOCK,
                        FLAG=flag, num_warps=8)
    return (out, bad[0], count[0]) if flag else out


# 2048 int32 words per tile, 4 tiles (32 KiB) per program, 4 warps: the fastest of a sweep on an
# H200 at 2048 and 8192 tokens x 4096 bf16 (45 us at 8192 tokens, against 61 us with 256 KiB programs)
_WORDS = 2048
_TILES = 4
_WARPS = 4


@triton.jit
def _word_checksum_kernel(X, N, OUT, BLOCK: tl.constexpr, TILES: tl.constexpr):
    # a program's partial sum of its mixed words, as int64 (integer sums are exact in any order)
    acc = tl.zeros([BLOCK], dtype=tl.int64)
    base = tl.program_id(0).to(tl.int64) * BLOCK * TILES
    for i in range(TILES):
        idx = base + i * BLOCK + tl.arange(0, BLOCK)
        live = idx < N
        w = tl.load(X + idx, mask=live, other=0)
        v = (w ^ (idx.to(tl.int32) * _W1)) * _W2  # int32 ops wrap mod 2^32, as torch's do
        v = v ^ (v >> 15)
        acc += tl.where(live, v, 0).to(tl.int64)
    slot = tl.arange(0, 2)  # a vector store (see _facts_kernel)
    tl.store(OUT + tl.program_id(0) + slot, tl.where(slot == 0, tl.sum(acc, axis=0), 0), mask=slot < 1)


def word_checksum(words: torch.Tensor) -> torch.Tensor:
    """:func:`vparallel_ce.checksums.word_checksum` of a contiguous 1-D int32 tensor (0-dim int64, on
    its device), in one read at memory speed (torch's version is several passes)."""
    n = words.numel()
    programs = triton.cdiv(n, _WORDS * _TILES)
    out = torch.empty(programs, dtype=torch.int64, device=words.device)
    _word_checksum_kernel[(programs,)](words, n, out, BLOCK=_WORDS, TILES=_TILES, num_warps=_WARPS)
    return out.sum()
