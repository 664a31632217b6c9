"""What the ranks compare of the tensors themselves, as checksums in the agreement's exchange
(:mod:`vparallel_ce.agreement`): ``hidden`` replicated over the TP group (the same bytes on every
rank), and the vocab shards of the logits or lm_head weight NOT replicated (the full, unsharded
tensor passed on every rank; a sample of each shard suffices to see that)."""

from __future__ import annotations

import contextlib
import contextvars

import torch

from . import kernels
from .checksums import word_checksum

__all__ = ["hidden_checksum", "shard_checksum", "shard_sample", "replication_unchecked", "replication_checked"]


_REPLICATION_CHECKED = contextvars.ContextVar("vparallel_ce_replication_checked", default=True)


@contextlib.contextmanager
def replication_unchecked():
    """Inside the block the linear ops do not check that ``hidden`` is replicated (as with
    ``check_replicated=False``): what :class:`vparallel_ce.pipeline.PipelineLoss` wraps its loss in,
    since a pipeline schedule's first step calls the loss on uninitialised stage outputs (shape
    inference), which differ over the TP ranks and whose result is discarded."""
    token = _REPLICATION_CHECKED.set(False)
    try:
        yield
    finally:
        _REPLICATION_CHECKED.reset(token)


def replication_checked() -> bool:
    """False inside :func:`replication_unchecked`."""
    return _REPLICATION_CHECKED.get()


def hidden_checksum(x: torch.Tensor) -> torch.Tensor:
    """:func:`word_checksum` of ``x``'s bytes (0-dim int64 on its device): what the ranks compare to
    know that ``hidden`` is replicated (exact, nan included, unlike a float sum, which need not
    come out the same on every rank). Read as 32-bit words where the bytes split into them (on a
    GPU in one Triton read), else element by element widened to words -- a choice made from the
    shape and dtype alone, so ranks holding the same values always make the same one."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.int64, device=x.device)
    if (x.numel() * x.element_size()) % 4 == 0:
        words = x.contiguous().view(-1).view(torch.int32)
        found = kernels.word_checksum(words)
        return found if found is not None else word_checksum(words)
    as_int = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]
    return word_checksum(x.contiguous().view(-1).view(as_int).to(torch.int32))


SAMPLE_PER_DIM = 16  # at most this many entries along each dim of a shard go into its sample


def shard_sample(x: torch.Tensor) -> torch.Tensor:
    """A strided view of at most :data:`SAMPLE_PER_DIM` entries along each dim of ``x`` (no copy,
    no kernel): chosen from the shape alone, so ranks holding the same tensor take the same entries.
    Two vocab shards of a model differ in every column; the sample of identical shards is
    identical."""
    return x[tuple(slice(None, None, max(1, -(-n // SAMPLE_PER_DIM))) for n in x.shape)]


def shard_checksum(x: torch.Tensor) -> torch.Tensor:
    """:func:`hidden_checksum` of :func:`shard_sample` (0-dim int64 on ``x``'s device): a read of a
    few hundred entries whatever the shard's size, where a checksum of the whole ``[N, V_local]``
    logits would read them all."""
    return hidden_checksum(shard_sample(x))
