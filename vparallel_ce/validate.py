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

import contextlib
import contextvars
import dataclasses
import math
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from . import comm, kernels
from .layout import VocabLayout, shard_sizes
from .options import Options
from .divergence import DIVERGENCES
from .policy import DEFAULT_POLICY, ChunkPolicy
from .stats import REDUCTIONS, compute_dtype
from .topk import TAIL_MODES

__all__ = [
    "Problem", "InvalidInputError", "DeferredTargetCheck", "check_options", "check_call_options", "check_logits",
    "check_teacher", "check_topk_teacher", "check_topk_values", "TOPK_SUM_TOL", "check_linear", "check_linear_teacher",
    "agree", "Agreement", "Facts", "target_checksum", "word_checksum", "hidden_checksum", "OPS", "SCHEDULES",
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
    leave the GPU idle while the host then launches the loss. Instead the span's kernel, queued
    behind those kernels, writes it into pinned host memory (on CUDA; the torch version copies it
    there, non-blocking) and :meth:`settle` waits for that alone, once the op's forward has queued
    its own kernels. Until then the kernels see ids clamped into the shard
    (:func:`vparallel_ce.stats.local_targets`), so a bad id reads nothing out of bounds, and the
    error still comes before the op returns a value.

    When a backward will follow, the forward does not wait at all (:meth:`poison`): its outputs
    become NaN on the device if an id is bad, so no plausible number ever comes out, and the op's
    backward settles the check once its own kernels are queued. :attr:`count`, the valid ids'
    count that the same launch makes (fp32, NaN if an id is bad), is the mean's divisor: a mean
    divided by it is NaN already, with no masking pass. A host wait in the forward would
    otherwise leave the GPU idle while the host launches the backward -- with a small microbatch
    behind a model's forward, a third of the loss' time.

    The launch and its copy happen at the check's first use (:attr:`count`, :attr:`bad`,
    :meth:`settle`), which the linear ops make after their first GEMM is queued: from an idle GPU,
    host time before that GEMM is time the GPU waits. The pinned pair and its event are reused
    from call to call (one per device, taken out of the pool while a check is pending and put back
    once it is settled), allocating them being host time too. A check abandoned unsettled (its
    forward raised) keeps its pair, so a copy still in flight never lands in a later call's buffer.
    """

    _pool: dict = {}  # device -> (pinned int64 [3], event), free pairs only

    def __init__(self, target: torch.Tensor, ignore_index: int, vocab_size: int):
        self.vocab_size = vocab_size
        self.on_device = target.is_cuda
        self.event = self.key = self.span = None
        self.settled = False
        self._target, self._ignore_index = target, ignore_index
        self._found = None  # (bad, count) once launched

    @property
    def bad(self) -> torch.Tensor:
        """0-dim bool on the device: whether a valid id lies outside ``[0, V)``."""
        return self.launch()[0]

    @property
    def count(self) -> torch.Tensor:
        """0-dim fp32 on the device: the valid ids' count, NaN if one lies outside ``[0, V)``."""
        return self.launch()[1]

    def launch(self) -> tuple:
        """Launch the check's kernel, which writes the span into pinned host memory (or, for the
        torch version, its copy there), once: ``(bad, count)``."""
        if self._found is not None:
            return self._found
        target, self._target = self._target, None
        if not target.is_cuda:
            self.span, bad, count = _target_span(target, self._ignore_index, self.vocab_size)
        else:
            self.key = target.device
            # dict.pop is atomic, so two threads never take the same pair
            self.span, self.event = self._pool.pop(self.key, None) or (
                torch.empty(3, dtype=torch.int64, pin_memory=True), torch.cuda.Event())
            span, bad, count = _target_span(target, self._ignore_index, self.vocab_size, host=self.span)
            if span.is_cuda:  # the torch version: copied behind its kernels
                self.span[:2].copy_(span, non_blocking=True)
            self.event.record()
        self._found = (bad, count)
        return self._found

    @property
    def waits_on_device(self) -> bool:
        """Whether :meth:`settle` has to wait for the device (a CUDA target, not yet settled)."""
        return self.on_device and not self.settled

    def poison(self, outputs: tuple, *, divided_by: torch.Tensor | None = None) -> tuple:
        """``outputs`` with every element NaN where a valid id lies outside ``[0, V)`` (decided on
        the device, no host wait); the values themselves otherwise, bit for bit. One output divided
        by :attr:`count` (``divided_by``) is NaN there already and comes back as it is."""
        if divided_by is not None and divided_by is self.count and len(outputs) == 1:
            return outputs
        return tuple(None if x is None else x.masked_fill(self.bad, float("nan")) for x in outputs)

    def settle(self) -> None:
        """Raise :class:`InvalidInputError` if a valid id lies outside ``[0, V)`` (once)."""
        if self.settled:
            return
        self.launch()
        self.settled = True
        if self.event is not None:
            self.event.synchronize()
        lo, hi = self.span[:2].tolist()
        if self.event is not None:  # the copy has landed and been read: the pair is free again
            self._pool[self.key] = (self.span, self.event)
        _check_targets([[lo, hi]], self.vocab_size)

    def __del__(self):
        # a check whose backward never ran (the loss was dropped) gives its pair back once its copy
        # has landed; one still in flight is left to the allocator
        if not self.settled and self.event is not None and self.event.query():
            self._pool[self.key] = (self.span, self.event)


def _is_int(v, lo: int = -(2**63), hi: int = 2**63 - 1) -> bool:
    """An int (not a bool) in ``[lo, hi]``: every option travels as an int64 in the exchange, so one
    that does not fit must be caught here, where it becomes a message, not an overflow on one rank."""
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def _integer_scalar(v) -> bool:
    return (isinstance(v, torch.Tensor) and v.numel() == 1 and not v.is_floating_point() and not v.is_complex()
            and v.dtype != torch.bool)


def _positive_finite(v) -> bool:
    return not isinstance(v, bool) and 0 < float(v) < float("inf")


# name -> (predicate, what it must be); a table made once, not per call (this runs on every call)
_OPTION_CHECKS = {
    "reduction": (lambda v: v in REDUCTIONS, f"one of {REDUCTIONS}"),
    "ignore_index": (_is_int, "an int64"),
    "label_smoothing": (lambda v: not isinstance(v, bool) and 0.0 <= float(v) <= 1.0, "in [0, 1]"),
    "z_loss": (lambda v: not isinstance(v, bool) and 0 <= float(v) < float("inf"), "a finite number >= 0"),
    "softcap": (lambda v: v is None or _positive_finite(v), "a finite positive number or None"),
    "temperature": (_positive_finite, "a finite positive number"),
    "chunks": (lambda v: v == "auto" or _is_int(v, 1, 2**31), "an int in [1, 2**31] or 'auto'"),
    "schedule": (lambda v: v in SCHEDULES, f"one of {SCHEDULES}"),
    "recompute": (lambda v: v is None or isinstance(v, bool), "True, False or None"),
    "policy": (lambda v: v is None or isinstance(v, ChunkPolicy), "a vparallel_ce.ChunkPolicy or None"),
    "check_replicated": (lambda v: isinstance(v, bool), "True or False"),
    "check": (lambda v: isinstance(v, bool), "True or False"),
    "sequence_parallel": (lambda v: isinstance(v, bool), "True or False"),
    "vocab_size": (lambda v: v is None or _is_int(v, 1, 2**62), "a positive int or None"),
    "with_entropy": (lambda v: isinstance(v, bool), "True or False"),
    "batch_invariant": (lambda v: isinstance(v, bool), "True or False"),
    "divergence": (lambda v: v in DIVERGENCES, f"one of {DIVERGENCES}"),
    "beta": (lambda v: not isinstance(v, bool) and 0.0 <= float(v) <= 1.0, "in [0, 1]"),
    "hard_weight": (lambda v: not isinstance(v, bool) and 0 <= float(v) < float("inf"), "a finite number >= 0"),
    "logits_dtype": (lambda v: v is None or v is torch.float32, "None or torch.float32"),
    "num_valid_tokens": (lambda v: v is None or _is_int(v, 0, 2**62) or _integer_scalar(v),
                         "an int >= 0, a one-element integer tensor or None"),
}


_GOOD_OPTIONS: set = set()  # (name, type, value) seen valid: a call repeats its options every step
# only values that cannot change after the check (a tensor option hashes by identity and could be
# written in place between calls)
_CACHED_TYPES = (int, float, str, bool, type(None), ChunkPolicy, torch.dtype)


def check_options(**options) -> Problem | None:
    """Check the keyword options a call was given (only those named)."""
    # the cache is not even read while dynamo traces a call (vparallel_ce.compiled): reading it
    # would guard the graph on its contents, so any later eager call that adds an entry would make
    # the graph recompile (and older dynamo refuses to guard on the policies it holds)
    cached = not torch.compiler.is_compiling()
    for name, value in options.items():
        # the type is part of the key: True == 1 == 1.0, but chunks=True is not chunks=1
        key = (name, type(value), value) if cached and type(value) in _CACHED_TYPES else None
        try:
            if key is not None and key in _GOOD_OPTIONS:
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
    if options.get("num_valid_tokens") is not None and options.get("reduction", "mean") != "mean":
        return Problem(ValueError, "num_valid_tokens is the divisor of reduction='mean', got reduction="
                                   f"{options.get('reduction')!r}")
    if options.get("divergence") == "jsd" and float(options.get("beta", 0.5)) in (0.0, 1.0):
        # m = q at beta 0 and m = p at 1: the JSD is then 0 for every input -- a loss that trains
        # nothing -- where TRL's and Liger's JSD read these two betas as the two KLs
        beta = options.get("beta")
        kl = "forward_kl', KL(p||q)" if float(beta) == 0.0 else "reverse_kl', KL(q||p)"
        return Problem(ValueError, f"kind='jsd' with beta={beta!r} is 0 for every input (its mixture m is then the "
                                   f"{'student' if float(beta) == 0.0 else 'teacher'}'s own distribution); for the "
                                   f"divergence other libraries mean by it pass kind='{kl}, or a beta inside (0, 1)")
    if options.get("recompute") is False and options.get("reduction") == "none":
        return Problem(ValueError, "recompute=False (gradients made in forward) needs reduction 'mean' or 'sum': "
                                   "with reduction='none' the upstream gradient is only known in backward")
    return None


def check_call_options(options: Options) -> Problem | None:
    """:func:`check_options` of every field of a call's :class:`~vparallel_ce.options.Options`."""
    return check_options(**options.as_kwargs())


def _check_target(target, token_shape, what: str, device) -> Problem | None:
    if not isinstance(target, torch.Tensor):
        return Problem(TypeError, f"target must be a tensor, got {type(target).__name__}")
    if target.dtype not in (torch.int64, torch.int32):
        return Problem(TypeError, "target must hold integer class ids (torch.int64 or torch.int32), got dtype "
                                  f"{target.dtype}")
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


def check_teacher(student: torch.Tensor, teacher, *, target_given: bool, hard_weight: float) -> Problem | None:
    """The distillation's teacher logits against the (checked) student's local logits; and its
    hard term's need for a target (``hard_weight`` is a checked option by now). The teacher's dtype
    may differ from the student's (both are read in the statistics' dtype); the ranks must agree on
    it (a fact of the exchange)."""
    problem = _check_float("teacher_logits", teacher)
    if problem is not None:
        return problem
    if tuple(teacher.shape) != tuple(student.shape):
        return Problem(InvalidInputError, f"teacher_logits shape {tuple(teacher.shape)} does not match student_logits "
                                          f"{tuple(student.shape)}: both must be this rank's shard of the same "
                                          "[..., V] logits")
    if teacher.device != student.device:
        return Problem(ValueError, f"teacher_logits is on {teacher.device} but student_logits on {student.device}")
    return _hard_term_target(target_given, hard_weight)


def _hard_term_target(target_given: bool, hard_weight: float) -> Problem | None:
    """The distillation's hard term (``hard_weight > 0``, a checked option by now) needs a target."""
    if not target_given and float(hard_weight) > 0:
        return Problem(ValueError, f"hard_weight={hard_weight} mixes in the student's cross-entropy, which needs a "
                                   "target; pass target, or hard_weight=0.0")
    return None


def check_topk_teacher(student: torch.Tensor, teacher, *, target_given: bool, hard_weight: float,
                       student_name: str = "student_logits") -> Problem | None:
    """A :class:`~vparallel_ce.topk.TopKTeacher`'s tensors against the (checked) student's local
    ``[..., V_local]`` logits or ``[..., H_s]`` hidden states (``student_name``, for messages):
    ``[..., k]`` integer ids and float log-probs over the student's token dims. Their values are
    checked after the exchange (:func:`check_topk_values`)."""
    ids, logprobs = teacher.ids, teacher.logprobs
    if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int64, torch.int32):
        what = ids.dtype if isinstance(ids, torch.Tensor) else type(ids).__name__
        return Problem(TypeError, f"TopKTeacher.ids must be a torch.int64 or torch.int32 tensor, got {what}")
    problem = _check_float("TopKTeacher.logprobs", logprobs)
    if problem is not None:
        return problem
    if teacher.tail not in TAIL_MODES:
        return Problem(ValueError, f"TopKTeacher.tail must be one of {TAIL_MODES}, got {teacher.tail!r}")
    token_dims = tuple(student.shape[:-1])
    if ids.dim() < 1 or tuple(ids.shape[:-1]) != token_dims or ids.shape[-1] < 1:
        return Problem(InvalidInputError, f"TopKTeacher.ids shape {tuple(ids.shape)} is not [*token dims, k] with "
                                          f"k >= 1 for {student_name} {tuple(student.shape)} (token dims {token_dims})")
    if tuple(logprobs.shape) != tuple(ids.shape):
        return Problem(InvalidInputError, f"TopKTeacher.logprobs shape {tuple(logprobs.shape)} does not match its ids "
                                          f"{tuple(ids.shape)}")
    if ids.device != student.device or logprobs.device != student.device:
        return Problem(ValueError, f"TopKTeacher is on {ids.device}/{logprobs.device} but {student_name} on "
                                   f"{student.device}")
    return _hard_term_target(target_given, hard_weight)


# how far the teacher's top-k probabilities may sum above 1 (rounding of the stored log-probs)
# before a BUCKET teacher is refused: its tail is then clamped to 0
TOPK_SUM_TOL = {torch.float64: 1e-9, torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 3e-3}


def check_topk_values(ids: torch.Tensor, logprobs: torch.Tensor, valid: torch.Tensor | None, vocab_size: int,
                      tail, *, group=None) -> None:
    """A sparse teacher's ``[N, k]`` values on the tokens that count (``valid``; None: all): ids in
    ``[0, V)`` and distinct within a row, log-probs ``<= 0`` (not nan), with ``BUCKET`` their
    probabilities summing to at most ``1 + TOPK_SUM_TOL``, with ``RENORMALIZE`` some mass in each
    row. Raises :class:`InvalidInputError`; one host read. Called once the ranks agree on these
    values (the exchange compares their checksums), so every rank raises the same error -- or,
    with ``group`` (sequence parallelism: each rank holds its own tokens' rows), after one more
    all-gather of every rank's verdict, naming the ranks whose rows are bad."""
    problem = _topk_problem(ids, logprobs, valid, vocab_size, tail)
    if group is not None and comm.is_sharded(group):
        bad = [r for r, (flag,) in enumerate(comm.all_gather_ints([problem is not None], group, ids.device)) if flag]
        if not bad:
            return
        said = comm.all_gather_objects(problem, group)
        raise InvalidInputError("; ".join(f"rank {r}: {said[r]}" for r in bad))
    if problem is not None:
        raise InvalidInputError(problem)


def _topk_problem(ids: torch.Tensor, logprobs: torch.Tensor, valid: torch.Tensor | None, vocab_size: int,
                  tail) -> str | None:
    """What :func:`check_topk_values` finds wrong with one rank's rows, or None."""
    if ids.numel() == 0:
        return None
    rows = torch.ones(ids.shape[0], dtype=torch.bool, device=ids.device) if valid is None else valid
    keep = rows.unsqueeze(-1)
    out = ~((ids >= 0) & (ids < vocab_size)) & keep
    ordered = ids.sort(-1).values
    repeated = (ordered[:, 1:] == ordered[:, :-1]) & keep
    positive = ~(logprobs <= 0) & keep
    lse = torch.logsumexp(logprobs.to(compute_dtype(logprobs.dtype)), -1)
    if tail == "bucket":
        over = (lse > math.log1p(TOPK_SUM_TOL.get(logprobs.dtype, 1e-5))) & rows
    else:
        over = (lse == float("-inf")) & rows
    flags = torch.stack([out.any(), repeated.any(), positive.any(), over.any()]).tolist()
    if not any(flags):
        return None
    if flags[0]:
        bad = ids[out][0].item()
        return (f"TopKTeacher.ids hold id(s) outside [0, {vocab_size}) on tokens that count (e.g. {bad}); pass "
                "check=False to skip this check")
    if flags[1]:
        row = repeated.any(-1).nonzero()[0, 0].item()
        return (f"TopKTeacher.ids repeat an id within a token's row (token {row}: {ids[row].tolist()[:16]}): the "
                "top-k ids must be distinct")
    if flags[2]:
        return f"TopKTeacher.logprobs must be log-probabilities (<= 0, not nan), got {logprobs[positive][0].item()}"
    row = over.nonzero()[0, 0].item()
    if tail == "bucket":
        return (f"TopKTeacher probabilities exp(logprobs) sum to {math.exp(lse[row].item()):.6g} > 1 on token {row}: "
                "with tail='bucket' they must leave a tail mass >= 0 (pass the teacher's log-probabilities at the "
                "distillation temperature, log_softmax(logits / T), or tail='renormalize')")
    return f"TopKTeacher.logprobs of token {row} are all -inf: with tail='renormalize' a token needs some teacher " \
           "mass on its ids"


def check_linear(hidden, weight, target, bias, *, autocast_dtype: torch.dtype | None,
                 prefix: str = "") -> Problem | None:
    """``autocast_dtype``: the enclosing ``torch.autocast`` dtype (None outside autocast), under which
    hidden, weight and bias may differ in dtype, as ``F.linear``'s inputs may there. ``prefix``:
    before each argument's name in the messages (``"student_"``)."""
    hn = f"{prefix}hidden"
    return (_check_lm_head(hidden, weight, bias, autocast_dtype=autocast_dtype, prefix=prefix)
            or _check_target(target, hidden.shape[:-1], f"{hn}'s token dims ({hn}.shape[:-1])", hidden.device))


def _check_lm_head(hidden, weight, bias, *, autocast_dtype: torch.dtype | None, prefix: str) -> Problem | None:
    """Hidden states ``[..., H]`` against an lm_head shard ``[V_local, H]`` and its bias."""
    hn, wn, bn = f"{prefix}hidden", f"{prefix}weight", f"{prefix}bias"
    problem = _check_float(hn, hidden) or _check_float(wn, weight)
    if problem is not None:
        return problem
    if weight.dim() != 2:
        return Problem(ValueError, f"{wn} must be [V_local, H], got shape {tuple(weight.shape)}")
    if hidden.dim() < 1 or hidden.shape[-1] != weight.shape[1]:
        return Problem(
            ValueError,
            f"{hn}'s last dim ({hidden.shape[-1] if hidden.dim() else None}) does not match "
            f"{wn}'s hidden size ({weight.shape[1]}); {wn} must be [V_local, H]",
        )
    if hidden.device != weight.device:
        return Problem(ValueError, f"{hn} is on {hidden.device} but {wn} is on {weight.device}")
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (weight.shape[0],):
            shape = tuple(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__
            return Problem(ValueError, f"{bn} must be [V_local]=[{weight.shape[0]}], got {shape}")
        if bias.device != weight.device or not bias.is_floating_point():
            return Problem(TypeError, f"{bn} must be a float tensor on {wn}'s device ({weight.device})")
    dtypes = {t.dtype for t in (hidden, weight, bias) if t is not None}
    if len(dtypes) > 1 and (autocast_dtype is None or torch.float64 in dtypes):
        names = ", ".join(f"{n} {t.dtype}" for n, t in ((hn, hidden), (wn, weight), (bn, bias)) if t is not None)
        return Problem(
            TypeError,
            f"dtypes differ ({names}): outside torch.autocast the inputs must share one dtype. Run the call "
            f"inside torch.autocast('{hidden.device.type}', dtype=torch.bfloat16) as an AMP model's lm_head does "
            f"(matmuls in bf16, gradients in each input's dtype), or cast {hn} to {wn}'s dtype",
        )
    return None


def check_linear_teacher(hidden: torch.Tensor, weight: torch.Tensor, teacher_hidden, teacher_weight, teacher_bias,
                         *, autocast_dtype: torch.dtype | None, target_given: bool,
                         hard_weight: float) -> Problem | None:
    """The teacher's hidden states and lm_head shard of ``linear_distillation_loss`` against the
    (checked) student's local ``hidden [..., H_s]`` and ``weight [V_local, H_s]``: the same tokens,
    the same vocab shard (``[V_local, H_t]``, ``H_t`` free), the same device, and outside autocast
    the student's dtype. And the hard term's need for a target."""
    problem = _check_float("teacher_hidden", teacher_hidden) or _check_float("teacher_weight", teacher_weight)
    if problem is not None:
        return problem
    if tuple(teacher_hidden.shape[:-1]) != tuple(hidden.shape[:-1]):
        return Problem(InvalidInputError, f"teacher_hidden's token dims {tuple(teacher_hidden.shape[:-1])} do not "
                                          f"match student_hidden's {tuple(hidden.shape[:-1])}: the teacher must see "
                                          "the same tokens")
    if teacher_weight.dim() == 2 and teacher_weight.shape[0] != weight.shape[0]:
        return Problem(InvalidInputError, f"teacher_weight has {teacher_weight.shape[0]} vocab rows on this rank but "
                                          f"student_weight {weight.shape[0]}: both must be this rank's torch.chunk "
                                          "shard of the same vocab")
    if teacher_hidden.device != hidden.device or teacher_weight.device != weight.device:
        return Problem(ValueError, f"the teacher's inputs are on {teacher_hidden.device} / {teacher_weight.device} "
                                   f"but the student's on {hidden.device}")
    problem = _check_lm_head(teacher_hidden, teacher_weight, teacher_bias, autocast_dtype=autocast_dtype,
                             prefix="teacher_")
    if problem is not None:
        return problem
    if autocast_dtype is None and teacher_weight.dtype != weight.dtype:
        return Problem(TypeError, f"dtypes differ (student_weight {weight.dtype}, teacher_weight "
                                  f"{teacher_weight.dtype}): outside torch.autocast both models' inputs must share "
                                  "one dtype; run the call inside torch.autocast or cast the teacher to the student's "
                                  "dtype")
    if autocast_dtype is not None and (torch.float64 in (teacher_weight.dtype, weight.dtype)
                                       and teacher_weight.dtype != weight.dtype):
        return Problem(TypeError, f"dtypes differ (student_weight {weight.dtype}, teacher_weight "
                                  f"{teacher_weight.dtype}): float64 does not mix with other dtypes, even under "
                                  "torch.autocast")
    return _hard_term_target(target_given, hard_weight)


# ---------------------------------------------------------------------------------------------
# The cross-rank agreement: one fixed-size exchange per call.

_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.int16,
           torch.int8, torch.uint8, torch.bool)
OPS = ("cross_entropy", "linear_cross_entropy", "token_logprobs", "linear_token_logprobs", "distillation_loss",
       "linear_distillation_loss")
_INPUT_NAMES = ("grad mode", "input", "weight", "bias")


def _dtype_code(dtype) -> int:
    if dtype is None:
        return -1
    return _DTYPES.index(dtype) if dtype in _DTYPES else len(_DTYPES)


def _show_dtype(code: int) -> str:
    return "None" if code < 0 else str(_DTYPES[code]) if code < len(_DTYPES) else "another dtype"


def _float_code(x) -> int:
    """A float as the int64 of its bits: compared exactly and shown back as the float."""
    return int.from_bytes(struct.pack("<d", float(x)), "little", signed=True)


def _show_float(code: int) -> str:
    return repr(struct.unpack("<d", code.to_bytes(8, "little", signed=True))[0])


def _show_choice(choices):
    return lambda code: repr(choices[code]) if 0 <= code < len(choices) else "?"


def _show_chunks(code: int) -> str:
    return "'auto'" if code == -1 else str(code)


def _show_softcap(code: int) -> str:
    return "None" if code == _NO_SOFTCAP else _show_float(code)


def _show_grads(code: int) -> str:
    if not code & 1:
        return "grad mode off"
    names = [n for i, n in enumerate(_INPUT_NAMES) if i and code >> i & 1]
    return "requires grad: " + (", ".join(names) if names else "none")


_NO_SOFTCAP = _float_code(float("nan")) ^ 1  # no float has these bits
_NO_FACT = 0  # a fact that does not apply to the op, or that a rank with bad input cannot make


def _shown(show, *, per_rank: bool = False):
    """A field's metadata: how its code reads in a message; ``per_rank``: with sequence
    parallelism each rank holds other tokens, so the value is not compared."""
    return field(metadata=dict(show=show, per_rank=per_rank))


@dataclass(frozen=True)
class Facts:
    """What every rank of a group must agree on before the op's first collective, as integer codes:
    one int64 row per rank, the same length whatever the op, its options and inputs, so that ranks
    that disagree on any of them still gather rows that match up and raise the same error. Fields
    are checked in their order here (a rank holding other tokens is reported as that, not as a
    checksum that differs). Build with :meth:`of`."""

    op: int = _shown(_show_choice(OPS))
    sequence_parallel: int = _shown(lambda c: str(bool(c)))
    input_dtype: int = _shown(_show_dtype)
    weight_dtype: int = _shown(_show_dtype)
    bias_dtype: int = _shown(_show_dtype)
    target_dtype: int = _shown(_show_dtype)
    hidden_size: int = _shown(str)
    # the backward's collectives (dh over the group, rows with sequence parallelism) run where an
    # input needs a gradient: ranks that differ would leave one waiting for the others
    grads: int = _shown(_show_grads)
    reduction: int = _shown(_show_choice(REDUCTIONS))
    chunks: int = _shown(_show_chunks)
    schedule: int = _shown(_show_choice(SCHEDULES))
    recompute: int = _shown(lambda c: {-1: "None", 0: "False", 1: "True"}.get(c, "?"))
    fused_kernels: int = _shown(lambda c: str(bool(c)))
    ignore_index: int = _shown(str)
    # the mean's divisor, if given (_NO_COUNT: none); a tensor count rides on the exchange as it is
    num_valid_tokens: object = _shown(lambda c: "None" if c == _NO_COUNT else str(c))
    label_smoothing: int = _shown(_show_float)
    z_loss: int = _shown(_show_float)
    softcap: int = _shown(_show_softcap)
    temperature: int = _shown(_show_float)
    # the statistics carry the entropy (one more value per token in the all-reduces)
    entropy: int = _shown(lambda c: str(bool(c)))
    # the distillation's math: each decides what the per-chunk all-reduces carry, and the loss
    divergence: int = _shown(_show_choice(DIVERGENCES))
    beta: int = _shown(_show_float)
    hard_weight: int = _shown(_show_float)
    # distillation without a target counts every token; with one, ignore_index decides
    target_given: int = _shown(lambda c: str(bool(c)))
    # the distillation's teacher: its logits' (or top-k log-probs') dtype -- it may differ from the
    # student's, but not from rank to rank -- and for a top-k teacher its k, tail mode and values,
    # which decide the per-chunk all-reduce's size and every rank's loss (-1 / 0: dense or no teacher)
    teacher_dtype: int = _shown(_show_dtype)
    teacher_k: int = _shown(lambda c: "dense logits" if c < 0 else str(c))
    teacher_tail: int = _shown(lambda c: "None" if c < 0 else _show_choice(TAIL_MODES)(c))
    # (with sequence parallelism a sparse teacher's rows are each rank's own tokens', as the hidden states)
    teacher_ids_checksum: object = _shown(lambda c: f"{c:#x}", per_rank=True)
    teacher_logprobs_checksum: object = _shown(lambda c: f"{c:#x}", per_rank=True)
    # the lm_head matmuls' dtype (torch.autocast's inside it): it decides the plan and the kernels
    matmul_dtype: int = _shown(_show_dtype)
    # the logits' dtype as asked (None: the matmul dtype): it decides their precision and the plan's memory
    logits_dtype: int = _shown(_show_dtype)
    chunk_policy: int = _shown(lambda c: f"a ChunkPolicy with CRC {c}")
    # the order of every sum (tiles, rank-ordered SUM): ranks that differ would run other collectives
    batch_invariant: int = _shown(lambda c: str(bool(c)))
    token_count: int = _shown(str, per_rank=True)
    # position-sensitive (target_checksum): a permutation of the ids, or ids shifted by one, is a
    # different checksum
    target_checksum: object = _shown(lambda c: f"{c:#x}", per_rank=True)
    # hidden states must be replicated over the group (hidden_checksum: position-sensitive, exact)
    hidden_checksum: object = _shown(lambda c: f"{c:#x}", per_rank=True)

    @classmethod
    def of(cls, *, op: str, options: Options, inputs: tuple, target: torch.Tensor, target_checksum,
           hidden_checksum=_NO_FACT, fused: bool = False, matmul_dtype: torch.dtype | None = None,
           target_given: bool = True, teacher=None) -> "Facts":
        """``inputs``: the op's float inputs, ``(logits,)`` or ``(hidden, weight, bias)``;
        ``fused``, ``matmul_dtype``: the linear ops' kernels and lm_head matmul dtype (False and
        None for the logits ops); ``target_given``: False for a distillation without a target
        (``target`` is then a stand-in of zeros); ``teacher``: the distillation's (checked) teacher,
        its logits or a :class:`~vparallel_ce.topk.TopKTeacher`, else None."""
        o = options
        first, weight, bias = (*inputs, None, None)[:3]
        grads = int(torch.is_grad_enabled())
        for i, t in enumerate((first, weight, bias)):
            grads |= int(t is not None and t.requires_grad) << (i + 1)
        return cls(
            OPS.index(op), int(bool(o.sequence_parallel)), _dtype_code(first.dtype),
            _dtype_code(None if weight is None else weight.dtype), _dtype_code(None if bias is None else bias.dtype),
            _dtype_code(target.dtype), -1 if weight is None else weight.shape[-1], grads,
            REDUCTIONS.index(o.reduction), -1 if o.chunks == "auto" else int(o.chunks), SCHEDULES.index(o.schedule),
            {None: -1, False: 0, True: 1}[o.recompute], int(bool(fused)), int(o.ignore_index),
            _count_code(o.num_valid_tokens, target.device),
            _float_code(o.label_smoothing), _float_code(o.z_loss),
            _NO_SOFTCAP if o.softcap is None else _float_code(o.softcap), _float_code(o.temperature),
            int(o.with_entropy), DIVERGENCES.index(o.divergence), _float_code(o.beta), _float_code(o.hard_weight),
            int(target_given), *_teacher_codes(teacher), _dtype_code(matmul_dtype), _dtype_code(o.logits_dtype),
            _policy_code(o.policy), int(o.batch_invariant), target.numel(), target_checksum, hidden_checksum)

    def row(self) -> list:
        return [getattr(self, f.name) for f in dataclasses.fields(self)]


def _teacher_codes(teacher) -> tuple:
    """``(dtype, k, tail, ids checksum, logprobs checksum)`` of a distillation's teacher."""
    if teacher is None:
        return -1, -1, -1, _NO_FACT, _NO_FACT
    if isinstance(teacher, torch.Tensor):
        return _dtype_code(teacher.dtype), -1, -1, _NO_FACT, _NO_FACT
    ids, logprobs = teacher.ids, teacher.logprobs
    return (_dtype_code(logprobs.dtype), ids.shape[-1], TAIL_MODES.index(teacher.tail),
            target_checksum(ids.reshape(-1).to(torch.int64)), hidden_checksum(logprobs))


_NO_COUNT = -(2**63)  # num_valid_tokens=None: no count, negative or not, has this code


def _count_code(count, device):
    """``num_valid_tokens`` as a fact: :data:`_NO_COUNT` for None, an int as it is, a tensor as an
    int64 on the exchange's device (no host read; a negative one is refused after the exchange)."""
    if count is None:
        return _NO_COUNT
    if isinstance(count, torch.Tensor):
        return count.reshape(()).to(device, torch.int64)
    return int(count)


_FACT_FIELDS = dataclasses.fields(Facts)
_HEAD = 5  # problem flag, vocab rows, vocab_size claim, lowest and highest valid target id


def _policy_code(policy) -> int:
    """The chunk policy as one integer (a CRC of its fields): ranks whose policies differ (say, a
    budget from each rank's free memory) would plan different chunk counts and deadlock in the
    per-chunk collectives."""
    return zlib.crc32(repr(dataclasses.astuple(policy or DEFAULT_POLICY)).encode())


def deferred_check(target: torch.Tensor, options: Options, vocab_size: int) -> DeferredTargetCheck | None:
    """The target range check a world-1 call leaves pending (None: ``check`` is off, or the target
    is fake -- torch.compile tracing the op's shapes -- whose ids the compiled op's own run checks,
    :mod:`vparallel_ce.compiled`)."""
    if options.check is not True or kernels.is_fake(target):
        return None
    return DeferredTargetCheck(target, options.ignore_index, vocab_size)


@dataclass(frozen=True)
class Agreement:
    """The outcome of a call's exchange: the layout of this rank's vocab shard, the token count of
    every rank (known from the exchange; None without one), and at world 1 the target check still
    to settle."""

    layout: VocabLayout
    counts: tuple[int, ...] | None = None
    pending: DeferredTargetCheck | None = None


def agree(
    problem: Problem | None,
    group,
    *,
    local_size: Callable[[], int],
    facts: Callable[[torch.Tensor], Facts],
    device,
    options: Options,
    vocab_size: int | None,
    target: torch.Tensor,
) -> Agreement:
    """The one metadata exchange of a call: raise ``problem`` on every rank, check that the ranks
    agree on the call's :class:`Facts` and that the shard sizes form the torch.chunk layout.

    Args:
        problem: this rank's local input problem, or None.
        group: resolved ProcessGroup or None.
        local_size: this rank's vocab rows (called only when ``problem`` is None).
        facts: makes this rank's :class:`Facts` from its target checksum -- only for an exchange
            (at world 1 they would be host time before the first GEMM), and only when ``problem``
            is None (a rank with bad input sends zeros: the row has the same length either way).
        options: the call's options. ``check``: exchange (one all-gather of a fixed number of
            int64s) and check; needed anyway when the vocab size is unknown, skipped otherwise with
            ``check=False``, and then a problem raises locally. ``policy``: shown field by field if
            the ranks' policies differ.
        vocab_size: the global vocab size if the caller knows it (given, or a DTensor's).
        target: the target (its checksum is compared); with ``check``, every valid id (not
            ``ignore_index``) of every rank's ``target`` must lie in ``[0, V)``: checked here on a
            group; at world 1 by the returned :attr:`Agreement.pending`, which the op settles.
    """
    check, ignore_index, policy = options.check, options.ignore_index, options.policy
    world = comm.world_size(group)
    # only check=False with a known vocab size skips the exchange (a check that is not a bool is a
    # problem to report through it)
    exchange = check is not False or vocab_size is None
    if problem is not None and (world == 1 or not exchange):
        problem.raise_()
    span = check is True
    if world == 1:
        v = local_size() if vocab_size is None else vocab_size
        if v != local_size():
            raise ValueError(f"vocab_size={vocab_size} but the unsharded input has {local_size()} classes")
        return Agreement(VocabLayout.of_rank(None, 1, 0, v), None, deferred_check(target, options, v))
    me = comm.rank(group)
    counts = None
    if exchange:
        ok = problem is None
        # a rank with bad input sends no claim: its vocab_size may be what is bad (not an int64)
        mine = [int(not ok), local_size() if ok else 0, -1 if vocab_size is None or not ok else vocab_size]
        if ok:
            lo, hi, checksum = _target_facts(target, ignore_index).unbind()
            mine += ([lo, hi] if span else [0, 0]) + facts(checksum).row()
        else:
            mine += [0, 0] + [_NO_FACT] * len(_FACT_FIELDS)
        rows = comm.all_gather_ints(mine, group, device)
        bad = [r for r, row in enumerate(rows) if row[0]]
        if bad:  # every rank sees the same rows, so every rank takes this second exchange
            messages = comm.all_gather_objects(None if ok else problem.message, group)
            if problem is not None:
                problem.raise_()
            raise InvalidInputError("invalid input on rank(s) " + "; ".join(f"{r}: {messages[r]}" for r in bad))
        _check_facts([row[_HEAD:] for row in rows], group, policy)
        _check_count(rows[0][_HEAD + _NUM_VALID])
        vocab_size = _check_sizes([row[1] for row in rows], [row[2] for row in rows], vocab_size, world)
        if span:
            _check_targets([row[3:5] for row in rows], vocab_size)
        counts = tuple(row[_HEAD + _COUNT] for row in rows)
    lay = VocabLayout.of_rank(group, world, me, vocab_size)
    if lay.local_size != local_size():
        raise ValueError(
            f"rank {me} holds {local_size()} vocab rows, but the torch.chunk layout of V={vocab_size} "
            f"over {world} ranks gives it {lay.local_size}"
        )
    return Agreement(lay, counts, None)


_COUNT = [f.name for f in _FACT_FIELDS].index("token_count")
_NUM_VALID = [f.name for f in _FACT_FIELDS].index("num_valid_tokens")


def _check_count(code: int) -> None:
    """A tensor ``num_valid_tokens`` is only read here, from the exchange (the ranks agree on it
    by now): a negative count raises on every rank. (Without an exchange a negative count makes
    the loss nan: :func:`vparallel_ce.call._divisor`.)"""
    if code != _NO_COUNT and code < 0:
        raise InvalidInputError(f"num_valid_tokens must be >= 0, got {code}")
_SP = [f.name for f in _FACT_FIELDS].index("sequence_parallel")


def _check_facts(rows: list[list[int]], group, policy) -> None:
    """Raise the same error on every rank at the first fact the ranks disagree on (every rank
    holds every row), naming it and each rank's value."""
    sequence_parallel = rows[0][_SP]
    for i, f in enumerate(_FACT_FIELDS):
        if f.metadata["per_rank"] and sequence_parallel:
            continue
        values = [row[i] for row in rows]
        if len(set(values)) == 1:
            continue
        if f.name == "chunk_policy":  # a CRC names nothing: every rank sends its policy itself
            shown = [repr(p) for p in comm.all_gather_objects(policy or DEFAULT_POLICY, group)]
        else:
            shown = [f.metadata["show"](v) for v in values]
        per_rank = ", ".join(f"rank {r}: {v}" for r, v in enumerate(shown))
        hint = {
            "target_checksum": "every rank must pass the same target ids in the same order",
            "teacher_ids_checksum": "every rank must pass the same TopKTeacher ids (global vocab ids, not this "
                                    "rank's shard of them)",
            "teacher_logprobs_checksum": "every rank must pass the same TopKTeacher logprobs",
            "hidden_checksum": "hidden (and linear_distillation_loss's teacher_hidden) must be replicated over the "
                               "group (the same values on every rank); a "
                               "token-sharded hidden needs sequence_parallel=True. Inside a "
                               "torch.distributed.pipelining schedule wrap the loss in "
                               "vparallel_ce.pipeline.PipelineLoss (its first step's shape inference passes "
                               "uninitialised outputs), or pass check_replicated=False",
            "grads": "run the op with the same autograd state on every rank: its backward joins the ranks",
        }.get(f.name, "every rank of the group must pass the same tokens and options")
        raise InvalidInputError(f"ranks of the vocab-parallel group disagree on {f.name.replace('_', ' ')}: "
                                f"{per_rank} ({hint})")


def _check_sizes(sizes: list[int], claims: list[int], vocab_size: int | None, world: int) -> int:
    """The shard sizes against the claimed vocab size and the torch.chunk layout; the same error on
    every rank when they do not fit."""
    if len(set(claims)) > 1:
        raise ValueError(f"ranks of the group disagree on vocab_size: {[None if c < 0 else c for c in claims]}")
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


def _target_facts(target: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """``[lo, hi, checksum]`` (int64, on the target's device): every valid id of ``target`` lies in
    ``[lo, hi]``, both inside ``[0, V)`` exactly when every valid id is, and an out-of-range id, if
    any, is one of them; ``checksum`` is :func:`target_checksum`."""
    t = target.reshape(-1)
    if t.numel() == 0:
        return torch.zeros(3, dtype=torch.int64, device=t.device)
    found = kernels.target_facts(t, ignore_index)  # one launch on a GPU
    if found is not None:
        return found
    lo, hi, _ = _torch_span(t, ignore_index)
    return torch.stack([lo, hi, target_checksum(t.to(torch.int64))])


def _torch_span(t: torch.Tensor, ignore_index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The torch version of the span of a 1-D target: ``lo, hi`` (0-dim int64) as in
    :func:`_target_facts`, and the mask of its ignored ids."""
    t = t.to(torch.int64)
    ignored = t == ignore_index
    if t.numel() == 0:
        zero = torch.zeros((), dtype=torch.int64, device=t.device)
        return zero, zero, ignored
    lo, hi = torch.aminmax(t.masked_fill(ignored, 0))  # ignored ids count as 0, which is in range
    return lo, hi, ignored


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


def _target_span(target: torch.Tensor, ignore_index: int, vocab_size: int,
                 host: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[lo, hi]`` of :func:`_target_facts`, a 0-dim bool, whether a valid id lies outside
    ``[0, vocab_size)``, and the valid ids' count as a 0-dim fp32, NaN if so (on the target's
    device; one launch on a GPU, which writes the span into ``host``, a pinned int64 ``[3]``, where
    given: then the returned span is ``host[:2]``)."""
    t = target.reshape(-1)
    found = kernels.target_facts(t, ignore_index, vocab_size, out=host) if t.numel() else None
    if found is not None:
        facts, bad, count = found
        return facts[:2], bad, count
    lo, hi, ignored = _torch_span(t, ignore_index)  # (no checksum: at world 1 nothing compares it)
    bad = (lo < 0) | (hi >= vocab_size)
    count = (~ignored).sum().to(torch.float32).masked_fill(bad, float("nan"))
    return torch.stack([lo, hi]), bad, count


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
