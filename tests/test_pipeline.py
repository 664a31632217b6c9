"""vparallel_ce.pipeline: pipelined loss and gradients == the full-batch global token mean.

Multi-rank tests run on CPU gloo ranks (tests/dist.py) with a tiny float64 model split into two
pipeline stages: embedding -> tanh(linear) | tanh(linear) -> lm_head [V, H], V=37 (uneven over TP).
Microbatches hold different numbers of ignored tokens (one microbatch is fully ignored without DP).
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from tests.dist import run_ranks
from vparallel_ce.pipeline import (
    MissingTokenCountError,
    PipelineLoss,
    count_valid_tokens,
    last_stage_rank,
    microbatches_in_flight,
    step_accepts_loss_kwargs,
    step_loss,
)

V, H, S, B = 37, 8, 6, 8  # vocab, hidden, sequence length, GLOBAL batch (sequences)
_TORCH = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])  # (major, minor)
N_MB = 4
IGNORED = [0, 1, 6, 6, 2, 0, 3, 5]  # leading ignored tokens per sequence (rows 2, 3 fully ignored)
TOL = 1e-10
DT = torch.float64


# ---------------------------------------------------------------------------------------------
# model, data, reference (every rank builds the same, deterministically)


def _params():
    g = torch.Generator().manual_seed(1234)

    def r(*shape, scale=0.5):
        return (torch.randn(*shape, generator=g, dtype=DT) * scale)

    return {"emb": r(V, H, scale=1.0), "w1": r(H, H), "b1": r(H, scale=0.1), "w2": r(H, H),
            "b2": r(H, scale=0.1), "lm": r(V, H)}


def _data():
    g = torch.Generator().manual_seed(99)
    ids = torch.randint(0, V, (B, S), generator=g)
    labels = torch.randint(0, V, (B, S), generator=g)
    for i, k in enumerate(IGNORED):
        labels[i, :k] = -100
    return ids, labels


def _reference():
    p = {k: v.clone().requires_grad_(True) for k, v in _params().items()}
    ids, labels = _data()
    h = torch.tanh(F.embedding(ids, p["emb"]) @ p["w1"].T + p["b1"])
    h = torch.tanh(h @ p["w2"].T + p["b2"])
    logits = h @ p["lm"].T
    loss = F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1), ignore_index=-100)
    loss.backward()
    return loss.detach(), {k: v.grad for k, v in p.items()}


class _CopyToTP(torch.autograd.Function):
    """Identity forward, all-reduce backward (Megatron's "f"): replicated h feeding a vocab shard."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous()
        if ctx.group is not None:
            dist.all_reduce(g, group=ctx.group)
        return g, None


class Stage0(nn.Module):
    def __init__(self, p):
        super().__init__()
        self.emb = nn.Parameter(p["emb"].clone())
        self.w1 = nn.Parameter(p["w1"].clone())
        self.b1 = nn.Parameter(p["b1"].clone())

    def forward(self, ids):
        return torch.tanh(F.embedding(ids, self.emb) @ self.w1.T + self.b1)


class Stage1(nn.Module):
    """Last stage; owns this TP rank's lm_head shard. kind "ce": outputs vocab-sharded logits;
    kind "linear": outputs hidden states (the loss applies the shard)."""

    def __init__(self, p, kind, tp_group, tp, tp_rank):
        super().__init__()
        self.kind, self.tp_group = kind, tp_group
        self.w2 = nn.Parameter(p["w2"].clone())
        self.b2 = nn.Parameter(p["b2"].clone())
        self.lm = nn.Parameter(torch.chunk(p["lm"], tp, 0)[tp_rank].clone())

    def forward(self, h):
        h = torch.tanh(h @ self.w2.T + self.b2)
        if self.kind == "linear":
            return h
        return _CopyToTP.apply(h, self.tp_group) @ self.lm.T


# ---------------------------------------------------------------------------------------------
# rank functions


def _groups(rank, pp, dp, tp):
    """pp x dp x tp mesh (tp fastest). Every rank creates every group in the same order."""
    coords = (rank // (dp * tp), (rank // tp) % dp, rank % tp)
    sizes = (pp, dp, tp)
    mine = [None, None, None]
    for d in range(3):
        if sizes[d] == 1:
            continue
        others = [range(s) for i, s in enumerate(sizes) if i != d]
        for rest in itertools.product(*others):
            ranks = []
            for k in range(sizes[d]):
                c = list(rest)
                c.insert(d, k)
                ranks.append((c[0] * dp + c[1]) * tp + c[2])
            g = dist.new_group(ranks)
            if rank in ranks:
                mine[d] = g
    return coords, mine


def _schedule_cls(name):
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

    return {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[name]


def _run_case(rank, coords, groups, sizes, kind, sched_name, via, steps=2):
    from torch.distributed.pipelining import PipelineStage

    pp_i, dp_i, tp_i = coords
    pp_g, dp_g, tp_g = groups
    pp, dp, tp = sizes
    p = _params()
    ids, labels = _data()
    per = B // dp
    ids, labels = ids[dp_i * per:(dp_i + 1) * per], labels[dp_i * per:(dp_i + 1) * per]
    mod = Stage0(p) if pp_i == 0 else Stage1(p, kind, tp_g, tp, tp_i)
    stage = PipelineStage(mod, pp_i, pp, torch.device("cpu"), group=pp_g)
    cls = _schedule_cls(sched_name)
    calls = []
    if kind == "ce":
        loss_fn = PipelineLoss.cross_entropy(group=tp_g, chunks=2)
    else:
        loss_fn = PipelineLoss.linear(lambda: mod.lm, group=tp_g,
                                      microbatches_in_flight=microbatches_in_flight(cls, N_MB))
    inner = loss_fn.fn

    def counting(output, target):  # test-side counter: the library's call itself keeps no state
        calls.append(1)
        return inner(output, target)

    loss_fn.fn = counting
    schedule = cls(stage, N_MB, loss_fn=loss_fn, scale_grads=False)
    ref_loss, ref_grads = _reference()
    errs = {}
    # single-stage instances: read from their public action table
    in_flight, holder = microbatches_in_flight(schedule), last_stage_rank(schedule)
    errs[f"{kind}/{sched_name}/{via}/in_flight={in_flight}"] = float(in_flight != (N_MB if sched_name == "gpipe" else 1))
    errs[f"{kind}/{sched_name}/{via}/holder={holder}"] = float(holder != pp - 1)
    for step in range(steps):
        mod.zero_grad(set_to_none=True)
        gvt = count_valid_tokens(labels, group=dp_g)
        losses = []
        args = (ids,) if pp_i == 0 else ()
        if via == "step":
            loss_fn.step(schedule, *args, target=labels, losses=losses, global_valid_tokens=gvt)
        elif via == "old":
            assert not step_accepts_loss_kwargs(_OldStep(schedule))
            loss_fn.step(_OldStep(schedule), *args, target=labels, losses=losses, global_valid_tokens=gvt)
        elif via == "loss_kwargs" and step_accepts_loss_kwargs(schedule):
            schedule.step(*args, target=labels, losses=losses, return_outputs=False,
                          loss_kwargs={"global_valid_tokens": gvt})
        else:  # the fallback for torches without loss_kwargs (which is what "loss_kwargs" runs there)
            with loss_fn.step_context(global_valid_tokens=gvt):
                schedule.step(*args, target=labels, losses=losses, return_outputs=False)
        assert loss_fn._context_tokens is None
        loss = step_loss(losses, pp_group=pp_g, dp_group=dp_g)
        src_loss = step_loss(losses, pp_group=pp_g, src=pp - 1, dp_group=dp_g)
        for prm in mod.parameters():
            if dp_g is not None:  # DDP-style SUM (not mean) over data-parallel ranks
                dist.all_reduce(prm.grad, group=dp_g)
        key = f"{kind}/{sched_name}/{via}/step{step}"
        errs[key + "/loss"] = abs(loss.item() - ref_loss.item())
        errs[key + "/loss_src"] = abs(src_loss.item() - ref_loss.item())
        if pp_i == 0:
            names = {"emb": mod.emb, "w1": mod.w1, "b1": mod.b1}
        else:
            names = {"w2": mod.w2, "b2": mod.b2}
        for n, prm in names.items():
            errs[f"{key}/{n}"] = (prm.grad - ref_grads[n]).abs().max().item()
        if pp_i == pp - 1:
            want = torch.chunk(ref_grads["lm"], tp, 0)[tp_i]
            errs[f"{key}/lm"] = (mod.lm.grad - want).abs().max().item()
            # the last stage ran the loss once per microbatch, plus (torch 2.13) once for shape
            # inference on step 0
            shape_inference = 1 if _TORCH >= (2, 13) else 0
            errs[f"{key}/calls"] = 0.0 if len(calls) == N_MB * (step + 1) + shape_inference else float(len(calls))
    return errs


def _pipeline_job(rank, world, pp, dp, tp, cases):
    coords, groups = _groups(rank, pp, dp, tp)
    errs = {}
    for kind, sched_name, via in cases:
        errs.update(_run_case(rank, coords, groups, (pp, dp, tp), kind, sched_name, via))
    return errs


def _check(results):
    bad = {}
    for rank, errs in enumerate(results):
        for k, e in errs.items():
            if not e <= TOL:
                bad[f"rank{rank}:{k}"] = e
    assert not bad, bad


CASES = [
    ("ce", "gpipe", "step"),
    ("linear", "gpipe", "loss_kwargs"),
    ("ce", "1f1b", "context"),
    ("linear", "1f1b", "old"),
]


class _OldStep:
    """A schedule whose step() lacks loss_kwargs and return_outputs (as in older torches)."""

    def __init__(self, schedule):
        self.inner, self.scale_grads = schedule, schedule.scale_grads

    def step(self, *args, target=None, losses=None, **kwargs):
        return self.inner.step(*args, target=target, losses=losses, return_outputs=False, **kwargs)


def test_pp2_gpipe_1f1b():
    _check(run_ranks(_pipeline_job, 2, 2, 1, 1, CASES))


def test_pp2_tp2():
    _check(run_ranks(_pipeline_job, 4, 2, 1, 2, CASES))


def test_pp2_dp2():
    _check(run_ranks(_pipeline_job, 4, 2, 2, 1, CASES))


# ---------------------------------------------------------------------------------------------
# single-process checks


def test_missing_count_raises():
    fn = PipelineLoss(lambda o, t: F.cross_entropy(o, t, reduction="sum"))
    logits, target = torch.randn(4, 5, dtype=DT), torch.tensor([0, 1, -100, 3])
    with pytest.raises(MissingTokenCountError, match="global_valid_tokens"):
        fn(logits, target)
    assert fn._context_tokens is None


def test_normalisation_and_context():
    fn = PipelineLoss.cross_entropy()
    logits = torch.randn(2, 3, 5, dtype=DT, requires_grad=True)
    target = torch.tensor([[0, 1, -100], [3, -100, -100]])
    n = count_valid_tokens([target[:1], target[1:]])
    assert n.dtype == torch.int64 and n.item() == 3
    want = F.cross_entropy(logits.reshape(-1, 5), target.reshape(-1), reduction="sum") / 7
    got = fn(logits, target, global_valid_tokens=torch.tensor(7))
    assert torch.allclose(got, want, rtol=0, atol=1e-12)
    with fn.step_context(global_valid_tokens=7):
        with fn.step_context(global_valid_tokens=3):
            assert torch.allclose(fn(logits, target), want * 7 / 3, atol=1e-12)
        assert torch.allclose(fn(logits, target), want, atol=1e-12)
    assert fn._context_tokens is None
    # all tokens ignored everywhere: loss 0 and zero gradient, not nan
    all_ignored = torch.full((2, 3), -100)
    z = fn(logits, all_ignored, global_valid_tokens=count_valid_tokens(all_ignored))
    z.backward()
    assert z.item() == 0.0 and torch.count_nonzero(logits.grad) == 0
    with pytest.raises(TypeError, match="reduction"):
        PipelineLoss.cross_entropy(reduction="mean")


def test_linear_policy_and_schedule_facts():
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    assert microbatches_in_flight(ScheduleGPipe, 8) == 8
    assert microbatches_in_flight(Schedule1F1B, 8) == 1
    assert microbatches_in_flight(ScheduleInterleaved1F1B, 8) == 8  # class: conservative bound
    fn = PipelineLoss.linear(torch.zeros(V, H, dtype=DT), microbatches_in_flight=8)
    assert fn.policy.microbatches_in_flight == 8
    assert last_stage_rank(ScheduleGPipe, 4) == 3
    from torch.distributed.pipelining import schedules

    if hasattr(schedules, "ScheduleZBVZeroBubble"):
        assert last_stage_rank(schedules.ScheduleZBVZeroBubble, 4) == 0

    class Fake:
        scale_grads = True

        def step(self, *a, **k):
            raise AssertionError("must not run")

    with pytest.raises(ValueError, match="scale_grads"):
        fn.step(Fake(), global_valid_tokens=1)
    assert isinstance(step_accepts_loss_kwargs(Fake()), bool)


def test_schedule_facts_follow_subclasses_of_the_public_classes():
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleZBVZeroBubble

    class MyGPipe(ScheduleGPipe):
        pass

    class My1F1B(Schedule1F1B):
        pass

    class MyZBV(ScheduleZBVZeroBubble):
        pass

    assert microbatches_in_flight(MyGPipe, 6) == 6
    assert microbatches_in_flight(My1F1B, 6) == 1
    assert last_stage_rank(MyZBV, 4) == 0 and last_stage_rank(MyGPipe, 4) == 3
    with pytest.raises(ValueError, match="pass pp_size for MyGPipe"):
        last_stage_rank(MyGPipe)
    with pytest.raises(ValueError, match="pass n_microbatches"):
        microbatches_in_flight(MyGPipe)


def test_a_schedule_without_a_table_or_a_microbatch_count_asks_for_the_count():
    class Bare:  # an instance of a schedule type this torch knows nothing about
        pipeline_order = None

    with pytest.raises(ValueError, match=r"microbatch count of Bare.*_n_microbatches.*pass n_microbatches="):
        microbatches_in_flight(Bare())
    assert microbatches_in_flight(Bare(), 5) == 5  # the safe bound
    fn = PipelineLoss.linear(torch.zeros(V, H, dtype=DT), microbatches_in_flight=3)
    assert fn.configure(Bare()).policy.microbatches_in_flight == 3  # kept as given


def test_linear_matches_full_logits_single_process():
    h = torch.randn(3, 4, H, dtype=DT, requires_grad=True)
    w = torch.randn(V, H, dtype=DT, requires_grad=True)
    t = torch.randint(0, V, (3, 4))
    t[0, :2] = -100
    fn = PipelineLoss.linear(lambda: w, microbatches_in_flight=4)
    got = fn(h, t, global_valid_tokens=20)
    want = F.cross_entropy((h @ w.T).reshape(-1, V), t.reshape(-1), reduction="sum") / 20
    gh, gw = torch.autograd.grad(got, (h, w))
    rh, rw = torch.autograd.grad(want, (h, w))
    assert (got - want).abs().item() < 1e-12
    assert (gh - rh).abs().max().item() < 1e-12 and (gw - rw).abs().max().item() < 1e-12


# ---------------------------------------------------------------------------------------------
# multi-stage schedules: 4 stages on 2 PP ranks (looped or V-shaped placement)


class _Part(nn.Module):
    """One of 4 stages: 0 embedding, 1 tanh(lin1), 2 lin2, 3 tanh (+ the lm_head shard)."""

    def __init__(self, p, k, kind, tp_group, tp, tp_rank):
        super().__init__()
        self.k, self.kind, self.tp_group = k, kind, tp_group
        if k == 0:
            self.emb = nn.Parameter(p["emb"].clone())
        elif k == 1:
            self.w1, self.b1 = nn.Parameter(p["w1"].clone()), nn.Parameter(p["b1"].clone())
        elif k == 2:
            self.w2, self.b2 = nn.Parameter(p["w2"].clone()), nn.Parameter(p["b2"].clone())
        else:
            self.lm = nn.Parameter(torch.chunk(p["lm"], tp, 0)[tp_rank].clone())

    def forward(self, x):
        if self.k == 0:
            return F.embedding(x, self.emb)
        if self.k == 1:
            return torch.tanh(x @ self.w1.T + self.b1)
        if self.k == 2:
            return x @ self.w2.T + self.b2
        h = torch.tanh(x)
        return h if self.kind == "linear" else _CopyToTP.apply(h, self.tp_group) @ self.lm.T


def _multi_job(rank, world, pp, tp, cases):
    from torch.distributed.pipelining import PipelineStage, schedules

    (pp_i, _, tp_i), (pp_g, _, tp_g) = _groups(rank, pp, 1, tp)
    p = _params()
    ids, labels = _data()
    ref_loss, ref_grads = _reference()
    errs = {}
    for kind, name in cases:
        cls = getattr(schedules, name)
        v_shape = name in ("ScheduleZBVZeroBubble", "ScheduleDualPipeV")
        mine = [pp_i, 2 * pp - 1 - pp_i] if v_shape else [pp_i, pp_i + pp]
        mods = {k: _Part(p, k, kind, tp_g, tp, tp_i) for k in mine}
        stages = [PipelineStage(mods[k], k, 2 * pp, torch.device("cpu"), group=pp_g) for k in mine]
        if kind == "ce":
            loss_fn = PipelineLoss.cross_entropy(group=tp_g)
        else:
            loss_fn = PipelineLoss.linear(lambda: mods[2 * pp - 1].lm, group=tp_g,
                                          microbatches_in_flight=microbatches_in_flight(cls, N_MB))
        schedule = cls(stages, N_MB, loss_fn=loss_fn, scale_grads=False)
        holder = last_stage_rank(schedule)
        in_flight = microbatches_in_flight(schedule)
        for step in range(2):
            for m in mods.values():
                m.zero_grad(set_to_none=True)
            losses = []
            loss_fn.step(schedule, *((ids,) if 0 in mods else ()), target=labels, losses=losses,
                         global_valid_tokens=count_valid_tokens(labels))
            key = f"{kind}/{name}/step{step}"
            errs[key + "/loss"] = abs(step_loss(losses, pp_group=pp_g).item() - ref_loss.item())
            errs[key + "/loss_src"] = abs(step_loss(losses, pp_group=pp_g, src=holder).item() - ref_loss.item())
            for m in mods.values():
                for n, prm in m.named_parameters():
                    want = torch.chunk(ref_grads["lm"], tp, 0)[tp_i] if n == "lm" else ref_grads[n]
                    errs[f"{key}/{n}"] = (prm.grad - want).abs().max().item()
        errs[f"{kind}/{name}/holder"] = float(holder != (0 if v_shape else pp - 1))
        # the loss state of the last stage: all microbatches at once only in the breadth-first schedule
        errs[f"{kind}/{name}/in_flight={in_flight}"] = float(in_flight != (N_MB if name == "ScheduleLoopedBFS" else 1))
    return errs


def _multi_names():
    from torch.distributed.pipelining import schedules

    names = ["ScheduleInterleaved1F1B", "ScheduleLoopedBFS", "ScheduleInterleavedZeroBubble",
             "ScheduleZBVZeroBubble", "ScheduleDualPipeV"]
    return [n for n in names if hasattr(schedules, n)]


# Before torch 2.13 the schedules that split the backward into input and weight passes cannot run
# these losses: the weight pass cannot go through a custom autograd.Function (pytorch#166577), and
# the V-shaped ones fail to connect their gloo pairs. docs/pipeline.md says so.
_SPLIT_BACKWARD = ("ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble", "ScheduleDualPipeV")


def test_multi_stage_schedules():
    names = [n for n in _multi_names() if _TORCH >= (2, 13) or n not in _SPLIT_BACKWARD]
    cases = [(kind, n) for n in names for kind in ("ce", "linear")]
    _check(run_ranks(_multi_job, 2, 2, 1, cases))


def _sequence_parallel_job(rank, world):
    """PipelineLoss.linear with sequence_parallel: the stage output is this rank's sequence shard
    [B, S/tp, H] (uneven: S=7 over 2 ranks), the schedule hands the FULL target [B, S]."""
    g = torch.Generator().manual_seed(21)
    hidden = torch.randn(2, 7, 5, generator=g, dtype=torch.float64)
    weight = torch.randn(11, 5, generator=g, dtype=torch.float64)
    target = torch.randint(0, 11, (2, 7), generator=g)
    target[0, :3] = -100
    n_valid = int((target != -100).sum())
    h_ref, w_ref = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ref = F.cross_entropy((h_ref @ w_ref.T).flatten(0, 1), target.flatten(), reduction="sum") / n_valid
    ref.backward()
    h = torch.chunk(hidden, world, dim=1)[rank].clone().requires_grad_()
    w = torch.chunk(weight, world, dim=0)[rank].clone().requires_grad_()
    loss_fn = PipelineLoss.linear(w, group=dist.group.WORLD, sequence_parallel=True, sequence_dim=1)
    loss = loss_fn(h, target, global_valid_tokens=torch.tensor(n_valid))
    loss.backward()
    dh_expect = torch.chunk(h_ref.grad, world, dim=1)[rank]
    dw_expect = torch.chunk(w_ref.grad, world, dim=0)[rank]
    return max(abs(loss.item() - ref.item()), (h.grad - dh_expect).abs().max().item(),
               (w.grad - dw_expect).abs().max().item())


def test_linear_loss_with_sequence_parallel_slices_the_full_target():
    assert max(run_ranks(_sequence_parallel_job, 2)) < 1e-12
