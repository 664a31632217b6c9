"""The world-1 front door's verdicts, remembered by the metadata they were drawn from.

A training loop calls its loss with the same shapes, dtypes, devices and options every step. At
world 1 (no group) the front door's checks and the plan read nothing else of the tensors: the one
check of their values, the target range check, is a kernel of each call
(:class:`~vparallel_ce.target_check.DeferredTargetCheck`). So a call whose metadata equal those of an
earlier call that passed takes that call's :class:`~vparallel_ce.call.Call` and makes only its
per-call parts (the divisor, the pending target check), in a copy that skips the dataclass
machinery (:meth:`~vparallel_ce.call.Call.again`). From an idle GPU, the front door's host time is
time the GPU waits before the first GEMM: what this saves shows in the distillation benchmark's
from-idle times (``docs/benchmarks.md``).

Nothing is remembered for a call on a group (its exchange reads values every call), while dynamo
traces, for an input that is not a plain tensor (a DTensor, a fake tensor), or for a call that
raised: a bad call is checked again every time.
"""

from __future__ import annotations

import torch

from . import kernels, policy as _policy
from .options import OPTION_NAMES, Options

__all__ = ["Verdicts", "tensor_metadata", "VERDICTS"]

# exact types: a subclass (DTensor, FakeTensor, FunctionalTensor) unwraps or traces differently
_PLAIN = frozenset((torch.Tensor, torch.nn.Parameter))


def tensor_metadata(*tensors) -> tuple | None:
    """What the front door reads of each of ``tensors``: type, shape, dtype and device (None stays
    None); None if one is neither None nor a plain tensor."""
    out = []
    for t in tensors:
        if t is None:
            out.append(None)
        elif type(t) in _PLAIN:
            out.append((type(t), t.shape, t.dtype, t.device))
        else:
            return None
    return tuple(out)


def _options_key(o: Options) -> tuple | None:
    """The options by value AND type: ``True == 1 == 1.0`` and they hash alike, but
    ``chunks=True`` is an error where ``chunks=1`` is not. A tensor ``num_valid_tokens`` by its
    metadata: its check reads no more of it, and each call reads its value. None for any other
    tensor option (a ``label_smoothing`` tensor): its value is checked, and may change in place
    between calls."""
    values = tuple(vars(o).values())
    types = tuple(map(type, values))
    if _VALUE_TYPES.issuperset(types):  # the common case, in one set operation
        return values, types
    values = list(values)
    for i, v in enumerate(values):
        if isinstance(v, torch.Tensor):
            if i != _COUNT:
                return None
            values[i] = (v.shape, v.dtype, v.device)
    return tuple(values), types


# option value types that are no tensor (anything else is looked at one by one)
_VALUE_TYPES = frozenset((int, float, str, bool, type(None), torch.dtype, _policy.ChunkPolicy))
_COUNT = OPTION_NAMES.index("num_valid_tokens")


class Verdicts:
    """Calls that passed the world-1 front door, by :meth:`key`. At most ``capacity`` of them (all
    forgotten at once when full: a loop has a handful of shapes)."""

    def __init__(self, capacity: int = 256):
        self.capacity = capacity
        self._known: dict = {}

    @staticmethod
    def key(op: str, options: Options, tensors: tuple, extra: tuple = ()) -> tuple | None:
        """The key of a world-1 call of ``op``: its options, the metadata of ``tensors``, ``extra``
        (the caller's other inputs as metadata, and whatever else its checks read), the current
        kernel settings and, for a call without a policy, the default one it plans with (read from
        :mod:`vparallel_ce.policy` now: it may have been replaced). None where nothing may be
        remembered (see the module's docstring)."""
        meta = tensor_metadata(*tensors)
        if meta is None or torch.compiler.is_compiling():
            return None
        opts = _options_key(options)
        if opts is None:
            return None
        return op, opts, meta, extra, kernels.settings(), _policy.DEFAULT_POLICY if options.policy is None else None

    def get(self, key: tuple | None):
        """The call remembered under ``key``, or None."""
        if key is None:
            return None
        try:
            return self._known.get(key)
        except TypeError:  # an unhashable option value (a policy holding a list): never remembered
            return None

    def remember(self, key: tuple | None, call) -> None:
        if key is None:
            return
        if len(self._known) >= self.capacity:
            self._known.clear()
        try:
            self._known[key] = call
        except TypeError:
            pass

    def forget(self) -> None:
        self._known.clear()


#: the front door's verdicts (:mod:`vparallel_ce.call`)
VERDICTS = Verdicts()
