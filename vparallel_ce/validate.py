"""Argument checks, phrased so the user can fix the call, and the cross-rank agreement.

The local checks return a :class:`Problem` (or None) instead of raising, so that "some rank's input
is bad" travels through the one metadata exchange every call makes anyway (:func:`agree`) and the
error is raised on EVERY rank -- a rank that raised alone would leave the others waiting in the
next collective. Out-of-range targets travel through the same exchange (each rank's lowest and
highest valid id), so the target check costs no collective and no host sync beyond that one, and
on a group it happens before any kernel of the op is launched. At world 1 there is no exchange to
ride on: the span is read back without blocking (:class:`DeferredTargetCheck`) and the op raises
once its forward's kernels are queued, before it returns anything.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import comm, kernels
from .layout import VocabLayout, shard_sizes
from .policy import ChunkPolicy
from .stats import REDUCTIONS

__all__ = [
    "Problem", "InvalidInputError", "DeferredTargetCheck", "check_options", "check_logits", "check_linear", "agree",
    "SCHEDULES",
]

SCHEDULES = ("auto", "token", "vocab")


class InvalidInputError(ValueError):
    """Raised on every rank of the group when any rank's input is invalid."""


@dataclass(frozen=True)
class Problem:
    exc: type
    message: str

    def raise_(self):
        raise self.exc(self.message)


class DeferredTargetCheck:
    """The target range check of a world-1 call, without a host sync at the front door.

    A host read of the ``[min, max]`` valid id (:func:`_target_span`) right away would wait for
    every kernel queued before the loss -- in a training step, the model's whole forward -- and
    leave the GPU idle while the host then launches the loss. Instead the span is copied behind
    those kernels (non-blocking, into pinned memory on CUDA) and :meth:`settle` waits for that copy
    alone, once the op's forward has queued its own kernels. Until then the kernels see ids
    clamped into the shard (:func:`vparallel_ce.stats.local_targets`), so a bad id reads nothing out
    of bounds, and the error still comes before the op returns a value.

    The pinned pair and its event are reused from call to call (one per device, taken out of the
    pool while a check is pending and put back once it is settled): allocating them is host time
    spent before the op's first GEMM on every call. A check abandoned unsettled (its forward
    raised) keeps its pair, so a copy still in flight never lands in a later call's buffer.
    """

    _pool: dict = {}  # (device, dtype) -> (pinned [2], event), free pairs only

    def __init__(self, target: torch.Tensor, ignore_index: int, vocab_size: int):
        span = _target_span(target, ignore_index)
        self.vocab_size = vocab_size
        self.event = self.key = None
        if span.is_cuda:
            self.key = (span.device, span.dtype)
            # dict.pop is atomic, so two threads never take the same pair
            self.span, self.event = self._pool.pop(self.key, None) or (
                torch.empty(2, dtype=span.dtype, pin_memory=True), torch.cuda.Event())
            self.span.copy_(span, non_blocking=True)
            self.event.record()
        else:
            self.span = span
        self.settled = False

    def settle(self) -> None:
        """Raise :class:`InvalidInputError` if a valid id lies outside ``[0, V)`` (once)."""
        if self.settled:
            return
        self.settled = True
        if self.event is not None:
            self.event.synchronize()
        lo, hi = self.span.tolist()
        if self.event is not None:  # the copy has landed and been read: the pair is free again
            self._pool[self.key] = (self.span, self.event)
        _check_targets([[lo, hi]], self.vocab_size)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# name -> (predicate, what it must be); a table made once, not per call (this runs on every call)
_OPTION_CHECKS = {
    "reduction": (lambda v: v in REDUCTIONS, f"one of {REDUCTIONS}"),
    "ignore_index": (_is_int, "an int"),
    "label_smoothing": (lambda v: 0.0 <= float(v) <= 1.0, "in [0, 1]"),
    "z_loss": (lambda v: float(v) >= 0, ">= 0"),
    "softcap": (lambda v: v is None or float(v) > 0, "a positive number or None"),
    "temperature": (lambda v: not isinstance(v, bool) and float(v) > 0, "a positive number"),
    "chunks": (lambda v: v == "auto" or (_is_int(v) and v >= 1), "an int >= 1 or 'auto'"),
    "schedule": (lambda v: v in SCHEDULES, f"one of {SCHEDULES}"),
    "recompute": (lambda v: v is None or isinstance(v, bool), "True, False or None"),
    "policy": (lambda v: v is None or isinstance(v, ChunkPolicy), "a vparallel_ce.ChunkPolicy or None"),
}


_GOOD_OPTIONS: set = set()  # (name, type, value) seen valid: a call repeats its options every step
# only values that cannot change after the check (a tensor option hashes by identity and could be
# written in place between calls)
_CACHED_TYPES = (int, float, str, bool, type(None), ChunkPolicy)


def check_options(**options) -> Problem | None:
    """Check the keyword options a call was given (only those named)."""
    for name, value in options.items():
        # the type is part of the key: True == 1 == 1.0, but chunks=True is not chunks=1
        key = (name, type(value), value) if type(value) in _CACHED_TYPES else None
        try:
            if key in _GOOD_OPTIONS:
                continue
        except TypeError:  # a ChunkPolicy holding an unhashable field: checked, never cached
            key = None
        ok, wanted = _OPTION_CHECKS[name]
        try:
            good = ok(value)
        except (TypeError, ValueError):
            good = False
        if not good:
            return Problem(ValueError, f"{name} must be {wanted}, got {value!r}")
        if name == "policy" and value is not None and (field_problem := value.problem()) is not None:
            return Problem(ValueError, f"policy: {field_problem}")
        if key is not None and len(_GOOD_OPTIONS) < 4096:
            _GOOD_OPTIONS.add(key)
    if options.get("recompute") is False and options.get("reduction") == "none":
        return Problem(ValueError, "recompute=False (gradients made in forward) needs reduction 'mean' or 'sum': "
                                   "with reduction='none' the upstream gradient is only known in backward")
    return None


def _check_target(target, token_shape, what: str, device) -> Problem | None:
    if not isinstance(target, torch.Tensor):
        return Problem(TypeError, f"target must be a tensor, got {type(target).__name__}")
    if target.is_floating_point() or target.is_complex() or target.dtype == torch.bool:
        return Problem(TypeError, f"target must hold integer class ids, got dtype {target.dtype}")
    if tuple(target.shape) != tuple(token_shape):
        return Problem(ValueError, f"target shape {tuple(target.shape)} does not match {what} {tuple(token_shape)}")
    if target.device != device:
        return Problem(ValueError, f"target is on {target.device} but the inputs are on {device}")
    return None


def _check_float(name: str, t) -> Problem | None:
    if not isinstance(t, torch.Tensor):
        return Problem(TypeError, f"{name} must be a tensor, got {type(t).__name__}")
    if not t.is_floating_point():
        return Problem(TypeError, f"{name} must be a floating-point tensor, got dtype {t.dtype}")
    return None


def check_logits(logits, target) -> Problem | None:
    problem = _check_float("logits", logits)
    if problem is None and logits.dim() < 1:
        problem = Problem(ValueError, "logits must have at least one dim (the vocab shard)")
    return problem or _check_target(target, logits.shape[:-1], "the logits' token dims (logits.shape[:-1])",
                                    logits.device)


def check_linear(hidden, weight, target, bias, *, autocast_dtype: torch.dtype | None) -> Problem | None:
    """``autocast_dtype``: the enclosing ``torch.autocast`` dtype (None outside autocast), under which
    hidden, weight and bias may differ in dtype, as ``F.linear``'s inputs may there."""
    problem = _check_float("hidden", hidden) or _check_float("weight", weight)
    if problem is not None:
        return problem
    if weight.dim() != 2:
        return Problem(ValueError, f"weight must be [V_local, H], got shape {tuple(weight.shape)}")
    if hidden.dim() < 1 or hidden.shape[-1] != weight.shape[1]:
        return Problem(
            ValueError,
            f"hidden's last dim ({hidden.shape[-1] if hidden.dim() else None}) does not match "
            f"weight's hidden size ({weight.shape[1]}); weight must be [V_local, H]",
        )
    if hidden.device != weight.device:
        return Problem(ValueError, f"hidden is on {hidden.device} but weight is on {weight.device}")
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (weight.shape[0],):
            shape = tuple(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__
            return Problem(ValueError, f"bias must be [V_local]=[{weight.shape[0]}], got {shape}")
        if bias.device != weight.device or not bias.is_floating_point():
            return Problem(TypeError, f"bias must be a float tensor on weight's device ({weight.device})")
    dtypes = {t.dtype for t in (hidden, weight, bias) if t is not None}
    if len(dtypes) > 1 and (autocast_dtype is None or torch.float64 in dtypes):
        names = ", ".join(f"{n} {t.dtype}" for n, t in (("hidden", hidden), ("weight", weight), ("bias", bias))
                          if t is not None)
        return Problem(
            TypeError,
            f"dtypes differ ({names}): outside torch.autocast the inputs must share one dtype. Run the call "
            f"inside torch.autocast('{hidden.device.type}', dtype=torch.bfloat16) as an AMP model's lm_head does "
            "(matmuls in bf16, gradients in each input's dtype), or cast hidden to the weight's dtype",
        )
    return _check_target(target, hidden.shape[:-1], "hidden's token dims (hidden.shape[:-1])", hidden.device)


def agree(
    problem: Problem | None,
    group,
    *,
    local_size: Callable[[], int],
    facts: Callable[[], dict[str, Callable[[], object]]],
    device,
    vocab_size: int | None,
    check: bool,
    target: torch.Tensor | None = None,
    ignore_index: int = -100,
) -> tuple[VocabLayout, DeferredTargetCheck | None]:
    """The one metadata exchange of a call: raise ``problem`` on every rank, check that the ranks
    agree on ``facts`` and that the shard sizes form the torch.chunk layout. Returns the layout and,
    at world 1 with ``check`` and a ``target``, the target check still to settle (None otherwise).

    Args:
        problem: this rank's local input problem, or None.
        group: resolved ProcessGroup or None.
        local_size: this rank's vocab rows (called only when ``problem`` is None).
        facts: makes the named integers that must be equal on every rank (token count, chunk
            option, ...): ranks that disagree on the chunk count would otherwise deadlock in the
            per-chunk collectives. Made only for an exchange (not at world 1, where they would be
            host time before the first GEMM); each value is called only when ``problem`` is None
            (0 is sent otherwise), so a call with bad input still sends the same keys and the
            exchange always matches up.
        vocab_size: the global vocab size if the caller knows it (a DTensor does).
        check: exchange (one all-gather of a few int64s) and check. Needed anyway when ``vocab_size``
            is unknown; skipped otherwise with ``check=False``, and then a problem raises locally.
        target, ignore_index: with ``check``, every valid id of every rank's ``target`` must lie in
            ``[0, V)``: checked here on a group (no host sync beyond the exchange's); at world 1
            the returned :class:`DeferredTargetCheck`, which the op settles.
    """
    world = comm.world_size(group)
    if problem is not None and (world == 1 or not (check or vocab_size is None)):
        problem.raise_()
    span = check and target is not None
    if world == 1:
        v = local_size() if vocab_size is None else vocab_size
        if v != local_size():
            raise ValueError(f"vocab_size={vocab_size} but the unsharded input has {local_size()} classes")
        pending = DeferredTargetCheck(target, ignore_index, v) if span else None
        return VocabLayout.of_rank(None, 1, 0, v), pending
    me = comm.rank(group)
    if check or vocab_size is None:
        facts = facts()
        names = sorted(facts)
        ok = problem is None
        mine = [int(not ok), local_size() if ok else 0, -1 if vocab_size is None else vocab_size]
        mine += [facts[n]() if ok else 0 for n in names]
        # always two slots, so ranks that differ in ``check`` still gather rows of one length
        mine += list(_target_span(target, ignore_index).unbind()) if ok and span else [0, 0]
        rows = comm.all_gather_ints(mine, group, device)
        if problem is not None:
            problem.raise_()
        bad = [r for r, row in enumerate(rows) if row[0]]
        if bad:
            raise InvalidInputError(f"invalid input on rank(s) {bad} of the vocab-parallel group (see the error there)")
        vocab_size = _check_rows([row[1 : 3 + len(names)] for row in rows], names, vocab_size, world)
        if span:
            _check_targets([row[3 + len(names):] for row in rows], vocab_size)
    lay = VocabLayout.of_rank(group, world, me, vocab_size)
    if lay.local_size != local_size():
        raise ValueError(
            f"rank {me} holds {local_size()} vocab rows, but the torch.chunk layout of V={vocab_size} "
            f"over {world} ranks gives it {lay.local_size}"
        )
    return lay, None


def _check_rows(rows: list[list[int]], names: list[str], vocab_size: int | None, world: int) -> int:
    """Raise the same error on every rank when the ranks disagree (all ranks hold all rows)."""
    claims = {row[1] for row in rows}
    if len(claims) > 1:
        raise ValueError(f"ranks of the group disagree on vocab_size: {sorted(claims)}")
    for i, name in enumerate(names):
        values = [row[2 + i] for row in rows]
        if len(set(values)) > 1:
            raise ValueError(
                f"ranks of the vocab-parallel group disagree on {name}: {values} "
                "(every rank of the group must pass the same tokens and options)"
            )
    sizes = [row[0] for row in rows]
    total = sum(sizes)
    if vocab_size is not None and total != vocab_size:
        raise ValueError(
            f"shard sizes {sizes} add up to {total}, but vocab_size is {vocab_size}: "
            "each rank must pass its torch.chunk slice of the vocab"
        )
    expected = shard_sizes(total, world)
    if sizes != expected:
        raise ValueError(
            f"vocab shard sizes over the group are {sizes}; the torch.chunk layout of V={total} "
            f"over {world} ranks is {expected} (rank r must hold torch.chunk(full, {world}, -1)[r])"
        )
    return total


def _target_span(target: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """``[lo, hi]`` (on the target's device) with every valid id of ``target`` inside: both inside
    ``[0, V)`` exactly when every valid id is, and an out-of-range id, if any, is one of them."""
    t = target.reshape(-1)
    if t.numel() == 0:
        return torch.zeros(2, dtype=torch.int64, device=t.device)
    span = kernels.target_span(t, ignore_index)  # one launch on a GPU
    if span is not None:
        return span
    # ignored ids count as 0, which is in range
    lo, hi = torch.aminmax(t.masked_fill(t == ignore_index, 0))
    return torch.stack([lo, hi])


def _check_targets(spans: list[list[int]], vocab_size: int) -> None:
    """Every rank's ``[min, max]`` valid id against ``[0, V)``: every rank holds every span, so
    every rank raises the same error."""
    for r, (lo, hi) in enumerate(spans):
        if lo < 0 or hi >= vocab_size:
            where = f" on rank {r}" if len(spans) > 1 else ""
            raise InvalidInputError(
                f"target holds id(s) outside [0, {vocab_size}) that are not ignore_index (e.g. {lo if lo < 0 else hi}"
                f"{where}); pass check=False to skip this check"
            )
