"""Ignored-token compaction (``vparallel_ce.compaction``): the linear ops run the lm_head over the rows
whose target counts, and give what they give uncompacted -- float64 references on the full logits
for the loss (every reduction, ``none`` and the log-probs in the caller's order) and the gradients of
hidden, weight and bias, an ignored token's loss and ``dh`` row exactly 0. At TP 1, 2 (uneven vocab
shards) and 4 (uneven, one empty), with sequence parallelism over uneven token shards (one empty), with
most, all and no tokens ignored; each case also checks that the call compacted exactly when
something was ignored."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

import vparallel_ce
from tests.dist import run_ranks
from tests.reference import TOL, reference_distillation, reference_loss, rel_err, shard
from vparallel_ce.policy import ChunkPolicy

N, H, H_T = 40, 4, 6
VOCAB = {1: 11, 2: 7, 4: 5}  # TP 2: shards 4, 3; TP 4: 2, 2, 1, 0
SPLITS = {1: (40,), 2: (14, 26), 4: (10, 0, 18, 12)}  # sequence parallelism's token shards
IGNORE = -100


@dataclass(frozen=True)
class Case:
    op: str  # "ce", "logprobs", "distill", "topk"
    pattern: str
    reduction: str = "mean"
    sp: bool = False
    chunks: int | str = 1
    schedule: str = "auto"
    bias: bool = False
    check: bool = True

    def __str__(self):
        return (f"{self.op}, {self.pattern}, {self.reduction}, sp={self.sp}, chunks={self.chunks}, "
                f"schedule={self.schedule}, bias={self.bias}, check={self.check}")


def cases(world: int) -> list[Case]:
    """Every op, reduction and plan with most tokens ignored, with and without sequence
    parallelism; a few of them with all and with none ignored (sequence parallelism taking turns)."""
    sp = world > 1
    out = []
    for s in (False, True) if sp else (False,):
        for i, reduction in enumerate(("mean", "sum", "none")):
            out.append(Case("ce", "most ignored", reduction, s, chunks=(1, 3, "auto")[i], bias=i == 1 and not s))
        out.append(Case("ce", "most ignored", "mean", s, chunks=2, schedule="vocab"))
        out.append(Case("logprobs", "most ignored", "none", s, chunks=1 if s else 3))
        out.append(Case("distill", "most ignored", "none", s, chunks=2))
        out.append(Case("distill", "most ignored", "mean", s, chunks=1))
    out.append(Case("topk", "most ignored", "none"))
    for pattern, turn in (("all ignored", False), ("none ignored", True)):
        out += [Case("ce", pattern, "mean", sp and turn, bias=True), Case("ce", pattern, "none", sp and not turn),
                Case("ce", pattern, "sum", sp and turn, chunks=3),
                Case("logprobs", pattern, "none", sp and not turn), Case("distill", pattern, "mean", sp and turn)]
    if sp:  # no exchange: the count read on each rank (replicated) or gathered with the token counts
        out += [Case("ce", "most ignored", "none", check=False), Case("ce", "most ignored", "mean", sp=True,
                                                                      check=False)]
    return out


def _data(world: int, pattern: str):
    g = torch.Generator().manual_seed(3)
    v = VOCAB[world]
    h = torch.randn(N, H, generator=g, dtype=torch.float64)
    w = torch.randn(v, H, generator=g, dtype=torch.float64)
    b = torch.randn(v, generator=g, dtype=torch.float64)
    ht = torch.randn(N, H_T, generator=g, dtype=torch.float64)
    wt = torch.randn(v, H_T, generator=g, dtype=torch.float64)
    t = torch.randint(0, v, (N,), generator=g)
    if pattern == "most ignored":
        t[torch.rand(N, generator=g) < 0.7] = IGNORE
    elif pattern == "all ignored":
        t[:] = IGNORE
    up = torch.linspace(0.5, 1.5, N, dtype=torch.float64)
    return h, w, b, ht, wt, t, up


def _spy(seen: list):
    """Record the counts each call's front door compacted to (None: not compacted)."""
    import vparallel_ce.call as front

    real = front._compacted

    def spy(*args):
        call, inp = real(*args)
        seen.append(None if inp.compaction is None else call.counts)
        return call, inp

    front._compacted = spy


def _close(got, want, what):
    """Within float64 tolerance, NaN exactly where the reference has it (a mean of no valid token)."""
    got, want = got.detach(), want.detach()
    assert torch.equal(got.isnan(), want.isnan()), f"{what}: NaN at other places\ngot {got}\nwant {want}"
    err = rel_err(got.nan_to_num(), want.nan_to_num())
    assert err <= TOL[torch.float64], f"{what}: relative error {err:.2e}\ngot {got}\nwant {want}"


def compaction_rank(rank: int, world: int) -> int:
    import torch.distributed as dist

    group = dist.group.WORLD if world > 1 else None
    seen: list = []
    _spy(seen)
    checked = 0
    for case in cases(world):
        h_f, w_f, b_f, ht_f, wt_f, t_f, up_f = _data(world, case.pattern)
        rows = torch.arange(N).split(SPLITS[world])[rank] if case.sp else torch.arange(N)
        v = VOCAB[world]
        h = h_f[rows].clone().requires_grad_()
        w = shard(w_f, world, rank, 0).clone().requires_grad_()
        b = shard(b_f, world, rank, 0).clone().requires_grad_() if case.bias else None
        t, up = t_f[rows], up_f[rows]
        # world 1: the default reads no count for a call this small (a host sync); True compacts it
        policy = ChunkPolicy(compact=True) if world == 1 or not case.check else None
        common = dict(group=group, sequence_parallel=case.sp, chunks=case.chunks, policy=policy, check=case.check,
                      vocab_size=v)
        # the float64 reference on the full logits, differentiated in the same way
        hr, wr = h_f.clone().requires_grad_(), w_f.clone().requires_grad_()
        br = b_f.clone().requires_grad_() if case.bias else None
        x = F.linear(hr, wr, br)
        valid = t_f != IGNORE
        if case.op == "ce":
            seen.clear()
            out = vparallel_ce.linear_cross_entropy(h, w, t, b, reduction=case.reduction, schedule=case.schedule,
                                                    **common)
            ref = reference_loss(x, t_f, reduction=case.reduction)
            grads = (up, up_f) if case.reduction == "none" else (None, None)
        elif case.op == "logprobs":
            seen.clear()
            logp, ent = vparallel_ce.linear_token_logprobs(h, w, t, b, with_entropy=True, **common)
            lq = torch.log_softmax(x, -1)
            ref_lp = torch.where(valid, lq.gather(1, t_f.clamp(min=0)[:, None])[:, 0], 0.0)
            ref_ent = torch.where(valid, -(lq.exp() * lq).sum(-1), 0.0)
            out, ref = torch.stack([logp, ent]), torch.stack([ref_lp, ref_ent])
            g_f = torch.stack([up_f, up_f.flip(0)])
            grads = (g_f[:, rows], g_f)
        else:
            kw = dict(kind="forward_kl", reduction=case.reduction, temperature=2.0, hard_weight=0.5)
            if case.op == "distill":
                teacher, twt = ht_f[rows], shard(wt_f, world, rank, 0)
                ref = reference_distillation(x, F.linear(ht_f, wt_f), t_f, **kw)
            else:  # a sparse teacher: against the uncompacted op (itself checked against its references)
                top = torch.log_softmax(F.linear(ht_f, wt_f), -1).topk(3, -1)
                teacher, twt = vparallel_ce.TopKTeacher(top.indices[rows], top.values[rows]), None
                hu = h.detach().clone().requires_grad_()
                wu = w.detach().clone().requires_grad_()
                ref = vparallel_ce.linear_distillation_loss(hu, wu, teacher, None, t, **kw, **dict(
                    common, policy=ChunkPolicy(compact=False)))
                ref.backward(up if case.reduction == "none" else None)
            seen.clear()
            out = vparallel_ce.linear_distillation_loss(h, w, teacher, twt, t, student_bias=b, **kw, **common)
            grads = (up, up_f) if case.reduction == "none" else (None, None)
        compacted = seen[0] if seen else None
        assert (compacted is not None) == (case.pattern != "none ignored"), f"{case}: compacted to {compacted}"
        if compacted is not None:
            assert sum(compacted) < N, f"{case}: compacted to {compacted} of {N} rows"
        if case.op == "topk":
            _close(out, ref, f"{case}: loss")
            out.backward(grads[0])
            _close(h.grad, hu.grad, f"{case}: hidden grad on rank {rank}")
            _close(w.grad, wu.grad, f"{case}: weight grad on rank {rank}")
            checked += 1
            continue
        # per-token outputs: this rank's tokens (all of them without sequence parallelism)
        _close(out, ref[..., rows] if ref.dim() else ref, f"{case}: output")
        out.backward(grads[0])
        ref.backward(grads[1])
        if case.pattern != "none ignored" and (case.reduction == "none" or case.op == "logprobs"):
            ignored = t == IGNORE
            assert (out.detach()[..., ignored] == 0).all(), f"{case}: an ignored token's output is not 0"
        _close(h.grad, hr.grad[rows], f"{case}: hidden grad on rank {rank}")
        assert (h.grad[t == IGNORE] == 0).all(), f"{case}: an ignored token's hidden grad row is not 0"
        _close(w.grad, shard(wr.grad, world, rank, 0), f"{case}: weight grad on rank {rank}")
        if case.bias:
            _close(b.grad, shard(br.grad, world, rank, 0), f"{case}: bias grad on rank {rank}")
        checked += 1
    return checked


@pytest.mark.parametrize("world", [1, 2, 4])
def test_compacted_calls_match_the_float64_references(world):
    results = [compaction_rank(0, 1)] if world == 1 else run_ranks(compaction_rank, world, timeout=300)
    assert all(n == len(cases(world)) for n in results)


def test_the_default_policy_reads_no_count_at_world_1_for_a_small_call():
    seen: list = []
    _spy(seen)
    h, w, _, _, _, t, _ = _data(1, "most ignored")
    vparallel_ce.linear_cross_entropy(h, w, t)
    assert seen == [None], seen  # a host sync would cost more than the GEMMs save
    seen.clear()
    vparallel_ce.linear_cross_entropy(h, w, t, policy=ChunkPolicy(compact=False))
    assert seen == [None], seen


def test_kept_rows_round_up_with_ignored_rows_and_only_where_worth_it():
    policy = ChunkPolicy()
    assert policy.kept_rows((8192,), (4096,)) == (4096,)
    assert policy.kept_rows((8192,), (4093,)) == (4096,)  # a multiple of 8, filled with ignored rows
    assert policy.kept_rows((8192,), (0,)) == (8,)  # all ignored: a few rows still run
    assert policy.kept_rows((8192,), (8192,)) is None  # nothing ignored
    assert policy.kept_rows((8192,), (8100,)) is None  # ~1% of the rows: the gather costs what they save
    assert policy.kept_rows((10, 0, 18), (2, 0, 3)) == (8, 0, 8)
    assert ChunkPolicy(compact=False).kept_rows((8192,), (10,)) is None
    assert not policy.reads_valid_count(8192, 4096, 16032)  # a ~6 ms call: the sync's ~0.1 ms is too much
    assert policy.reads_valid_count(8192, 4096, 128256)
    assert ChunkPolicy(compact=True).reads_valid_count(8, 4, 4)
    assert ChunkPolicy(compact=1).problem() == "ChunkPolicy.compact must be True, False or None, got 1"


def test_a_compacted_call_takes_the_uncompacted_plan_where_its_own_would_peak_higher():
    from vparallel_ce.policy import choose_plan, peak_bytes

    shape = dict(hidden_size=4096, fused=True)
    whole = choose_plan(8192, 128256, 1, **shape)  # vocab blocks, 1.23 GiB
    quarter = choose_plan(2048, 128256, 1, **shape)  # one token chunk: its logits, 1.48 GiB
    model = dict(hidden_size=4096, dtype=torch.bfloat16)
    assert peak_bytes(quarter, 2048, 128256, **model) > peak_bytes(whole, 8192, 128256, **model)
    assert ChunkPolicy.compacted_plan(quarter, 2048, whole, 8192, 128256, 1, **model) == whole
    half = choose_plan(4096, 128256, 1, **shape)
    assert ChunkPolicy.compacted_plan(half, 4096, whole, 8192, 128256, 1, **model) == half
