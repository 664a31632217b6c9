"""A Function's ``ctx`` state as tensors and a template, for the compiled ops
(:mod:`vparallel_ce.compiled`): the forward op returns every tensor of the state that is not an
input as an extra output (:class:`Tensors`), the rest of the state -- objects, containers, plain
values -- is kept as a template whose tensors are :class:`Slot` s (:func:`strip`), and the backward
op rebuilds the ctx from the template and the tensors it is given (:func:`fill`)."""

from __future__ import annotations

import collections
import copy
import enum

import torch
from torch import Tensor
from torch.multiprocessing.reductions import StorageWeakRef

from .target_check import DeferredTargetCheck

__all__ = ["Ctx", "Slot", "Tensors", "strip", "fill", "TEMPLATES", "keep_template", "template_key"]


class Ctx:
    """Stands in for autograd's ctx when the ops run a Function's forward and backward."""

    # the backward op gets the forward's state as tensors only: the target check cannot wait for
    # it, so the forward settles it (Call.settle_forward)
    checks_in_forward = True

    def __init__(self, needs_input_grad: tuple):
        self.needs_input_grad = needs_input_grad
        self.saved_tensors = ()
        self.materialize = True

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors

    def set_materialize_grads(self, value: bool):
        self.materialize = value


class Slot:
    """A tensor's place in a template: ``pool[index]``, reshaped to ``shape`` if given (a view of an
    input)."""

    __slots__ = ("index", "shape")

    def __init__(self, index: int, shape=None):
        self.index, self.shape = index, shape


_STATIC = (type(None), bool, int, float, str, bytes, slice, enum.Enum, torch.dtype, torch.device, torch.Size)


class Tensors:
    """Collects the tensors of a state: ``pool`` is the op's inputs, then its outputs, then the new
    tensors (:attr:`new`, which the forward op returns after its outputs)."""

    def __init__(self, inputs: list, outputs: list):
        self.inputs = inputs
        self.pool = list(inputs)
        self.storages: dict = {}  # storage -> taken by an input or an output
        for t in inputs:
            if t is not None:
                self.storages.setdefault(StorageWeakRef(t.untyped_storage()), t)
        self.outputs = [self._own(t) for t in outputs]
        self.pool += self.outputs
        self.new: list = []
        self.ids = {id(t): i for i, t in enumerate(self.pool) if t is not None}

    def _own(self, t: Tensor) -> Tensor:
        """``t`` as an output of the op: contiguous, and a copy where it would share memory with an
        input or another output (a custom op's outputs alias nothing)."""
        ref = StorageWeakRef(t.untyped_storage())
        if ref in self.storages:
            t = t.clone(memory_format=torch.contiguous_format)
        else:
            t = t.contiguous()
        self.storages[StorageWeakRef(t.untyped_storage())] = t
        return t

    def slot(self, t: Tensor) -> Slot:
        i = self.ids.get(id(t))
        if i is not None and i < len(self.inputs) + len(self.outputs):
            return Slot(i)
        for j, x in enumerate(self.inputs):  # a reshape of an input (the front door's [N, V] rows)
            if (x is not None and t.numel() == x.numel() and t.dtype == x.dtype and t.is_contiguous()
                    and x.is_contiguous() and t.storage_offset() == x.storage_offset()
                    and StorageWeakRef(t.untyped_storage()) == StorageWeakRef(x.untyped_storage())):
                return Slot(j, tuple(t.shape))
        self.new.append(self._own(t))
        return Slot(len(self.pool) + len(self.new) - 1)


_AS_IS = object()  # a leaf function's answer: not a leaf, walk into it


def _walk(value, leaf, memo: dict):
    """``value`` with ``leaf(x)`` in place of every ``x`` for which it does not answer
    :data:`_AS_IS`; containers and objects around them copied, one copy per object, so that state
    shared between attributes stays shared."""
    got = leaf(value)
    if got is not _AS_IS:
        return got
    if isinstance(value, _STATIC):
        return value
    if id(value) in memo:
        return memo[id(value)]
    if isinstance(value, list):
        out = memo[id(value)] = []
        out.extend(_walk(v, leaf, memo) for v in value)
    elif isinstance(value, tuple):
        items = [_walk(v, leaf, memo) for v in value]
        out = memo[id(value)] = type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    elif hasattr(value, "__dict__"):
        out = memo[id(value)] = copy.copy(value)
        for k, v in vars(value).items():
            object.__setattr__(out, k, _walk(v, leaf, memo))
    else:  # a process group, a function: kept as it is
        out = value
    return out


def strip(value, tensors: Tensors, memo: dict):
    """``value`` with every tensor replaced by its :class:`Slot`."""

    def leaf(x):
        if isinstance(x, Tensor):
            return tensors.slot(x)
        if isinstance(x, DeferredTargetCheck):  # settled by the forward: nothing for the backward
            return None
        return _AS_IS

    return _walk(value, leaf, memo)


def fill(template, pool: list, memo: dict):
    """The inverse of :func:`strip`: a fresh copy of ``template`` with the tensors of ``pool``."""

    def leaf(x):
        if isinstance(x, Slot):
            t = pool[x.index]
            return t if x.shape is None else t.reshape(x.shape)
        return _AS_IS

    return _walk(template, leaf, memo)


#: (op, key, need, the inputs' shapes, strides and dtypes) -> the template of the forward's ctx:
#: written by the forward op's run, read by the backward's; the least recently written go beyond
#: MAX_TEMPLATES (a run whose token counts never repeat would otherwise grow it without end)
TEMPLATES: collections.OrderedDict = collections.OrderedDict()
MAX_TEMPLATES = 1024


def keep_template(key: tuple, template) -> None:
    TEMPLATES[key] = template
    TEMPLATES.move_to_end(key)
    while len(TEMPLATES) > MAX_TEMPLATES:
        TEMPLATES.popitem(last=False)


def template_key(name, key, need, tensors) -> tuple:
    return (name, key, tuple(need),
            tuple(None if t is None else (tuple(t.shape), t.stride(), t.dtype, t.device) for t in tensors))
