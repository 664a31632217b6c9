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

import functools
from collections.abc import Callable
from dataclasses import replace

import torch
from torch._subclasses.fake_tensor import FakeTensor

from .backend import TORCH_GATHERED, TORCH_OPS, FusedLinear, GatheredRows, KernelBackend, RowGemm
from .config import KernelChoice, KernelSettings, interpreting, settings, use
from .config import _INTERPRETING  # a constant read at import, tested on every call

__all__ = ["KernelChoice", "KernelSettings", "settings", "use", "KernelBackend", "FusedLinear", "RowGemm",
           "GatheredRows", "TORCH_GATHERED", "ops_for",
           "invariant_ops", "fused_applies", "triton_applies", "target_facts", "word_checksum", "set_rows_on_shard",
           "support_bad_rows",
           "TORCH_OPS", "is_fake"]


# One entry (no arguments): importing Triton takes seconds and a CPU-only process never needs it,
# so the kernel modules are imported on first use; a failed import is tried once, not on every call.
@functools.cache
def _modules():
    """``(fused_linear, triton_ce, targets, row_gemm)``, or None where Triton is missing or fails to
    import (then the torch path is kept)."""
    try:
        from . import fused_linear, row_gemm, targets, triton_ce
    except Exception:
        return None
    return fused_linear, triton_ce, targets, row_gemm


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
    fused_linear, triton_ce, *_ = modules
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


# One entry: the same object on every call, as _fused_backend.
@functools.cache
def _invariant_backend() -> KernelBackend:
    _, triton_ce, _, row_gemm = _modules()
    return replace(triton_ce.OPS, name="invariant:triton", row_gemm=RowGemm(row_gemm.logits, row_gemm.add_rows_mm_))


def invariant_ops(device, dtype, current: KernelSettings | None = None) -> KernelBackend | None:
    """The kernels of ``batch_invariant=True`` for operands of this device and dtype under
    ``current`` (default the current :func:`settings`), or None where they do not apply (the mode
    then runs the torch path one fixed tile at a time, :mod:`vparallel_ce.invariant`): the Triton
    row passes (one program per row) and the lm_head GEMMs of :mod:`.row_gemm` (one fixed tile
    config, no split-K), never the fused GEMM kernels -- for bf16/fp16 on an sm80+ GPU (``auto`` or
    ``triton``), and fp32 too under ``TRITON_INTERPRET=1`` with ``triton``."""
    current = current or settings()
    if current.choice is KernelChoice.TORCH:
        return None
    if not isinstance(device, torch.device):
        device = torch.device(device)
    if not (device.type == "cuda" or (current.choice is KernelChoice.TRITON and _INTERPRETING)):
        return None
    modules = _modules()
    if modules is None or not modules[3].covers(device, dtype):
        return None
    return _invariant_backend()


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
    from .tiles import _capability  # (loaded with the Triton modules just above)

    return (dtype in fl.SCHEDULE_DTYPES and fl.takes_options(entropy=entropy, temperature=temperature)
            and _capability(device) >= (8, 0))


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
    """The Triton version of :func:`vparallel_ce.checksums.word_checksum` for a contiguous int32 CUDA
    tensor (:func:`.targets.word_checksum`), or None where it does not apply: the caller then runs
    the torch version."""
    if settings().choice is KernelChoice.TORCH or not (words.is_cuda or _INTERPRETING) or is_fake(words):
        return None
    modules = _modules()
    return None if modules is None else modules[2].word_checksum(words)


@functools.cache
def _set_rows_module():
    """:mod:`.set_rows`, or None where Triton is missing or fails to import (imported on first use)."""
    try:
        from . import set_rows
    except Exception:
        return None
    return set_rows


def _set_rows_for(ids, current: KernelSettings | None):
    """:mod:`.set_rows` for int64 ``[n, K]`` ids on CUDA (or under the interpreter) unless the
    settings choose ``torch``; else None."""
    current = current or settings()
    if current.choice is KernelChoice.TORCH or ids.dtype != torch.int64 or ids.dim() != 2:
        return None
    if not (ids.is_cuda or _INTERPRETING) or is_fake(ids):
        return None
    return _set_rows_module()


def set_rows_on_shard(ids, target, heights, offset: int, local_size: int, ignore_index: int,
                      current: KernelSettings | None = None):
    """The Triton version of :meth:`vparallel_ce.set_chunk.SetRows.of_chunks`'s per-row steps
    (:func:`.set_rows.set_rows`: one launch for every chunk of a call) for int64 CUDA ids, or None
    where it does not apply (CPU, no Triton, the ``torch`` choice): the caller then runs the torch
    steps. ``current``: as in :func:`ops_for`."""
    module = _set_rows_for(ids, current)
    return None if module is None else module.set_rows(ids, target, heights, offset, local_size, ignore_index)


def support_bad_rows(ids, target, ignore_index: int, vocab_size: int, current: KernelSettings | None = None):
    """The Triton version of the sampling set's values check (:func:`.set_rows.bad_rows`: the first
    bad row of each kind, one launch after a row sort) for int64 CUDA ids, or None where it does
    not apply: the caller then runs the torch steps. ``current``: as in :func:`ops_for`."""
    module = _set_rows_for(ids, current)
    return None if module is None else module.bad_rows(ids, target, ignore_index, vocab_size)
