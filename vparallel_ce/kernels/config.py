"""Which kernels run: a :class:`KernelSettings` (:func:`settings`), made from the environment once,
when this module is imported (``VPARALLEL_CE_KERNELS=auto|torch|triton``, ``VPARALLEL_CE_FUSED=0|1``,
``VPARALLEL_CE_FUSED_WS=0|1``), and changed for a block of code with :func:`use`
(:mod:`vparallel_ce.kernels` hands these on).
"""

from __future__ import annotations

import contextvars
import enum
import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass, replace

import torch

__all__ = ["KernelChoice", "KernelSettings", "settings", "use", "interpreting", "sm_count"]


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


@functools.lru_cache(maxsize=64)  # (a device query per launch otherwise)
def sm_count(device) -> int:
    """The multiprocessors of a CUDA ``device`` (4 under the interpreter or off CUDA): the size of
    the kernels' persistent grids."""
    if interpreting() or device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count
