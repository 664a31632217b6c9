"""The enclosing ``torch.autocast`` state, as the front door reads it (the matmul dtype of a
:class:`~vparallel_ce.call.Call`), and the context the ops' forward and backward run in.
"""

from __future__ import annotations

import contextlib

import torch

__all__ = ["autocast_dtype", "autocast_off"]


def autocast_dtype(device: torch.device) -> torch.dtype | None:
    """The enclosing ``torch.autocast`` dtype for ``device``'s type, or None outside autocast."""
    kind = device.type
    if kind not in _AUTOCAST_TYPES or not torch.is_autocast_enabled(kind):
        return None
    return torch.get_autocast_dtype(kind)


def autocast_off(device_type: str):
    """The context an op's forward and backward run in: autocast off for ``device_type``
    (the matmul dtype comes from :attr:`Call.matmul_dtype`). Outside autocast, a shared no-op
    context instead of a ``torch.autocast`` object to build, enter and leave on every call."""
    if device_type in _AUTOCAST_TYPES and torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return _NO_CONTEXT


_AUTOCAST_TYPES = ("cuda", "cpu", "xpu", "hpu", "mps")
_NO_CONTEXT = contextlib.nullcontext()
