r"""The options of a compiled op as one string constant of the graph, and back.

While dynamo traces a public op, :func:`vparallel_ce.compiled.apply` writes the call's options, the
``torch.autocast`` dtype and the kernel settings in force as a string (:func:`key_of`), which dynamo
folds into a constant; the custom ops read them back (:func:`decode`, :func:`as_traced`).

This module is imported by :mod:`vparallel_ce.compiled` where a call is traced or a graph runs,
never when ``vparallel_ce`` is imported: it marks the kernel-settings read as a constant for dynamo
(``torch._dynamo.assume_constant_result``), and importing ``torch._dynamo`` costs a process about
1.5 s, which a process that never compiles should not pay (every spawned rank pays it).
"""

from __future__ import annotations

import ast
import contextlib
import functools
from dataclasses import fields

import torch
import torch._dynamo

from . import kernels
from .options import OPTION_NAMES, Options
from .policy import ChunkPolicy

__all__ = ["refused_count", "key_of", "decode", "as_traced", "reduction_of"]


_FLOATS = frozenset({"label_smoothing", "z_loss", "softcap", "temperature", "beta", "hard_weight"})
_DTYPES = frozenset({"logits_dtype"})  # written by name (a torch.dtype is no literal)
_POLICY_FIELDS = tuple(f.name for f in fields(ChunkPolicy) if f.init)


def refused_count(count) -> bool:
    """A ``num_valid_tokens`` that is neither None, a tensor nor an int >= 0 (its check refuses it)."""
    return count is not None and not isinstance(count, torch.Tensor) and (
        type(count) is not int or not 0 <= count <= 2**62)


def key_of(o: Options, amp) -> str:
    """``o`` (checked), the autocast dtype ``amp`` and the kernel settings as one string: a tuple
    literal of the options, then the two others. Built while dynamo traces, which folds it into a
    constant. A tensor ``num_valid_tokens`` is an input of the op, written as ``'tensor'``."""
    parts = []
    for name in OPTION_NAMES:
        v = getattr(o, name)
        if name == "policy" and v is not None:
            v = tuple(getattr(v, f) for f in _POLICY_FIELDS)
        elif name == "num_valid_tokens" and v is not None and not refused_count(v):
            v = "tensor"
        elif name in _FLOATS and v is not None:
            v = float(v)
        elif name in _DTYPES and v is not None:
            v = str(v).removeprefix("torch.")
        parts.append(f"{v!r}")
    return f"({', '.join(parts)},)|{amp!r}|{_settings_code()}"


@torch._dynamo.assume_constant_result  # imports dynamo: why this module is imported late
def _settings_code() -> str:
    """The current kernel settings, read when dynamo traces (they live in a ContextVar, which
    dynamo does not trace)."""
    s = kernels.settings()
    return f"{s.choice.value},{int(s.fused)},{int(s.warp_specialized)}"


@functools.lru_cache(maxsize=256)
def decode(key: str) -> tuple[Options, torch.dtype | None, kernels.KernelSettings]:
    literal, amp, settings = key.rsplit("|", 2)
    values = dict(zip(OPTION_NAMES, ast.literal_eval(literal)))
    if values["policy"] is not None:
        values["policy"] = ChunkPolicy(**dict(zip(_POLICY_FIELDS, values["policy"])))
    for name in _DTYPES:
        if values[name] is not None:
            values[name] = getattr(torch, values[name])
    dtype = None if amp == "None" else getattr(torch, amp.removeprefix("torch."))
    choice, fused, ws = settings.split(",")
    return Options(**values), dtype, kernels.KernelSettings(choice, fused == "1", ws == "1")


@contextlib.contextmanager
def as_traced(key: str, device: torch.device):
    """The settings and autocast state that dynamo saw, for the front door (the graph may run
    without them: Inductor does not re-enter the autocast region around an op)."""
    _, amp, s = decode(key)
    kind = device.type
    if amp is not None:
        autocast = torch.autocast(kind, dtype=amp)
    elif torch.is_autocast_enabled(kind):
        autocast = torch.autocast(kind, enabled=False)
    else:
        autocast = contextlib.nullcontext()
    with kernels.use(s.choice, fused=s.fused, warp_specialized=s.warp_specialized), autocast:
        yield


def reduction_of(key: str) -> str:
    """The ``reduction`` written in ``key``, read without building the :class:`Options` (whose
    checks a refused call's key may fail)."""
    return ast.literal_eval(key.rsplit("|", 2)[0])[OPTION_NAMES.index("reduction")]
