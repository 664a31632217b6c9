"""The target range check: every valid id (not ``ignore_index``) of every rank's target lies in
``[0, V)``.

On a group each rank's lowest and highest valid id ride on the call's one metadata exchange
(:func:`vparallel_ce.agreement.agree`), so the check costs no collective and no host sync beyond
that one, and happens before any kernel of the op is launched. At world 1 there is no exchange to
ride on: the span is read back without blocking (:class:`DeferredTargetCheck`) and the op raises
once its forward's kernels are queued, before it returns anything.
"""

from __future__ import annotations

import torch

from . import comm, kernels
from .options import Options
from .validate import InvalidInputError

__all__ = ["DeferredTargetCheck", "deferred_check"]


class DeferredTargetCheck:
    """The target range check of a world-1 call, without a host sync at the front door.

    A host read of the ``[min, max]`` valid id (:func:`_target_span`) right away would wait for
    every kernel queued before the loss -- in a training step, the model's whole forward -- and
    leave the GPU idle while the host then launches the loss. Instead the span's kernel, queued
    behind those kernels, writes it into pinned host memory (on CUDA; the torch version copies it
    there, non-blocking) and :meth:`settle` waits for that alone, once the op's forward has queued
    its own kernels. Until then the kernels see ids clamped into the shard
    (:func:`vparallel_ce.stats.local_targets`), so a bad id reads nothing out of bounds, and the
    error still comes before the op returns a value.

    When a backward will follow, the forward does not wait at all (:meth:`poison`): its outputs
    become NaN on the device if an id is bad, so no plausible number ever comes out, and the op's
    backward settles the check once its own kernels are queued. :attr:`count`, the valid ids'
    count that the same launch makes (fp32, NaN if an id is bad), is the mean's divisor: a mean
    divided by it is NaN already, with no masking pass. A host wait in the forward would
    otherwise leave the GPU idle while the host launches the backward -- with a small microbatch
    behind a model's forward, a third of the loss' time.

    The launch and its copy happen at the check's first use (:attr:`count`, :attr:`bad`,
    :meth:`settle`), which the linear ops make after their first GEMM is queued: from an idle GPU,
    host time before that GEMM is time the GPU waits. The pinned pair and its event are reused
    from call to call (one per device, taken out of the pool while a check is pending and put back
    once it is settled), allocating them being host time too. A check abandoned unsettled (its
    forward raised) keeps its pair, so a copy still in flight never lands in a later call's buffer.

    A tensor ``num_valid_tokens`` (``num_valid``) is checked the same way: copied into the pinned
    memory's last slot behind the span, a negative one making :attr:`bad` true and :meth:`settle`
    raise -- as the exchange refuses it on a group (no host read at the front door either way).
    """

    _pool: dict = {}  # device -> (pinned int64 [4]: lo, hi, the kernel's third fact, num_valid), free pairs

    def __init__(self, target: torch.Tensor, ignore_index: int, vocab_size: int,
                 num_valid: torch.Tensor | None = None, *, of_logits: bool = False):
        self.vocab_size, self.of_logits = vocab_size, of_logits
        self._num_valid = num_valid
        self.on_device = target.is_cuda
        self.event = self.key = self.span = None
        self.settled = False
        self._target, self._ignore_index = target, ignore_index
        self._found = None  # (bad, count) once launched

    @property
    def bad(self) -> torch.Tensor:
        """0-dim bool on the device: whether a valid id lies outside ``[0, V)``."""
        return self.launch()[0]

    @property
    def count(self) -> torch.Tensor:
        """0-dim fp32 on the device: the valid ids' count, NaN if one lies outside ``[0, V)``."""
        return self.launch()[1]

    def launch(self) -> tuple:
        """Launch the check's kernel, which writes the span into pinned host memory (or, for the
        torch version, its copy there), once: ``(bad, count)``."""
        if self._found is not None:
            return self._found
        target, self._target = self._target, None
        given = self._num_valid = None if self._num_valid is None else self._num_valid.reshape(()).to(torch.int64)
        if not target.is_cuda:
            self.span, bad, count = _target_span(target, self._ignore_index, self.vocab_size)
        else:
            self.key = target.device
            # dict.pop is atomic, so two threads never take the same pair
            self.span, self.event = self._pool.pop(self.key, None) or (
                torch.empty(4, dtype=torch.int64, pin_memory=True), torch.cuda.Event())
            span, bad, count = _target_span(target, self._ignore_index, self.vocab_size, host=self.span)
            if span.is_cuda:  # the torch version: copied behind its kernels
                self.span[:2].copy_(span, non_blocking=True)
            if given is not None:
                self.span[3:].copy_(given.reshape(1), non_blocking=True)
            self.event.record()
        if given is not None:
            bad = bad | (given.to(bad.device, non_blocking=True) < 0)
        self._found = (bad, count)
        return self._found

    @property
    def waits_on_device(self) -> bool:
        """Whether :meth:`settle` has to wait for the device (a CUDA target, not yet settled)."""
        return self.on_device and not self.settled

    def poison(self, outputs: tuple, *, divided_by: torch.Tensor | None = None) -> tuple:
        """``outputs`` with every element NaN where a valid id lies outside ``[0, V)`` (decided on
        the device, no host wait); the values themselves otherwise, bit for bit. One output divided
        by :attr:`count` (``divided_by``) is NaN there already and comes back as it is."""
        if divided_by is not None and divided_by is self.count and len(outputs) == 1:
            return outputs
        return tuple(None if x is None else x.masked_fill(self.bad, float("nan")) for x in outputs)

    def settle(self) -> None:
        """Raise :class:`InvalidInputError` if a valid id lies outside ``[0, V)`` (once)."""
        if self.settled:
            return
        self.launch()
        self.settled = True
        if self.event is not None:
            self.event.synchronize()
        lo, hi = self.span[:2].tolist()
        given = None if self._num_valid is None else int(self.span[3] if self.event is not None else self._num_valid)
        if self.event is not None:  # the copy has landed and been read: the pair is free again
            self._pool[self.key] = (self.span, self.event)
        _check_targets([[lo, hi]], self.vocab_size, of_logits=self.of_logits)
        if given is not None and given < 0:  # (the exchange's message: vparallel_ce.agreement._check_count)
            raise InvalidInputError(f"num_valid_tokens must be >= 0, got {given}")

    def __del__(self):
        # a check whose backward never ran (the loss was dropped) gives its pair back once its copy
        # has landed; one still in flight is left to the allocator
        if not self.settled and self.event is not None and self.event.query():
            self._pool[self.key] = (self.span, self.event)


def deferred_check(target: torch.Tensor, options: Options, vocab_size: int, *,
                   of_logits: bool = False) -> DeferredTargetCheck | None:
    """The target range check a world-1 call leaves pending (None: ``check`` is off, or the target
    is fake -- torch.compile tracing the op's shapes -- whose ids the compiled op's own run checks,
    :mod:`vparallel_ce.compiled`). ``of_logits``: the classes are the last dim of logits (not an
    lm_head's rows), for the error's hints."""
    if options.check is not True or kernels.is_fake(target):
        return None
    count = options.num_valid_tokens
    return DeferredTargetCheck(target, options.ignore_index, vocab_size,
                               count if isinstance(count, torch.Tensor) else None, of_logits=of_logits)


def _torch_span(t: torch.Tensor, ignore_index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The torch version of the span of a 1-D target: ``lo, hi`` (0-dim int64) as in
    :func:`_target_facts`, and the mask of its ignored ids."""
    t = t.to(torch.int64)
    ignored = t == ignore_index
    if t.numel() == 0:
        zero = torch.zeros((), dtype=torch.int64, device=t.device)
        return zero, zero, ignored
    lo, hi = torch.aminmax(t.masked_fill(ignored, 0))  # ignored ids count as 0, which is in range
    return lo, hi, ignored


def _target_span(target: torch.Tensor, ignore_index: int, vocab_size: int,
                 host: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[lo, hi]`` of :func:`_target_facts`, a 0-dim bool, whether a valid id lies outside
    ``[0, vocab_size)``, and the valid ids' count as a 0-dim fp32, NaN if so (on the target's
    device; one launch on a GPU, which writes the span into ``host``, a pinned int64 ``[3]``, where
    given: then the returned span is ``host[:2]``)."""
    t = target.reshape(-1)
    found = kernels.target_facts(t, ignore_index, vocab_size, out=host) if t.numel() else None
    if found is not None:
        facts, bad, count = found
        return facts[:2], bad, count
    lo, hi, ignored = _torch_span(t, ignore_index)  # (no checksum: at world 1 nothing compares it)
    bad = (lo < 0) | (hi >= vocab_size)
    count = (~ignored).sum().to(torch.float32).masked_fill(bad, float("nan"))
    return torch.stack([lo, hi]), bad, count


def _check_targets(spans: list[list[int]], vocab_size: int, *, of_logits: bool = False) -> None:
    """Every rank's ``[min, max]`` valid id against ``[0, V)``: every rank holds every span, so
    every rank raises the same error (with :func:`_target_hints`)."""
    for r, (lo, hi) in enumerate(spans):
        if lo < 0 or hi >= vocab_size:
            where = f" on rank {r}" if len(spans) > 1 else ""
            raise InvalidInputError(
                f"target holds id(s) outside [0, {vocab_size}) that are not ignore_index (e.g. {lo if lo < 0 else hi}"
                f"{where}){_target_hints(vocab_size, hi, len(spans), of_logits)}; pass check=False to skip this check"
            )


def _target_hints(vocab_size: int, hi: int, world: int, of_logits: bool) -> str:
    """What most often puts ids beyond the inputs' classes: hidden states passed where logits go
    (their last dim, a hidden size, read as the vocab), and a vocab shard passed without its group
    (one rank's shard read as the whole vocab)."""
    if hi < vocab_size:
        return ""
    hints = []
    if of_logits:
        width = vocab_size if world == 1 else f"summed over the ranks: {vocab_size}"
        hints.append(f"the logits' last dim ({width}) is read as the vocab: if the input holds hidden states "
                     "[..., H] rather than logits, pass them with the lm_head weight to the linear op "
                     "(linear_cross_entropy(hidden, weight, target))")
    processes = comm.process_count()
    if world == 1 and processes > 1:
        hints.append(f"{processes} processes run but the call has no group: if the input is this rank's vocab "
                     "shard, did you forget group=?")
    return "".join(f". {h[0].upper()}{h[1:]}" for h in hints)