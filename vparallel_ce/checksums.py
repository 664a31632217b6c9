"""Checksums the ranks compare in the call's exchange (:mod:`vparallel_ce.agreement`): position-sensitive
and exact (int64 sums that wrap, the same in any order), in torch. The Triton kernels of
:mod:`vparallel_ce.kernels.targets` reproduce them with the same mixing constants.
"""

from __future__ import annotations

import torch

__all__ = ["TARGET_MIX", "WORD_MIX", "target_checksum", "word_checksum"]


# odd multipliers (splitmix64's and murmur3's), as signed ints: the mixes of target_checksum and
# word_checksum, which the Triton kernels of vparallel_ce.kernels.targets reproduce with these
TARGET_MIX = (-7046029254386353131, -4658895280553007687, -7723592293110705685)


WORD_MIX = (-1640531535, -2048144789)
_K1, _K2, _K3 = TARGET_MIX
_W1, _W2 = WORD_MIX


def target_checksum(t: torch.Tensor) -> torch.Tensor:
    """``sum_i mix(i, t_i)`` over the ids of an int64 vector ``t`` (0-dim int64; all arithmetic
    wraps mod 2^64, so the sum is exact in any order): ``mix`` multiplies and xor-shifts id and
    position together, so that a permutation of the ids (a cycle of any length) or a shift by a
    position changes the sum except by a ~2^-64 chance -- a weighted sum such as ``sum (i+1) t_i``
    does not see a 3-cycle whose weighted sums match."""
    x = t * _K1 + torch.arange(1, t.numel() + 1, device=t.device) * _K2
    x = x ^ (x >> 32)
    x = x * _K3
    return (x ^ (x >> 29)).sum()


def word_checksum(words: torch.Tensor) -> torch.Tensor:
    """``sum_j mix(j, w_j)`` over the 32-bit words ``w`` of a contiguous int32 vector (0-dim int64;
    int32 arithmetic wraps mod 2^32 and the int64 sum is exact in any order): each word is mixed
    with its position, so replicated tensors give the same value on every rank while different
    values, or the same values in another order (rows permuted, a transpose), give another."""
    j = torch.arange(words.numel(), device=words.device).to(torch.int32)
    v = (words ^ (j * _W1)) * _W2
    return (v ^ (v >> 15)).sum(dtype=torch.int64)
