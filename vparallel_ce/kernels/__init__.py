"""Implementations of the two per-chunk steps of :mod:`vparallel_ce.stats`.

``ops_for(tensor)`` returns an object with ``local_stats`` and ``grad_logits`` of exactly the
signatures in :mod:`vparallel_ce.stats`. The torch versions there are the reference and the CPU
path; fused CUDA kernels (Triton) replace them on GPU when available. Set
``VPARALLEL_CE_KERNELS=torch`` to force the reference path.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

from .. import stats

__all__ = ["ops_for", "TORCH_OPS"]

TORCH_OPS = SimpleNamespace(name="torch", local_stats=stats.local_stats, grad_logits=stats.grad_logits)


def _triton_ops():
    try:
        from . import triton_ce
    except Exception:  # triton missing or failing to import: keep the torch path
        return None
    return triton_ce.OPS


def ops_for(x):
    """The implementation for tensors like ``x``: Triton on CUDA (fp16/bf16/fp32) when importable."""
    choice = os.environ.get("VPARALLEL_CE_KERNELS", "auto")
    if choice == "torch":
        return TORCH_OPS
    use_triton = choice == "triton" or (x.is_cuda and x.dtype in _TRITON_DTYPES)
    if use_triton:
        ops = _triton_ops()
        if ops is not None:
            return ops
    return TORCH_OPS


def _dtypes():
    import torch

    return (torch.float16, torch.bfloat16, torch.float32)


_TRITON_DTYPES = _dtypes()
