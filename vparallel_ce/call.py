"""The front door: every entry point turns its arguments into one frozen :class:`Call`.

``cross_entropy``, ``linear_cross_entropy`` -- and through them the registry's modules, the
Megatron drop-in and the pipeline adapter -- go through the same steps, once per call, here:

1. unwrap DTensor inputs to their local shards, taking the group (and the global vocab size) from
   the mesh (:mod:`vparallel_ce.dtensor`);
2. resolve the group (ProcessGroup, 1-D DeviceMesh or None);
3. validate the options and tensors locally (:mod:`vparallel_ce.validate`), and read the
   enclosing ``torch.autocast`` state (:mod:`vparallel_ce.autocast`);
4. one metadata exchange over the group (:func:`vparallel_ce.agreement.agree`): a bad input on any
   rank raises on every rank, the ranks agree on tokens and options, the shard sizes give the
   :class:`~vparallel_ce.layout.VocabLayout` (at world 1 the target range check is deferred to
   the op's forward, :meth:`Call.settle_forward`);
5. the plan (:meth:`vparallel_ce.policy.ChunkPolicy.plan`) from the call's own knobs.

The autograd Functions then read everything from the ``Call``; nothing after this module looks at
user arguments again. The distillation ops' front doors, which check a teacher beside the student's
inputs and then run these, are :mod:`vparallel_ce.distillation_call`'s.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from . import comm, invariant, kernels, policy as _policy
from .agreement import Facts, agree
from .compaction import Compaction, compacted_rows, valid_count
from .replication import hidden_checksum, replication_checked, shard_checksum
from .autocast import autocast_dtype
from .dtensor import _unwrap_linear, _unwrap_logits  # step 1 of the front doors, private to them
from .layout import VocabLayout
from .policy import DistillShape, Plan
from .stats import LossSpec
from .options import Options
from .target_check import DeferredTargetCheck, deferred_check
from .validate import check_call_options, check_linear, check_logits
from .verdicts import VERDICTS

__all__ = ["Call", "LogitsInputs", "LinearInputs", "logits_call", "linear_call", "settles_check"]


@dataclass(frozen=True)
class Call:
    """Everything an op needs besides the tensors; identical in meaning on every rank.

    Attributes:
        layout: this rank's vocab shard in the group.
        spec: the loss' math options and the global vocab size.
        reduction: ``"mean"``, ``"sum"`` or ``"none"``.
        plan: schedule, chunk count, gradients in forward or not.
        check: the out-of-range target check is on.
        sequence_parallel: hidden/target are this rank's token shard (linear op, sharded group only).
        counts: the token count of every rank (sequence parallel) or of this rank.
        matmul_dtype: the dtype of the lm_head matmuls (the autocast dtype inside ``torch.autocast``,
            else the inputs' own); statistics and gradient sums are fp32 whatever it is.
        logits_dtype: the dtype the lm_head GEMM writes the logits in where it is wider than
            ``matmul_dtype`` (``torch.float32`` for bf16/fp16 matmuls with ``logits_dtype=torch.float32``:
            the GEMM's fp32 accumulator, not rounded); None: the logits are in ``matmul_dtype``.
        divisor: ``num_valid_tokens`` as a 0-dim float64 tensor on the inputs' device (the mean's
            divisor), or None: the call counts its valid tokens itself.
        kernels: the kernel settings in force at the call (:func:`vparallel_ce.kernels.settings`),
            kept so that its backward, which autograd may run on another thread, uses the same.
        pending: the world-1 target check, settled by the op's forward once its kernels are queued,
            or by its backward (:meth:`settle_forward`); None on a group, where the exchange
            checked the targets.
        batch_invariant: every sum in an order independent of the call's other tokens
            (:mod:`vparallel_ce.invariant`): fixed-config kernels (or fixed-shape tiles), rank-ordered SUMs.
        replan: the linear ops' plan of the same call over another token count (the rows kept by
            ignored-token compaction, :meth:`with_rows`); None for the logits ops and in the
            batch-invariant mode, which are never compacted.
    """

    layout: VocabLayout
    spec: LossSpec
    reduction: str
    plan: Plan
    check: bool
    sequence_parallel: bool = False
    counts: tuple[int, ...] = ()
    matmul_dtype: torch.dtype | None = None
    logits_dtype: torch.dtype | None = None
    kernels: kernels.KernelSettings = field(default_factory=kernels.settings)
    divisor: torch.Tensor | None = None
    pending: DeferredTargetCheck | None = field(default=None, compare=False, repr=False)
    batch_invariant: bool = False
    replan: Callable[[int], Plan] | None = field(default=None, compare=False, repr=False)

    def ops(self, x: torch.Tensor) -> kernels.KernelBackend:
        """The per-chunk steps for tensors like ``x`` under the call's settings:
        :func:`vparallel_ce.invariant.ops_for` in the batch-invariant mode, else
        :func:`vparallel_ce.kernels.ops_for`."""
        return invariant.ops_for(x, self.kernels) if self.batch_invariant else kernels.ops_for(x, self.kernels)

    @property
    def tile(self) -> int:
        """Token chunks are whole tiles of this many rows (1: any rows)."""
        return invariant.TILE_ROWS if self.batch_invariant else 1

    def again(self, options: Options, target: torch.Tensor) -> "Call":
        """This world-1 call's verdict for another call of the same metadata
        (:mod:`vparallel_ce.verdicts`), with that call's own per-call parts: the divisor of its
        ``num_valid_tokens`` and the check of its ``target``."""
        # a copy with two fields set (dataclasses.replace re-reads every field's definition and
        # runs __init__, copy.copy goes through __reduce_ex__: host time before the GEMM)
        call = object.__new__(type(self))
        call.__dict__.update(vars(self), divisor=_divisor(options, target.device),
                             pending=deferred_check(target, options, self.layout.vocab_size,
                                                    of_logits=self.matmul_dtype is None))
        return call

    def with_rows(self, counts: tuple[int, ...]) -> "Call":
        """This call over ``counts`` rows (every rank's with sequence parallelism): the rows that
        ignored-token compaction keeps, with the plan of their total."""
        return replace(self, counts=counts, plan=self.replan(sum(counts)))

    @property
    def verdict(self) -> "Call":
        """This call without its per-call parts (what :meth:`again` gives them back to)."""
        return replace(self, divisor=None, pending=None)

    def settle(self) -> None:
        """Raise the deferred target check's error, if any."""
        if self.pending is not None:
            self.pending.settle()

    def valid_count(self, target: torch.Tensor, valid: torch.Tensor | None = None, *,
                    of_target: bool = True) -> torch.Tensor:
        """The ``"mean"`` reduction's divisor (0-dim, on the target's device): ``num_valid_tokens``
        if given; else the valid tokens of ``target`` (``valid``: their mask, if made already),
        of the whole group with sequence parallelism. At world 1 with the target check pending
        it is the count the check's launch made (:attr:`DeferredTargetCheck.count`: NaN if an id
        is out of range, so the mean needs no masking pass; :meth:`settle_forward`'s
        ``divided_by``) -- unless ``of_target`` is False: the tokens that count are not the
        target's non-ignored ones (a distillation without a target counts every token)."""
        if self.divisor is not None:
            return self.divisor
        if of_target and self.pending is not None:
            return self.pending.count
        return self.count_valid(target, valid)

    def count_valid(self, target: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
        """The valid tokens of ``target`` (``valid``: their mask, if made already) as a 0-dim count,
        of the whole group with sequence parallelism -- whatever ``num_valid_tokens`` says: a
        backward scaling gradients made in forward needs to know whether ``dW`` holds any
        contribution at all (:func:`vparallel_ce.chunk_walk.scale_unit_grads`)."""
        n = (target != self.spec.ignore_index if valid is None else valid).sum()
        if self.sequence_parallel:  # the tokens of the whole group
            comm.all_reduce_sum_(n, self.layout.group)
        return n

    def loss_output(self, ctx, ops: kernels.KernelBackend, per_token: torch.Tensor,
                    n_valid: torch.Tensor | None) -> torch.Tensor:
        """A loss op's output: its ``per_token`` losses reduced as the call asks (``ops.reduce``;
        ``n_valid`` the mean's divisor, :meth:`valid_count`), then :meth:`settle_forward`."""
        return self.settle_forward(ctx, ops.reduce(per_token, n_valid, self.reduction), divided_by=n_valid)

    def settle_forward(self, ctx, *outputs, divided_by: torch.Tensor | None = None):
        """Every op's forward ends here, its kernels queued: the deferred target check raises now,
        or -- where settling would wait for the device and a backward will follow -- the outputs
        come back NaN if an id is bad (:meth:`DeferredTargetCheck.poison`; a mean ``divided_by``
        the check's own count is so already) and the backward settles it (:func:`settles_check`).
        Returns ``outputs`` (one tensor for one)."""
        p = self.pending
        if p is not None and p.waits_on_device and any(ctx.needs_input_grad) \
                and not getattr(ctx, "checks_in_forward", False):
            mean = divided_by if self.reduction == "mean" else None  # only a mean was divided by it
            outputs, ctx.pending = p.poison(outputs, divided_by=mean), p
        else:
            self.settle()
        return outputs[0] if len(outputs) == 1 else outputs

    @property
    def all_owned(self) -> bool:
        """One shard holds the whole vocab and the targets were range-checked at the front door:
        every valid target is owned by this rank."""
        return self.check and not self.layout.sharded


@dataclass(frozen=True)
class LogitsInputs:
    x: torch.Tensor  # [N, V_local]
    target: torch.Tensor  # [N]
    shape: torch.Size  # target's shape, for reduction="none"


@dataclass(frozen=True)
class LinearInputs:
    h: torch.Tensor  # [N, H] (compacted: [m, H])
    w: torch.Tensor  # [V_local, H]
    b: torch.Tensor | None  # [V_local]
    target: torch.Tensor  # [N] (compacted: [m])
    shape: torch.Size  # the caller's token shape
    compaction: Compaction | None = None  # the rows h and target are of (None: all, in order)

    def compacted(self, rows: Compaction) -> "LinearInputs":
        """These inputs over ``rows`` only (``h`` and ``target`` taken; ``place`` puts them back)."""
        return replace(self, h=rows.take(self.h), target=rows.take(self.target), compaction=rows)

    def take(self, x: torch.Tensor | None) -> torch.Tensor | None:
        """More per-token rows ``[N, ...]`` (a teacher's) as ``h`` and ``target`` hold them."""
        return x if self.compaction is None else self.compaction.take(x)

    def place(self, y: torch.Tensor) -> torch.Tensor:
        """A per-token output of the op's rows in the caller's order (``[N]``, 0 on rows not run)."""
        return y if self.compaction is None else self.compaction.place(y)


def logits_call(logits, target, *, op: str, group, options: Options, more_checks=None,
                target_given: bool = True, teacher=None, distillation: DistillShape | None = None,
                memo: tuple | None = (), support: torch.Tensor | None = None) -> tuple[Call, LogitsInputs]:
    """The front door of ops over vocab-sharded logits ``[..., V_local]``. ``op``: the op's name
    (:data:`~vparallel_ce.agreement.OPS`); ``options``: what the op was given; ``more_checks``: the
    op's own checks of its other inputs, given the local logits (a Problem or None);
    ``target_given``: False where ``target`` is a stand-in (:func:`distillation_call`);
    ``teacher``: the distillation's teacher (its logits or a
    :class:`~vparallel_ce.topk.TopKTeacher`), whose facts the ranks agree on; ``distillation``: the
    distillation memory model's shape for the plan (None: the CE's); ``memo``: at world 1, what
    ``more_checks`` reads as metadata (:func:`~vparallel_ce.verdicts.tensor_metadata`), with which
    the call's verdict is remembered for the next call of the same metadata
    (:mod:`vparallel_ce.verdicts`); None: nothing is remembered. ``support``: the log-prob ops'
    sampling set (:mod:`vparallel_ce.sampling_set`), whose ids the ranks agree on (checked by
    ``more_checks``; give ``memo=None`` with it)."""
    o = options
    key = None if group is not None or memo is None else VERDICTS.key(
        op, o, (logits, target), (memo, target_given, distillation))
    known = VERDICTS.get(key)
    if known is not None:
        n = target.numel()
        return known.again(o, target), LogitsInputs(_rows(logits, n, logits.shape[-1]), _flat(target), target.shape)
    logits, target, group, vocab_size = _unwrap_logits(logits, target, group, o.vocab_size)
    group = comm.resolve_group(group)
    problem = check_call_options(o) or check_logits(logits, target) or (more_checks and more_checks(logits))

    def facts(target_checksum):  # made only for a group's exchange
        return Facts.of(op=op, options=o, inputs=(logits,), target=target, target_checksum=target_checksum,
                        target_given=target_given, teacher=teacher, support=support)

    agreed = agree(problem, group, local_size=lambda: logits.shape[-1], facts=facts, device=_device(logits),
                   options=o, vocab_size=vocab_size, target=target, shard=lambda: shard_checksum(logits),
                   shard_name="student_logits" if teacher is not None else "logits")
    lay, n = agreed.layout, target.numel()
    plan = (o.policy or _policy.DEFAULT_POLICY).plan(n, lay.vocab_size, lay.world, reduction=o.reduction,
                                                      chunks=o.chunks, distillation=distillation)
    call = Call(lay, _spec(lay, o), o.reduction, plan, o.check, counts=(n,), divisor=_divisor(o, logits.device),
                pending=agreed.pending, batch_invariant=o.batch_invariant)
    if key is not None:
        VERDICTS.remember(key, call.verdict)
    return call, LogitsInputs(_rows(logits, n, lay.local_size), _flat(target), target.shape)


def linear_call(hidden, weight, target, bias, *, op: str, group, options: Options, more_checks=None,
                target_given: bool = True, also_replicated=(), prefix: str = "", teacher=None,
                distillation: Callable[[torch.Tensor, int], DistillShape] | None = None,
                memo: tuple | None = (), support: torch.Tensor | None = None,
                compact: bool = False) -> tuple[Call, LinearInputs]:
    """The front door of ops over hidden states and this rank's lm_head shard ``[V_local, H]``
    (arguments as in :func:`logits_call`; ``more_checks`` is given the local hidden, weight and the
    enclosing autocast dtype). ``also_replicated``: more local ``[..., H']`` tensors that must be
    replicated like ``hidden`` (their checksums ride on the same fact); ``prefix``: before the
    argument names in messages; ``teacher``: a distillation's sparse teacher
    (:class:`~vparallel_ce.topk.TopKTeacher`), whose facts the ranks agree on; ``distillation``:
    the distillation memory model's shape for the plan, made from the checked local weight and the
    bytes per element of a logits' gradient the op can keep (the matmul dtype's; 0 with sequence
    parallelism or a bias) (None: the CE's plan); ``memo``: as in :func:`logits_call`, the
    metadata of ``also_replicated`` and ``teacher`` too; ``support``: as in :func:`logits_call`.
    ``compact``: the inputs may be compacted
    to the rows whose target counts (:mod:`vparallel_ce.compaction`, as the policy decides; the
    eager ops ask for it, the compiled ones do not): then ``LinearInputs.h`` and ``target`` hold
    those rows, the ``Call`` is planned for them, and the op passes its per-token outputs through
    ``LinearInputs.place``."""
    o = options
    key = None
    if group is None and memo is not None and isinstance(weight, torch.Tensor):
        key = VERDICTS.key(op, o, (hidden, weight, target, bias),
                           (memo, autocast_dtype(weight.device), target_given, prefix))
    known = VERDICTS.get(key)
    if known is not None:
        n = target.numel()
        inputs = LinearInputs(_rows(hidden, n, weight.shape[-1]), weight, bias, _flat(target), target.shape)
        call = known.again(o, target)
        return _compacted(call, inputs, None, o) if compact and target_given and call.replan is not None \
            else (call, inputs)
    hidden, weight, target, bias, group, dt_vocab = _unwrap_linear(hidden, weight, target, bias, group,
                                                                   o.sequence_parallel)
    vocab_size = o.vocab_size if dt_vocab is None else dt_vocab
    group = comm.resolve_group(group)
    amp = autocast_dtype(weight.device) if isinstance(weight, torch.Tensor) else None
    problem = (check_call_options(o) or check_linear(hidden, weight, target, bias, autocast_dtype=amp, prefix=prefix)
               or (more_checks and more_checks(hidden, weight, amp)))
    sp = o.sequence_parallel is True
    matmul = _matmul_dtype(weight, amp) if problem is None else None
    chosen = kernels.settings()
    if problem is None and _logits_dtype(o.logits_dtype, matmul) is not None:
        # fp32 logits come from cuBLAS in two halves of H (gemm._mm_wide): the fused kernels sum
        # all of H in one tensor-core accumulator, which truncates (2.7e-6 log-prob error vs 1.3e-6)
        chosen = replace(chosen, fused=False)
    # (batch invariant: never the fused kernels, invariant.plan says why)
    fused = problem is None and not o.batch_invariant and kernels.fused_applies(
        weight.device, matmul, entropy=o.with_entropy, temperature=float(o.temperature), current=chosen)

    def facts(target_checksum):  # made only for a group's exchange
        # replicated hidden states are checked to be so (with sequence parallelism each rank holds
        # its own tokens): a sum over [N, H] that rides on the exchange
        replicated = 0
        if o.check and o.check_replicated and not sp and replication_checked():
            # int64 sums wrap: the sum of the checksums is as exact a fact as each
            replicated = sum((hidden_checksum(x) for x in also_replicated), hidden_checksum(hidden))
        return Facts.of(op=op, options=o, inputs=(hidden, weight, bias), target=target, target_checksum=target_checksum,
                        hidden_checksum=replicated, fused=fused, matmul_dtype=matmul, target_given=target_given,
                        teacher=teacher, support=support)

    agreed = agree(problem, group, local_size=lambda: weight.shape[0], facts=facts, device=_device(weight),
                   options=o, vocab_size=vocab_size, target=target, shard=lambda: shard_checksum(weight),
                   shard_name=f"{prefix}weight")
    lay, pending, n = agreed.layout, agreed.pending, target.numel()
    logits = _logits_dtype(o.logits_dtype, matmul)
    sp = sp and lay.sharded
    valid = agreed.valid_counts
    if not sp:
        counts = (n,)
    elif agreed.counts is not None:  # the exchange carried every rank's token count
        counts = agreed.counts
    else:  # check=False with a known vocab size: no exchange so far (the valid counts ride along)
        rows = comm.all_gather_ints([n, (_flat(target) != o.ignore_index).sum()], lay.group, weight.device)
        counts, valid = tuple(row[0] for row in rows), tuple(row[1] for row in rows)
    policy = o.policy or _policy.DEFAULT_POLICY
    replan = None
    if o.batch_invariant:
        plan = invariant.plan(policy, sum(counts), lay.vocab_size, lay.world, hidden_size=weight.shape[-1],
                              reduction=o.reduction, chunks=o.chunks, logits_dtype=logits)
    else:
        # the plan of any token count (ignored-token compaction plans the rows it keeps): only
        # values, no tensor, so a remembered verdict keeps nothing alive
        replan = functools.partial(
            policy.plan, vocab_size=lay.vocab_size, tp_degree=lay.world, hidden_size=weight.shape[-1],
            reduction=o.reduction, chunks=o.chunks, schedule=o.schedule, recompute=o.recompute, fused=fused,
            logits_dtype=logits, distillation=None if distillation is None else distillation(
                weight, 0 if sp or bias is not None else matmul.itemsize), heads=max(o.mtp_heads, 1))
        plan = replan(sum(counts))
        if distillation is None:  # (the distillation plans' chunks are bounded by the budget at any count)
            replan = functools.partial(_no_larger, replan, plan, sum(counts), lay.vocab_size, lay.world,
                                       hidden_size=weight.shape[-1], dtype=matmul, grad_dtype=weight.dtype,
                                       logits_dtype=logits)
    call = Call(lay, _spec(lay, o), o.reduction, plan, o.check, sp, counts, matmul, logits, chosen,
                _divisor(o, weight.device), pending, o.batch_invariant, replan)
    if key is not None:
        VERDICTS.remember(key, call.verdict)
    inputs = LinearInputs(_rows(hidden, n, weight.shape[-1]), weight, bias, _flat(target), target.shape)
    if compact and replan is not None and target_given:
        return _compacted(call, inputs, valid if sp or valid is None else valid[:1], o)
    return call, inputs


def _no_larger(replan, uncompacted: Plan, all_tokens: int, vocab_size: int, tp_degree: int, num_tokens: int,
               **model) -> Plan:
    """The plan of ``num_tokens`` kept rows, no larger in peak than the ``uncompacted`` one
    (:meth:`~vparallel_ce.policy.ChunkPolicy.compacted_plan`)."""
    return _policy.ChunkPolicy.compacted_plan(replan(num_tokens), num_tokens, uncompacted, all_tokens, vocab_size,
                                              tp_degree, **model)


def _compacted(call: Call, inp: LinearInputs, valid: tuple[int, ...] | None, o: Options
               ) -> tuple[Call, LinearInputs]:
    """The call and its inputs over the rows whose target counts, where the policy compacts
    (:mod:`vparallel_ce.compaction`); as they are otherwise. ``valid``: the valid-target count of
    every rank (sequence parallel) or of this rank's replicated target, where the host knows it
    (None: read here if the policy accepts that host sync)."""
    policy = o.policy or _policy.DEFAULT_POLICY
    if valid is None:  # (a small world-1 call leaves here: host time before its first GEMM)
        if not policy.reads_valid_count(call.counts[0], inp.w.shape[-1], call.layout.local_size) \
                or kernels.is_fake(inp.target):
            return call, inp
        valid = (valid_count(inp.target, o.ignore_index),)  # a replicated target: the same on every rank
    kept = policy.kept_rows(call.counts, valid)
    if kept is None:
        return call, inp
    me = call.layout.rank if call.sequence_parallel else 0
    total = call.counts[me]
    rows = Compaction(None if kept[me] == total else compacted_rows(inp.target, o.ignore_index, kept[me]), total)
    return call.with_rows(kept), inp.compacted(rows)


def settles_check(backward):
    """Wraps an op's ``backward``: the target check its forward left pending
    (:meth:`Call.settle_forward`) raises once the backward's kernels are queued."""

    @functools.wraps(backward)
    def run(ctx, *grad_outputs):
        grads = backward(ctx, *grad_outputs)
        pending = getattr(ctx, "pending", None)
        if pending is not None:
            pending.settle()
        return grads

    return run


def _divisor(o: Options, device: torch.device) -> torch.Tensor | None:
    """``num_valid_tokens`` as a 0-dim float64 tensor on ``device`` (exact up to 2^53 tokens): made
    by a fill kernel from an int, from a tensor without a host read -- so a negative tensor count,
    which only a group's exchange can refuse, becomes nan here (a nan loss and gradients, never a
    plausible number)."""
    count = o.num_valid_tokens
    if count is None:
        return None
    if isinstance(count, torch.Tensor):
        n = count.reshape(()).to(device, torch.float64, non_blocking=True)
        return torch.where(n >= 0, n, float("nan"))
    return torch.full((), count, dtype=torch.float64, device=device)


def _rows(x: torch.Tensor, n: int, width: int) -> torch.Tensor:
    """``x.reshape(n, width)``, without the dispatch when it is that shape already (the common
    ``[N, H]`` input: the front door runs before every call's first kernel)."""
    return x if x.dim() == 2 and x.shape[0] == n else x.reshape(n, width)


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t if t.dim() == 1 else t.reshape(-1)


def _matmul_dtype(weight: torch.Tensor, amp: torch.dtype | None) -> torch.dtype:
    return amp if amp is not None and weight.dtype != torch.float64 else weight.dtype


def _logits_dtype(asked: torch.dtype | None, matmul: torch.dtype) -> torch.dtype | None:
    """The logits' dtype where it differs from the matmul dtype: fp32 for bf16/fp16 matmuls when
    asked; fp32 and fp64 matmuls already make logits of at least fp32 precision (None)."""
    return asked if asked is not None and matmul.itemsize < asked.itemsize else None


def _spec(lay: VocabLayout, o: Options) -> LossSpec:
    return LossSpec(lay.vocab_size, o.ignore_index, float(o.label_smoothing), float(o.z_loss),
                    None if o.softcap is None else float(o.softcap), float(o.temperature), o.with_entropy)


def _device(t) -> torch.device:
    return t.device if isinstance(t, torch.Tensor) else torch.device("cpu")
