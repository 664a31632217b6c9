"""Implementations of the two per-chunk steps of :mod:`vparallel_ce.stats`.

``ops_for(tensor)`` returns a :class:`KernelBackend`: ``local_stats``, ``grad_logits``,
``loss_stats_grad_`` and ``scale_rows`` of exactly the signatures in :mod:`vparallel_ce.stats`. The
torch versions there are the reference and the CPU path; Triton kernels replace them on GPU when
available. The Triton backend also has ``grad_logits_`` (written over logits the op owns) and, as
``fused`` (:class:`FusedLinear`, :mod:`.fused_linear`), the lm_head GEMM with either step in its
epilogue, which ``linear_cross_entropy`` uses wherever it would recompute logits, where
``fused.covers(h, w, spec)`` is true. Set
``VPARALLEL_CE_KERNELS=torch`` to force the reference path, ``VPARALLEL_CE_FUSED=0`` to keep
cuBLAS + the row passes.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from .. import stats

__all__ = ["KernelBackend", "FusedLinear", "ops_for", "fused_applies", "target_facts", "word_checksum", "TORCH_OPS"]


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
    out of place); ``fused``: the lm_head GEMM fused with the row passes (None: cuBLAS + them)."""

    name: str
    local_stats: Callable
    grad_logits: Callable
    loss_stats_grad_: Callable
    scale_rows: Callable
    grad_logits_: Callable | None = None
    fused: FusedLinear | None = None


TORCH_OPS = KernelBackend("torch", stats.local_stats, stats.grad_logits, stats.loss_stats_grad_, stats.scale_rows)


def interpreting() -> bool:
    """Whether Triton kernels run under its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _modules():
    """``(fused_linear, triton_ce, targets)``, imported once; None where Triton is missing or fails to import
    (then the torch path is kept). Looked up on every call, so not by an import statement."""
    global _MODULES
    if _MODULES is False:
        try:
            from . import fused_linear, targets, triton_ce
            _MODULES = (fused_linear, triton_ce, targets)
        except Exception:
            _MODULES = None
    return _MODULES


_MODULES = False  # not imported yet


def _triton_ops(fused: bool):
    if _modules() is None:
        return None
    fused_linear, triton_ce, _ = _MODULES
    if not fused:
        return triton_ce.OPS
    # the row passes, plus the lm_head GEMM fused with each of them (linear_cross_entropy's
    # recomputed logits): ``fused_covers(h, w, spec)`` says where the GEMM kernels take the inputs.
    # Built once per set of kernel functions (this runs on every call; tests swap the functions)
    key = (fused_linear.schedule_covers, fused_linear.linear_stats, fused_linear.GradLogits)
    if _FUSED_OPS.get("key") != key:
        _FUSED_OPS["key"] = key
        _FUSED_OPS["ops"] = replace(triton_ce.OPS, name="triton+fused", fused=FusedLinear(*key))
    return _FUSED_OPS["ops"]


_FUSED_OPS: dict = {}


def ops_for(x):
    """The implementation for tensors like ``x``: Triton on CUDA (fp16/bf16/fp32) when importable,
    with the fused lm_head GEMM kernels unless ``VPARALLEL_CE_FUSED=0``."""
    choice = os.environ.get("VPARALLEL_CE_KERNELS", "auto")
    if choice == "torch":
        return TORCH_OPS
    use_triton = choice == "triton" or (x.is_cuda and x.dtype in _TRITON_DTYPES)
    if use_triton:
        ops = _triton_ops(os.environ.get("VPARALLEL_CE_FUSED", "1") != "0")
        if ops is not None:
            return ops
    return TORCH_OPS


_TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def fused_applies(device, dtype, *, entropy: bool = False, temperature: float = 1.0) -> bool:
    """Whether ``linear_cross_entropy`` runs the fused GEMM kernels for lm_head operands of this
    device and matmul dtype (what the policy plans with): bf16/fp16 on a CUDA GPU with tensor
    cores (sm80+) and Triton, unless ``VPARALLEL_CE_KERNELS=torch`` or ``VPARALLEL_CE_FUSED=0``;
    not for the log-prob ops' temperature / entropy statistic. The rule of
    :func:`.fused_linear.schedule_covers`, for a device and dtype instead of tensors."""
    if os.environ.get("VPARALLEL_CE_FUSED", "1") == "0" or os.environ.get("VPARALLEL_CE_KERNELS", "auto") == "torch":
        return False
    if not isinstance(device, torch.device):
        device = torch.device(device)
    if device.type != "cuda" or _triton_ops(True) is None:
        return False
    fl = _MODULES[0]
    return (dtype in fl.SCHEDULE_DTYPES and fl.takes_options(entropy=entropy, temperature=temperature)
            and fl._capability(device) >= (8, 0))  # _capability: cached per device


def target_facts(target, ignore_index: int):
    """The Triton version of the front door's target span and checksum (:mod:`.targets`: one
    launch instead of six) for integer CUDA targets, or None where it does not apply (CPU, no Triton,
    ``VPARALLEL_CE_KERNELS=torch``): the caller then runs the torch version."""
    if os.environ.get("VPARALLEL_CE_KERNELS", "auto") == "torch" or target.dtype not in (torch.int64, torch.int32):
        return None
    if not (target.is_cuda or interpreting()) or _modules() is None:
        return None
    return _MODULES[2].target_facts(target, ignore_index)


def word_checksum(words):
    """The Triton version of :func:`vparallel_ce.validate.word_checksum` for a contiguous int32 CUDA
    tensor (:func:`.targets.word_checksum`), or None where it does not apply: the caller then runs
    the torch version."""
    if os.environ.get("VPARALLEL_CE_KERNELS", "auto") == "torch" or not (words.is_cuda or interpreting()):
        return None
    if _modules() is None:
        return None
    return _MODULES[2].word_checksum(words)
