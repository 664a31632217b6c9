"""Argument checks, phrased so the user can fix the call.

The local checks return a :class:`Problem` (or None) instead of raising, so that "some rank's input
is bad" travels through the one metadata exchange every call makes anyway
(:func:`vparallel_ce.agreement.agree`) and the error is raised on EVERY rank -- a rank that raised
alone would leave the others waiting in the next collective. The target range check is
:mod:`vparallel_ce.target_check`'s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import comm
from .options import Options
from .divergence import DIVERGENCES
from .policy import ChunkPolicy
from .stats import REDUCTIONS, compute_dtype
from .topk import TAIL_MODES

__all__ = [
    "Problem", "InvalidInputError", "check_options", "check_call_options", "check_logits", "check_teacher",
    "check_topk_teacher", "check_topk_values", "raise_values_problem", "TOPK_SUM_TOL", "check_linear", "check_linear_teacher", "SCHEDULES",
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
    "top_k": (lambda v: v is None or _is_int(v, 1, 2**31), "an int >= 1 or None"),
    "top_p": (lambda v: v is None or (not isinstance(v, bool) and 0.0 < float(v) <= 1.0), "in (0, 1] or None"),
    "min_p": (lambda v: v is None or (not isinstance(v, bool) and 0.0 <= float(v) <= 1.0), "in [0, 1] or None"),
    "num_valid_tokens": (lambda v: v is None or _is_int(v, 0, 2**62) or _integer_scalar(v),
                         "an int >= 0, a one-element integer tensor or None"),
    "mtp_heads": (lambda v: v == 0 or _is_int(v, 2, 2**16), "an int in [2, 65536] (the main head and 1+ depths)"),
    "mtp_scale": (lambda v: not isinstance(v, bool) and 0 <= float(v) < float("inf"), "a finite number >= 0"),
    "mtp_counts": (lambda v: v is None or (isinstance(v, torch.Tensor) and v.dim() == 1 and not v.is_floating_point()
                                           and not v.is_complex() and v.dtype != torch.bool),
                   "None or a 1-D integer tensor (one count per head)"),
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
                       student_name: str = "student_logits", temperature: float | None = None) -> Problem | None:
    """A :class:`~vparallel_ce.topk.TopKTeacher`'s tensors against the (checked) student's local
    ``[..., V_local]`` logits or ``[..., H_s]`` hidden states (``student_name``, for messages):
    ``[..., k]`` integer ids and float log-probs over the student's token dims. Their values are
    checked after the exchange (:func:`check_topk_values`). ``temperature``: the call's (a checked
    option), against the one the record was taken at (:func:`_topk_temperature`)."""
    problem = _topk_temperature(teacher, temperature)
    if problem is not None:
        return problem
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


def _topk_temperature(teacher, temperature: float | None) -> Problem | None:
    """A record that says which temperature its log-probs were taken at must be used at that one:
    the op does not rescale them (the whole vocab's normaliser is not in the record), and a record
    of another temperature gives a plausible, wrong loss."""
    recorded = getattr(teacher, "temperature", None)
    if recorded is None or temperature is None:
        return None
    if not _positive_finite(recorded):
        return Problem(ValueError, f"TopKTeacher.temperature must be a finite positive number or None, got "
                                   f"{recorded!r}")
    if float(recorded) != float(temperature):
        return Problem(InvalidInputError, f"the TopKTeacher was recorded at temperature={recorded!r} (its logprobs are "
                                          f"log_softmax(teacher_logits / {recorded!r})) but the loss is called with "
                                          f"temperature={temperature!r}: record the teacher at the loss' temperature "
                                          "or call the loss at the record's")
    return None


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
    raise_values_problem(_topk_problem(ids, logprobs, valid, vocab_size, tail), group, ids.device)


def raise_values_problem(problem: str | None, group, device) -> None:
    """Raise a values check's ``problem`` (None: fine) as an :class:`InvalidInputError` -- with
    ``group`` (each rank checked its own rows) on every rank, after one all-gather of the ranks'
    verdicts and, only if one is bad, of their messages, naming the ranks."""
    if group is not None and comm.is_sharded(group):
        bad = [r for r, (flag,) in enumerate(comm.all_gather_ints([problem is not None], group, device)) if flag]
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
