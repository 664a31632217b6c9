r"""Exact loss normalisation under ``torch.distributed.pipelining``.

With pipeline parallelism (PP) the schedule calls the loss on the last stage once per microbatch and
runs the backward of each microbatch's loss itself. For the step's loss *and gradients* to equal the
non-pipelined loss of the whole batch -- whatever the microbatch count, the schedule and the DP
degree -- every microbatch must contribute::

    loss_mb = (sum of the per-token losses of its valid tokens) / N

where ``N`` is the number of valid (non-``ignore_index``) tokens of the whole optimizer step: all
microbatches, all data-parallel ranks. Summing ``loss_mb`` over microbatches and DP ranks gives the
global token mean; the gradients are its gradients, as long as nothing else rescales them:

* build the schedule with ``scale_grads=False`` (the default ``True`` divides every ``.grad`` by the
  microbatch count after the step, which also breaks gradient accumulation over several steps);
* turn DP gradient averaging off -- FSDP2: ``model.set_gradient_divide_factor(1.0)``; DDP: sum
  instead of mean (a comm hook, or multiply by the DP size) -- because ``N`` already counts every
  DP rank's tokens;
* never divide after ``schedule.step()``: the schedule has already run the backward by then, so
  that fixes the logged number but leaves the gradients ``N`` times too large;
* pass ``return_outputs=False`` to ``step()``, or the last stage keeps every microbatch's output
  (for an LM: all the logits) alive for merging.

A per-microbatch mean (``mean`` reduction, then dividing by the microbatch count) is only right when
every microbatch holds the same number of valid tokens; :class:`PipelineLoss` refuses to guess and
raises when it is not given ``N``.

Typical use (see ``docs/pipeline.md``)::

    loss_fn = PipelineLoss.linear(lambda: last_stage.lm_head.weight, group=tp_group,
                                  microbatches_in_flight=microbatches_in_flight(ScheduleGPipe, n_mb))
    schedule = ScheduleGPipe(stage, n_mb, loss_fn=loss_fn, scale_grads=False)
    ...
    gvt = count_valid_tokens(labels, group=dp_group)          # on device, no host sync
    losses = []
    loss_fn.step(schedule, *inputs, target=labels, losses=losses, global_valid_tokens=gvt)
    loss = step_loss(losses, pp_group=pp_group, dp_group=dp_group)   # same number on every rank
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable
from dataclasses import replace

import torch

from . import comm, policy as _policy
from .replication import replication_unchecked
from .dtensor import local as _local
from .cross_entropy import cross_entropy as _cross_entropy
from .layout import shard_of
from .linear import linear_cross_entropy as _linear_cross_entropy
from .pipeline_schedules import last_stage_rank, microbatches_in_flight

__all__ = [
    "PipelineLoss",
    "count_valid_tokens",
    "microbatches_in_flight",
    "last_stage_rank",
    "step_loss",
    "step_accepts_loss_kwargs",
    "sequence_shard",
    "MissingTokenCountError",
]


class MissingTokenCountError(ValueError):
    """The loss was called without the step's global valid-token count."""


# ---------------------------------------------------------------------------------------------
# The denominator


def count_valid_tokens(labels, *, ignore_index: int = -100, group=None) -> torch.Tensor:
    """Valid tokens of the optimizer step, summed over the data-parallel ``group``.

    Args:
        labels: this rank's labels of the WHOLE step batch (every microbatch, before the schedule
            splits it), a tensor or a sequence of tensors (pre-split microbatches, or several
            gradient-accumulation steps that share one optimizer step).
        ignore_index: the id that marks tokens without a loss.
        group: the ProcessGroup / 1-D DeviceMesh over which ranks hold DIFFERENT data (DP, and CP if
            the labels are already CP-sharded). Ranks that hold the same labels (TP, PP, and the
            ranks of one sequence-parallel group, which count the full microbatch) must not be in
            it. None: no reduction.

    Returns:
        A 0-dim int64 tensor on the labels' device (no host sync), identical on every rank of the
        group. Pass it to :class:`PipelineLoss` as ``global_valid_tokens``.
    """
    if isinstance(labels, torch.Tensor):
        labels = [labels]
    labels = list(labels)
    if not labels:
        raise ValueError("count_valid_tokens: labels is empty")
    for t in labels:
        if not isinstance(t, torch.Tensor) or t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            raise TypeError("count_valid_tokens: labels must be integer tensors, got "
                            f"{t.dtype if isinstance(t, torch.Tensor) else type(t).__name__}")
    n = torch.stack([_local(t).ne(ignore_index).sum() for t in labels]).sum().to(torch.int64)
    return comm.all_reduce_sum_(n, comm.resolve_group(group))


# ---------------------------------------------------------------------------------------------
# The loss adapter


def step_accepts_loss_kwargs(schedule) -> bool:
    """Whether ``schedule.step`` takes ``loss_kwargs=`` (forwarded to the loss; torch 2.13 has it,
    older torches may not)."""
    return "loss_kwargs" in _parameters(schedule.step)


def _parameters(fn) -> dict:
    try:
        return dict(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # pragma: no cover - exotic callables
        return {}


class PipelineLoss:
    """A pipeline-schedule ``loss_fn`` whose microbatch losses add up to the global token mean.

    ``PipelineLoss(fn)(output, target, global_valid_tokens=N)`` returns ``fn(output, target) / N``
    where ``fn`` returns the SUM of the per-token losses of one microbatch (0 for ignored tokens)
    and ``N`` is the valid-token count of the whole step over DP (:func:`count_valid_tokens`).
    ``N`` arrives through the schedule's ``loss_kwargs`` (``schedule.step(..., loss_kwargs=
    {"global_valid_tokens": N})``) or, for a torch whose ``step`` lacks ``loss_kwargs``, through
    ``with loss_fn.step_context(global_valid_tokens=N): schedule.step(...)``; :meth:`step` picks
    the one the installed torch supports. Without ``N`` the call raises
    :class:`MissingTokenCountError` -- never a silent per-microbatch mean.

    ``N == 0`` (every token of the step ignored) gives a loss of 0 and zero gradients (the count
    is clamped to 1 on device).

    Requirements on the schedule and the training loop (see the module docstring):
    ``scale_grads=False``; DP gradients summed, not averaged (FSDP2
    ``set_gradient_divide_factor(1.0)``); ``return_outputs=False``; and nothing divided after
    ``step()``.

    The call is free of side effects -- no counters, no RNG, no ``.grad`` writes -- so the extra
    call the schedule makes on the first ``step()`` for shape inference (on uninitialised stage
    outputs, real targets, then ``autograd.grad`` to the stage inputs only) is harmless: the loss
    value and the gradients it produces are discarded by the schedule.

    Args:
        fn: ``fn(output, target) -> 0-dim SUM loss`` of one microbatch.
        name: shown in error messages.
    """

    def __init__(self, fn: Callable[[object, torch.Tensor], torch.Tensor], *, name: str | None = None):
        if not callable(fn):
            raise TypeError(f"PipelineLoss: fn must be callable, got {type(fn).__name__}")
        self.fn = fn
        self.name = name or getattr(fn, "__name__", "loss")
        self._context_tokens = None

    # -- constructors -------------------------------------------------------------------------

    @classmethod
    def cross_entropy(cls, *, group=None, ignore_index: int = -100, **options) -> "PipelineLoss":
        """The last stage outputs vocab-sharded logits ``[..., V_local]`` (this TP rank's
        ``torch.chunk`` shard, or a ``Shard(-1)`` DTensor); the loss is
        :func:`vparallel_ce.cross_entropy` with ``reduction="sum"``.

        ``options``: any other keyword of :func:`vparallel_ce.cross_entropy` (``vocab_size``,
        ``label_smoothing``, ``z_loss``, ``softcap``, ``chunks``, ``check``). ``chunks="auto"``
        sizes the chunks from the microbatch's token count (the op only ever sees one microbatch).
        The logits themselves are the stage output, alive from the microbatch's forward to its
        backward under any schedule; chunking bounds only the fp32 working set.
        """
        _no_reduction(options)

        def fn(output, target):
            return _cross_entropy(output, target, group=group, ignore_index=ignore_index, reduction="sum", **options)

        return cls(fn, name="cross_entropy")

    @classmethod
    def linear(
        cls,
        weight,
        bias=None,
        *,
        group=None,
        sequence_parallel: bool = False,
        sequence_dim: int = 1,
        microbatches_in_flight: int = 1,
        policy: _policy.ChunkPolicy | None = None,
        ignore_index: int = -100,
        **options,
    ) -> "PipelineLoss":
        """The last stage outputs the hidden states after the final norm ``[..., H]`` and owns the
        lm_head shard ``weight`` ``[V_local, H]``; the loss is
        :func:`vparallel_ce.linear_cross_entropy` with ``reduction="sum"`` (no full logits).

        Args:
            weight, bias: the lm_head shard (and bias shard), or zero-argument callables returning
                them at call time (e.g. ``lambda: stage_mod.lm_head.weight``), which follows a
                parameter that is replaced after the loss is built. Must be a parameter of the last
                stage's module so the stage's optimizer and gradient reduction see its ``.grad``.
            group: the TP group the vocab is sharded over.
            sequence_parallel: the stage output is this rank's sequence shard of the hidden states
                (``torch.chunk`` over the TP group along ``sequence_dim``). The schedule hands the
                FULL microbatch target to the loss; when its shape does not match the local hidden,
                the loss takes this rank's ``torch.chunk`` slice along ``sequence_dim``.
            microbatches_in_flight: loss forwards alive at once on the last stage (see
                :func:`microbatches_in_flight`); drives ``ChunkPolicy.microbatches_in_flight``, so
                ``chunks="auto"`` recomputes the logits in backward under GPipe (where keeping each
                microbatch's ``dW`` from forward to backward would cost ``n_microbatches`` times).
            policy: a full :class:`vparallel_ce.policy.ChunkPolicy`; its ``microbatches_in_flight``
                is replaced by the argument above when that is not 1.
            options: any other keyword of :func:`vparallel_ce.linear_cross_entropy` (``vocab_size``,
                ``label_smoothing``, ``z_loss``, ``softcap``, ``chunks``, ``schedule``,
                ``recompute``, ``check``).

        The chunk decision uses the microbatch's token count (the op sees one microbatch per call).
        """
        _no_reduction(options)
        if int(microbatches_in_flight) < 1:
            raise ValueError(f"microbatches_in_flight must be >= 1, got {microbatches_in_flight}")
        pol = policy or _policy.DEFAULT_POLICY
        if policy is None or microbatches_in_flight != 1:
            pol = replace(pol, microbatches_in_flight=int(microbatches_in_flight))
        fn = _LinearStageLoss(weight, bias, pol, dict(group=group, sequence_parallel=sequence_parallel,
                                                      ignore_index=ignore_index, **options), sequence_dim)
        return cls(fn, name="linear_cross_entropy")

    @property
    def policy(self) -> _policy.ChunkPolicy | None:
        """The chunk policy of a :meth:`linear` loss (None for others)."""
        return getattr(self.fn, "policy", None)

    def configure(self, schedule) -> "PipelineLoss":
        """Adapt to a built schedule instance (called by :meth:`step`; call it yourself once if you
        call ``schedule.step`` directly): for :meth:`linear` losses, sets the policy's
        ``microbatches_in_flight`` to the schedule's exact count (:func:`microbatches_in_flight`).
        Zero-bubble schedules run the loss node's backward twice (input pass, then weight pass);
        the op serves both, whether its gradients were made in forward or are recomputed. Not
        called from inside the loss, so the loss call stays pure. A schedule whose count cannot be
        read (no action table, no microbatch count) keeps the count given to :meth:`linear`."""
        if isinstance(self.fn, _LinearStageLoss):
            try:
                self.fn.policy = replace(self.fn.policy, microbatches_in_flight=microbatches_in_flight(schedule))
            except ValueError:  # the count given to linear() stays: it only sizes the chunks
                pass
        return self

    # -- the call -----------------------------------------------------------------------------

    def __call__(self, output, target, global_valid_tokens=None, **kwargs):
        if kwargs:
            raise TypeError(f"PipelineLoss got unexpected loss_kwargs {sorted(kwargs)}; only global_valid_tokens")
        n = global_valid_tokens if global_valid_tokens is not None else self._context_tokens
        if n is None:
            raise MissingTokenCountError(
                f"PipelineLoss({self.name}): no global_valid_tokens. Pass it with "
                "schedule.step(..., loss_kwargs={'global_valid_tokens': n}), or inside "
                "`with loss_fn.step_context(global_valid_tokens=n):`, or use loss_fn.step(schedule, ...); "
                "n = count_valid_tokens(labels_of_the_whole_step, group=dp_group). A per-microbatch "
                "mean would be wrong whenever microbatches hold different numbers of valid tokens."
            )
        # the schedule's first step also calls the loss on uninitialised stage outputs (shape
        # inference), which differ over the TP ranks: hidden states are not checked for replication
        with replication_unchecked():
            total = self.fn(output, target)
        if not isinstance(total, torch.Tensor) or total.dim() != 0:
            raise ValueError(f"PipelineLoss({self.name}): fn must return a 0-dim SUM loss tensor")
        n = torch.as_tensor(n, device=total.device)
        if n.dim() != 0:
            raise ValueError(f"global_valid_tokens must be a scalar, got shape {tuple(n.shape)}")
        # clamp: an all-ignored step gives 0 (not nan); no host sync
        return total / n.detach().to(total.dtype).clamp(min=1)

    @contextlib.contextmanager
    def step_context(self, *, global_valid_tokens):
        """Make ``global_valid_tokens`` the count of every call inside the block (for a torch whose
        ``schedule.step`` has no ``loss_kwargs``). Nests; restores the previous value on exit.
        A count passed explicitly to the call wins."""
        if global_valid_tokens is None:
            raise MissingTokenCountError("step_context: global_valid_tokens is None")
        previous = self._context_tokens
        self._context_tokens = global_valid_tokens
        try:
            yield self
        finally:
            self._context_tokens = previous

    def step(self, schedule, *args, global_valid_tokens, target=None, losses=None, return_outputs: bool = False,
             **kwargs):
        """``schedule.step(*args, target=..., losses=..., **kwargs)`` with ``global_valid_tokens``
        delivered through ``loss_kwargs`` when this torch supports it, else through
        :meth:`step_context`. ``return_outputs`` defaults to False here. Raises if the schedule
        was built with ``scale_grads=True``."""
        if getattr(schedule, "scale_grads", False):
            raise ValueError(
                "the schedule was built with scale_grads=True, which divides the gradients by the microbatch "
                "count after the step; PipelineLoss already normalises by the global token count: build it with "
                "scale_grads=False"
            )
        self.configure(schedule)
        # the context as well: a torch whose shape-inference call does not forward loss_kwargs
        # still finds the count
        with self.step_context(global_valid_tokens=global_valid_tokens):
            if step_accepts_loss_kwargs(schedule):
                return schedule.step(*args, target=target, losses=losses, return_outputs=return_outputs,
                                     loss_kwargs={"global_valid_tokens": global_valid_tokens}, **kwargs)
            if "return_outputs" in _parameters(schedule.step):
                kwargs["return_outputs"] = return_outputs
            return schedule.step(*args, target=target, losses=losses, **kwargs)

    def __repr__(self):
        return f"PipelineLoss({self.name})"


def _no_reduction(options: dict) -> None:
    if "reduction" in options:
        raise TypeError("PipelineLoss sets reduction='sum' itself (and divides by the global token count)")


class _LinearStageLoss:
    """``fn(output, target)`` of :meth:`PipelineLoss.linear`: the SUM loss of one microbatch with
    the lm_head shard looked up at call time; ``policy`` follows the schedule (``configure``)."""

    def __init__(self, weight, bias, policy: _policy.ChunkPolicy, options: dict, sequence_dim: int):
        self.get_weight = weight if callable(weight) and not isinstance(weight, torch.Tensor) else (lambda: weight)
        self.get_bias = bias if callable(bias) and not isinstance(bias, torch.Tensor) else (lambda: bias)
        self.policy = policy
        self.options = options
        self.sequence_dim = sequence_dim

    def __call__(self, output, target):
        if self.options["sequence_parallel"]:
            target = sequence_shard(output, target, group=self.options["group"], dim=self.sequence_dim)
        return _linear_cross_entropy(output, self.get_weight(), target, self.get_bias(), reduction="sum",
                                     policy=self.policy, **self.options)


def sequence_shard(hidden, target, *, group, dim: int = 1):
    """The labels of this rank's sequence shard: with sequence parallelism the hidden states
    ``[B, S/tp, H]`` are this TP rank's ``torch.chunk`` of the sequence, and the labels ``[B, S]`` of
    the full sequence are cut the same way along ``dim``. Labels that already match the hidden
    states' token dims are returned as they are."""
    h, t = _local(hidden), _local(target)
    group = comm.resolve_group(group)
    if tuple(t.shape) == tuple(h.shape[:-1]) or not comm.is_sharded(group):
        return t
    return shard_of(t, comm.world_size(group), comm.rank(group), dim)


# ---------------------------------------------------------------------------------------------
# The number to log


def step_loss(losses, *, pp_group=None, src: int | None = None, dp_group=None, device=None) -> torch.Tensor:
    """The step's loss, the same 0-dim float64 tensor on every rank of ``pp_group`` (and
    ``dp_group``). No host sync.

    Args:
        losses: the list the schedule filled (``step(..., losses=losses)``) -- the normalised
            microbatch losses on the rank(s) holding the last stage, empty (or None) elsewhere.
        pp_group: the pipeline group (ProcessGroup / 1-D DeviceMesh); None: no PP exchange.
        src: PP-group rank holding the last stage (:func:`last_stage_rank`: the last rank for
            looped schedules, 0 for V-shaped ones): the sum is broadcast from it. None (default):
            every rank contributes its own sum (0 where it holds no loss) to one all-reduce, which
            needs no knowledge of the placement.
        dp_group: also sum over data-parallel ranks, giving the global token mean of the step
            (each DP rank's losses are its tokens' share of it). None: this DP rank's share.
        device: where to build the result on ranks with no losses; default: the losses' device,
            else the current CUDA device for an NCCL group, else CPU.
    """
    losses = [] if losses is None else list(losses)
    if device is None:
        if losses:
            device = losses[0].device
        else:
            device = _group_device(pp_group if pp_group is not None else dp_group)
    value = torch.zeros((), dtype=torch.float64, device=device)
    for loss in losses:
        value = value + loss.detach().to(device=device, dtype=torch.float64)
    pp = comm.resolve_group(pp_group)
    if src is None:
        comm.all_reduce_sum_(value, pp)
    else:
        comm.broadcast_(value, pp, int(src))
    return comm.all_reduce_sum_(value, comm.resolve_group(dp_group))


def _group_device(group) -> torch.device:
    if comm.backend(comm.resolve_group(group)) == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
