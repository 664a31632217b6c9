"""The keyword options of one call, as one frozen value.

Each public op takes its options as keyword arguments (the names ``F.cross_entropy`` and the
frameworks use) and packs them into one :class:`Options` right away; from there on the front door
(:mod:`vparallel_ce.call`), the checks and the cross-rank facts (:mod:`vparallel_ce.validate`) read
its fields. The defaults are written here once: an op that does not take an option (the log-prob
ops have no ``label_smoothing``, the logits ops no ``schedule``) leaves the field at its default,
which is the same on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from .policy import ChunkPolicy

__all__ = ["Options", "OPTION_NAMES"]


@dataclass(frozen=True)
class Options:
    """A call's options as the user gave them (checked by
    :func:`vparallel_ce.validate.check_call_options`, not here: a bad value is reported on every
    rank through the call's exchange, not raised by one rank while building this).

    Attributes:
        reduction, ignore_index, label_smoothing: as in ``F.cross_entropy``.
        num_valid_tokens: the divisor of ``reduction="mean"`` (an int or an integer tensor, e.g. the
            valid tokens of a whole gradient-accumulation step over its data-parallel ranks, as
            Hugging Face's ``num_items_in_batch``); None: this call's own valid tokens.
        z_loss, softcap: the loss' extra terms (:func:`vparallel_ce.cross_entropy`).
        temperature, with_entropy: the log-prob ops' distribution and whether the entropy is made
            (``temperature`` is also the distillation's softening of both softmaxes).
        divergence, beta, hard_weight: the distillation's divergence (a
            :class:`vparallel_ce.divergence.Divergence` value), the JSD mixture weight and the weight
            of the student's plain cross-entropy (:func:`vparallel_ce.distillation_loss`).
        chunks, schedule, recompute, policy: how the work is planned
            (:meth:`vparallel_ce.policy.ChunkPolicy.plan`).
        vocab_size: the global vocab size, if the caller states it.
        sequence_parallel: hidden and target are this rank's token shard (linear ops).
        logits_dtype: the linear ops' logits: None, in the lm_head matmul dtype (bf16 inputs give
            bf16-rounded logits); ``torch.float32``, the GEMM's fp32 result, never rounded below
            fp32 (:func:`vparallel_ce.linear_token_logprobs`).
        check, check_replicated: the call's exchange and checks, and the replicated-hidden check.
        batch_invariant: every per-token output (and each token's gradient row) bitwise the same
            whatever the other tokens of the call (:mod:`vparallel_ce.invariant`).
        top_k, top_p, min_p: the log-prob ops' sampling masks, the kept set rebuilt from the logits
            at ``temperature`` (:mod:`vparallel_ce.sampling_masks`); None: no such mask.
        mtp_heads, mtp_scale, mtp_counts: a multi-token-prediction loss (:func:`vparallel_ce.linear_mtp_loss`):
            its number of heads (0: not an MTP call), the weight of the mean over its depths, and the
            divisor of each head's mean as given (``[heads]`` integers, or None: each head's own count).
    """

    reduction: str = "mean"
    ignore_index: int = -100
    label_smoothing: float = 0.0
    num_valid_tokens: int | torch.Tensor | None = None
    z_loss: float = 0.0
    softcap: float | None = None
    temperature: float = 1.0
    with_entropy: bool = False
    divergence: str = "forward_kl"
    beta: float = 0.5
    hard_weight: float = 0.0
    chunks: int | str = "auto"
    schedule: str = "auto"
    recompute: bool | None = None
    policy: ChunkPolicy | None = None
    vocab_size: int | None = None
    sequence_parallel: bool = False
    logits_dtype: torch.dtype | None = None
    check: bool = True
    check_replicated: bool = True
    batch_invariant: bool = False
    mtp_heads: int = 0
    mtp_scale: float = 0.0
    mtp_counts: torch.Tensor | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None

    @property
    def masks(self) -> bool:
        """A sampling mask is asked for (``top_k``, ``top_p`` or ``min_p``)."""
        return self.top_k is not None or self.top_p is not None or self.min_p is not None

    def as_kwargs(self) -> dict:
        """The fields by name (what :func:`vparallel_ce.validate.check_options` takes)."""
        return {name: getattr(self, name) for name in OPTION_NAMES}


OPTION_NAMES = tuple(f.name for f in fields(Options))
