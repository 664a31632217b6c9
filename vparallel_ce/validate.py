"""Argument checks, phrased so the user can fix the call.

The checks here are local: each returns a :class:`Problem` (or None) instead of raising, so the op can
share "some rank's input is bad" with the group in the one metadata exchange it makes anyway
(:func:`vparallel_ce.layout.vocab_layout`) and raise on EVERY rank -- a rank that raised alone would
leave the others waiting in the next collective. Out-of-range targets are detected later, from the
all-reduced ownership count (see :mod:`vparallel_ce.stats`), which every rank sees identically.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .stats import REDUCTIONS

__all__ = ["Problem", "InvalidInputError", "check_options", "check_logits", "check_linear", "raise_if", "check_owned"]


class InvalidInputError(ValueError):
    """Raised on every rank of the group when any rank's input is invalid."""


@dataclass(frozen=True)
class Problem:
    exc: type
    message: str

    def raise_(self):
        raise self.exc(self.message)


def raise_if(problem: Problem | None) -> None:
    if problem is not None:
        problem.raise_()


def check_options(*, reduction, label_smoothing, z_loss, softcap, chunks) -> Problem | None:
    if reduction not in REDUCTIONS:
        return Problem(ValueError, f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if not 0.0 <= float(label_smoothing) <= 1.0:
        return Problem(ValueError, f"label_smoothing must be in [0, 1], got {label_smoothing}")
    if float(z_loss) < 0:
        return Problem(ValueError, f"z_loss must be >= 0, got {z_loss}")
    if softcap is not None and not float(softcap) > 0:
        return Problem(ValueError, f"softcap must be a positive number or None, got {softcap}")
    if chunks != "auto" and (isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1):
        return Problem(ValueError, f"chunks must be an int >= 1 or 'auto', got {chunks!r}")
    return None


def _check_target(target: torch.Tensor, token_shape, what: str) -> Problem | None:
    if not isinstance(target, torch.Tensor):
        return Problem(TypeError, f"target must be a tensor, got {type(target).__name__}")
    if target.is_floating_point() or target.is_complex() or target.dtype == torch.bool:
        return Problem(TypeError, f"target must hold integer class ids, got dtype {target.dtype}")
    if tuple(target.shape) != tuple(token_shape):
        return Problem(
            ValueError,
            f"target shape {tuple(target.shape)} does not match {what} {tuple(token_shape)}",
        )
    return None


def check_logits(logits: torch.Tensor, target: torch.Tensor) -> Problem | None:
    if not isinstance(logits, torch.Tensor):
        return Problem(TypeError, f"logits must be a tensor, got {type(logits).__name__}")
    if not logits.is_floating_point():
        return Problem(TypeError, f"logits must be a floating-point tensor, got dtype {logits.dtype}")
    if logits.dim() < 1:
        return Problem(ValueError, "logits must have at least one dim (the vocab shard)")
    problem = _check_target(target, logits.shape[:-1], "the logits' token dims (logits.shape[:-1])")
    if problem is None and target.device != logits.device:
        problem = Problem(ValueError, f"target is on {target.device} but logits are on {logits.device}")
    return problem


def check_linear(hidden, weight, target, bias) -> Problem | None:
    for name, t in (("hidden", hidden), ("weight", weight)):
        if not isinstance(t, torch.Tensor):
            return Problem(TypeError, f"{name} must be a tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            return Problem(TypeError, f"{name} must be a floating-point tensor, got dtype {t.dtype}")
    if weight.dim() != 2:
        return Problem(ValueError, f"weight must be [V_local, H], got shape {tuple(weight.shape)}")
    if hidden.dim() < 1 or hidden.shape[-1] != weight.shape[1]:
        return Problem(
            ValueError,
            f"hidden's last dim ({hidden.shape[-1] if hidden.dim() else None}) does not match "
            f"weight's hidden size ({weight.shape[1]}); weight must be [V_local, H]",
        )
    if hidden.dtype != weight.dtype:
        return Problem(TypeError, f"hidden dtype {hidden.dtype} differs from weight dtype {weight.dtype}")
    if hidden.device != weight.device:
        return Problem(ValueError, f"hidden is on {hidden.device} but weight is on {weight.device}")
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (weight.shape[0],):
            shape = tuple(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__
            return Problem(ValueError, f"bias must be [V_local]=[{weight.shape[0]}], got {shape}")
        if bias.dtype != weight.dtype or bias.device != weight.device:
            return Problem(TypeError, f"bias must match weight's dtype/device ({weight.dtype}, {weight.device})")
    problem = _check_target(target, hidden.shape[:-1], "hidden's token dims (hidden.shape[:-1])")
    if problem is None and target.device != hidden.device:
        problem = Problem(ValueError, f"target is on {target.device} but hidden is on {hidden.device}")
    return problem


def check_owned(owned_total: torch.Tensor, valid: torch.Tensor, target: torch.Tensor, vocab_size: int) -> None:
    """Every valid token's id must be owned by exactly one rank. ``owned_total`` is the all-reduced
    ownership count, identical on every rank, so every rank raises together (one host sync)."""
    bad = valid & (owned_total.round() != 1)
    if bool(bad.any()):
        ids = target[bad]
        raise InvalidInputError(
            f"target holds {int(bad.sum())} id(s) outside [0, {vocab_size}) that are not ignore_index "
            f"(e.g. {int(ids[0])}); pass check=False to skip this check"
        )
