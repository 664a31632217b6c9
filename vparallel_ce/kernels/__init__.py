"""Implementations of the two per-chunk steps of :mod:`vparallel_ce.stats`, and the settings that pick one.

``ops_for(tensor)`` returns a :class:`KernelBackend`: ``local_stats``, ``grad_logits``,
``loss_stats_grad_`` and ``scale_rows`` of exactly the signatures in :mod:`vparallel_ce.stats`. The
torch versions there are the reference and the CPU path; Triton kernels replace them on GPU when
available. The Triton backend also has ``grad_logits_`` (written over logits the op owns) and, as
``fused`` (:class:`FusedLinear`, :mod:`.fused_linear`), the lm_head GEMM with either step in its
epilogue, which ``linear_cross_entropy`` uses wherever it would recompute logits, where
``fused.covers(h, w, spec)`` is true.

Which backend runs is decided by a :class:`KernelSettings` (:func:`settings`): made from the
environment once, when this module is imported (``VPARALLEL_CE_KERNELS=auto|torch|triton``,
``VPARALLEL_CE_FUSED=0|1``, ``VPARALLEL_CE_FUSED_WS=0|1``), and changed for a block of code with
:func:`use`. Changing ``os.environ`` later has no effect, so one process cannot switch plans by
accident halfway through.
"""

from __future__ import annotations

import contextvars
import enum
import functools
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

import torch
from torch._subclasses.fake_tensor import FakeTensor

from .. import stats
from ..divergence import TORCH_STEPS, DistillSteps

__all__ = ["KernelChoice", "KernelSettings", "settings", "use", "KernelBackend", "FusedLinear", "ops_for",
           "fused_applies", "triton_applies", "target_facts", "word_checksum", "TORCH_OPS", "is_fake"]


# ----------------------------------------------------------------------------------------- settings


class KernelChoice(enum.Enum):
    """Which implementation of the per-chunk steps :func:`ops_for` returns."""

    AUTO = "auto"  # Triton for CUDA tensors in fp16 / bf16 / fp32 where it imports, else torch
    TORCH = "torch"  # the torch reference everywhere
    TRITON = "triton"  # Triton wherever it imports (CPU tensors run it under TRITON_INTERPRET=1)


_ENV_KERNELS = "VPARALLEL_CE_KERNELS"
_ENV_FUSED = "VPARALLEL_CE_FUSED"
_ENV_WS = "VPARALLEL_CE_FUSED_WS"


def _choice(value, what: str) -> KernelChoice:
    if isinstance(value, KernelChoice):
        return value
    try:
        return KernelChoice(value)
    except ValueError:
        names = ", ".join(repr(c.value) for c in KernelChoice)
        raise ValueError(f"{what} must be one of {names}, got {value!r}") from None


def _flag(value, what: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{what} must be True or False, got {value!r}")
    return value


def _env_flag(environ: Mapping[str, str], name: str, default: bool) -> bool:
    value = environ.get(name, "")
    if value == "":  # unset, or set empty (``VAR= cmd``): the default
        return default
    if value not in ("0", "1"):
        raise ValueError(f"{name} must be 0 or 1, got {value!r}")
    return value == "1"


@dataclass(frozen=True)
class KernelSettings:
    """What decides the kernels of a call.

    ``choice``: the backend (:class:`KernelChoice`). ``fused``: whether ``linear_cross_entropy``
    may run the lm_head GEMM fused with the row passes where it recomputes logits (False: cuBLAS +
    the row passes everywhere, and the plan of an unfused call). ``warp_specialized``: whether the
    ``"ws"`` tile schedule of :mod:`.fused_linear` may run on a GPU (it faulted on an H200 with
    Triton 3.6; the interpreter runs it regardless)."""

    choice: KernelChoice = KernelChoice.AUTO
    fused: bool = True
    warp_specialized: bool = False

    def __post_init__(self):
        object.__setattr__(self, "choice", _choice(self.choice, "KernelSettings.choice"))
        _flag(self.fused, "KernelSettings.fused")
        _flag(self.warp_specialized, "KernelSettings.warp_specialized")

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> KernelSettings:
        """The settings that ``VPARALLEL_CE_KERNELS`` (``auto``, ``torch``, ``triton``),
        ``VPARALLEL_CE_FUSED`` and ``VPARALLEL_CE_FUSED_WS`` (``0`` or ``1``) name in ``environ``
        (default ``os.environ``); unset or empty variables keep the defaults, any other value is a
        ``ValueError`` naming the variable."""
        env = os.environ if environ is None else environ
        return cls(choice=_choice(env.get(_ENV_KERNELS, "") or "auto", _ENV_KERNELS),
                   fused=_env_flag(env, _ENV_FUSED, True),
                   warp_specialized=_env_flag(env, _ENV_WS, False))


# Read once, here: a process's plan does not change when its environment does.
_FROM_ENVIRONMENT = KernelSettings.from_environment()
# Whether Triton kernels run under its CPU interpreter. Triton fixes this when the kernels are
# defined (on the first import of the kernel modules), so it too is read once; set it before import.
_INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

# The settings of the code running now, as set by :func:`use`; unset outside any ``use`` block.
_CURRENT: contextvars.ContextVar[KernelSettings] = contextvars.ContextVar("vparallel_ce.kernels.settings")


def settings() -> KernelSettings:
    """The current :class:`KernelSettings`: those of the innermost :func:`use` block around this
    code, else those of the environment at import. Each call reads them once, at its front door,
    and keeps them (:attr:`vparallel_ce.call.Call.kernels`): its backward runs with the kernels its
    forward was planned with, on whatever thread autograd runs it."""
    return _CURRENT.get(_FROM_ENVIRONMENT)


class _Use:
    """The context manager of :func:`use`: its changes, applied over the settings current at entry
    (so one object can be entered again, and nested, in one thread at a time)."""

    def __init__(self, changes: dict):
        self._changes = changes
        self._tokens: list = []  # one per open entry

    def __enter__(self) -> KernelSettings:
        chosen = replace(settings(), **self._changes)
        self._tokens.append(_CURRENT.set(chosen))
        return chosen

    def __exit__(self, *exc) -> None:
        _CURRENT.reset(self._tokens.pop())


def use(kernels: str | KernelChoice | None = None, *, fused: bool | None = None,
        warp_specialized: bool | None = None) -> _Use:
    """A context manager that sets the kernel settings for its block; what is not given keeps its
    current value, and the previous settings come back at the end of the block::

        with vparallel_ce.kernels.use("torch"):           # the torch reference
            ...
        with vparallel_ce.kernels.use(fused=False):       # cuBLAS + the row passes
            ...

    ``kernels``: ``"auto"``, ``"torch"`` or ``"triton"`` (:class:`KernelChoice`); ``fused``,
    ``warp_specialized``: the fields of :class:`KernelSettings`. Arguments are checked here
    (``ValueError``). The block's settings hold for the code it runs in its thread; each call made
    in it keeps them, so its backward uses them wherever and whenever autograd runs it. Use the
    same settings on every rank of a group: they decide the plan."""
    changes = {}
    if kernels is not None:
        changes["choice"] = _choice(kernels, "kernels")
    if fused is not None:
        changes["fused"] = _flag(fused, "fused")
    if warp_specialized is not None:
        changes["warp_specialized"] = _flag(warp_specialized, "warp_specialized")
    return _Use(changes)


def interpreting() -> bool:
    """Whether Triton kernels run under its CPU interpreter (``TRITON_INTERPRET=1`` when this module
    was imported)."""
    return _INTERPRETING


# ----------------------------------------------------------------------------------------- backends


@dataclass(frozen=True)
class FusedLinear:
    """The lm_head GEMM fused with a row pass (:mod:`.fused_linear`): ``covers(h, w, spec)`` says
    where it takes the inputs; ``stats(h, w, b, local_t, owned, spec)`` is the statistics of the
    logits ``h w^T + b`` (never written); ``grad_logits_for(h, local_t, owned, shift, coefs,
    spec)`` makes a chunk's ``(w_block, b_block, col_offset) -> dx`` of recomputed logits."""

    covers: Callable
    stats: Callable
    grad_logits_for: Callable


@dataclass
class KernelBackend:
    """One implementation of the per-chunk steps, chosen once per call (:func:`ops_for`), with what
    it can do as fields. ``grad_logits_``: the gradient written over logits the op owns (None:
    out of place); ``fused``: the lm_head GEMM fused with the row passes (None: cuBLAS + them);
    ``distill``: the distillation ops' local passes over a dense teacher's and the student's logits
    (:class:`vparallel_ce.divergence.DistillSteps`); ``reduce``: the per-token losses to the
    call's output (:func:`vparallel_ce.stats.reduce`)."""

    name: str
    local_stats: Callable
    grad_logits: Callable
    loss_stats_grad_: Callable
    scale_rows: Callable
    grad_logits_: Callable | None = None
    fused: FusedLinear | None = None
    distill: DistillSteps = TORCH_STEPS
    reduce: Callable = stats.reduce


TORCH_OPS = KernelBackend("torch", stats.local_stats, stats.grad_logits, stats.loss_stats_grad_, stats.scale_rows)


# One entry (no arguments): importing Triton takes seconds and a CPU-only process never needs it,
# so the kernel modules are imported on first use; a failed import is tried once, not on every call.
@functools.cache
def _modules():
    """``(fused_linear, triton_ce, targets)``, or None where Triton is missing or fails to import
    (then the torch path is kept)."""
    try:
        from . import fused_linear, targets, triton_ce
    except Exception:
        return None
    return fused_linear, triton_ce, targets


# One entry: the backend is the same object on every call (building it took 1.8 us of host time on
# every ops_for, the lookup 0.1 us); keyed by the kernel functions, so one swapped in (a test's counter) is used.
@functools.lru_cache(maxsize=1)
def _fused_backend(covers: Callable, linear_stats: Callable, grad_logits_for: Callable) -> KernelBackend:
    """The row passes, plus the lm_head GEMM fused with each of them (``linear_cross_entropy``'s
    recomputed logits)."""
    return replace(_modules()[1].OPS, name="triton+fused", fused=FusedLinear(covers, linear_stats, grad_logits_for))


def _triton_ops(fused: bool):
    modules = _modules()
    if modules is None:
        return None
    fused_linear, triton_ce, _ = modules
    if not fused:
        return triton_ce.OPS
    return _fused_backend(fused_linear.schedule_covers, fused_linear.linear_stats, fused_linear.GradLogits)


_TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def is_fake(t) -> bool:
    """Whether ``t`` is a fake tensor (``torch.compile`` tracing an op's shapes,
    :mod:`vparallel_ce.compiled`): it holds no data, so no Triton kernel can run on it; the torch
    reference gives the same shapes and dtypes."""
    return isinstance(t, FakeTensor)


def ops_for(x, current: KernelSettings | None = None):
    """The implementation for tensors like ``x`` under ``current`` (a call's kept settings; default
    the current :func:`settings`): Triton on CUDA (fp16/bf16/fp32) when importable (``choice``
    ``auto``), or wherever it imports (``triton``), with the fused lm_head GEMM kernels unless
    ``fused`` is off; the torch reference otherwise."""
    current = current or settings()
    if current.choice is KernelChoice.TORCH or is_fake(x):
        return TORCH_OPS
    if current.choice is KernelChoice.TRITON or (x.is_cuda and x.dtype in _TRITON_DTYPES):
        ops = _triton_ops(current.fused)
        if ops is not None:
            return ops
    return TORCH_OPS


def triton_applies(device, dtype, *, current: KernelSettings | None = None) -> bool:
    """Whether :func:`ops_for` picks the Triton row passes for tensors of this device and dtype
    under ``current`` (default the current :func:`settings`): what a plan made before the tensors
    exist (the distillation memory model) needs to know."""
    current = current or settings()
    if current.choice is KernelChoice.TORCH or dtype not in _TRITON_DTYPES:
        return False
    if not isinstance(device, torch.device):
        device = torch.device(device)
    on_cpu_too = current.choice is KernelChoice.TRITON and _INTERPRETING  # as ops_for and the kernels' coverage
    if not (device.type == "cuda" or on_cpu_too):
        return False
    return _triton_ops(current.fused) is not None


def fused_applies(device, dtype, *, entropy: bool = False, temperature: float = 1.0,
                  current: KernelSettings | None = None) -> bool:
    """Whether ``linear_cross_entropy`` runs the fused GEMM kernels for lm_head operands of this
    device and matmul dtype (what the policy plans with): bf16/fp16 on a CUDA GPU with tensor
    cores (sm80+) and Triton, unless the current :func:`settings` choose ``torch`` or turn
    ``fused`` off; not for the log-prob ops' temperature / entropy statistic. The rule of
    :func:`.fused_linear.schedule_covers`, for a device and dtype instead of tensors. ``current``:
    as in :func:`ops_for`."""
    current = current or settings()
    if not current.fused or current.choice is KernelChoice.TORCH:
        return False
    if not isinstance(device, torch.device):
        device = torch.device(device)
    if device.type != "cuda" or _triton_ops(True) is None:
        return False
    fl = _modules()[0]
    return (dtype in fl.SCHEDULE_DTYPES and fl.takes_options(entropy=entropy, temperature=temperature)
            and fl._capability(device) >= (8, 0))


def target_facts(target, ignore_index: int, vocab_size: int | None = None, *, out=None):
    """The Triton version of the front door's target span and checksum (:mod:`.targets`: one
    launch instead of six; with ``vocab_size`` also the out-of-range flag) for integer CUDA
    targets, or None where it does not apply (CPU, no Triton, the ``torch`` choice): the caller
    then runs the torch version."""
    if settings().choice is KernelChoice.TORCH or target.dtype not in (torch.int64, torch.int32):
        return None
    if not (target.is_cuda or _INTERPRETING) or is_fake(target):
        return None
    modules = _modules()
    return None if modules is None else modules[2].target_facts(target, ignore_index, vocab_size, out=out)


def word_checksum(words):
    """The Triton version of :func:`vparallel_ce.validate.word_checksum` for a contiguous int32 CUDA
    tensor (:func:`.targets.word_checksum`), or None where it does not apply: the caller then runs
    the torch version."""
    if settings().choice is KernelChoice.TORCH or not (words.is_cuda or _INTERPRETING) or is_fake(words):
        return None
    modules = _modules()
    return None if modules is None else modules[2].word_checksum(words)
