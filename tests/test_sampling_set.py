"""Specification of the rollout's sampling set: ``token_logprobs`` / ``linear_token_logprobs`` with
``support=`` or ``top_k`` / ``top_p`` / ``min_p``, and ``topk_logprobs`` / ``linear_topk_logprobs``.

Per token with set ``S`` and ``z = logits / T``: ``logp = z_t - logsumexp_{j in S} z_j`` and the
entropy of ``softmax`` renormalised over ``S``. References: plain torch on the GATHERED float64
logits with every entry off ``S`` set to ``-inf`` (:func:`_reference`), values and the gradients of
every input; the masks against a one-process brute-force reading of their rule (:func:`_reference_keep`,
ties included); the top-k op against a stable descending sort of the gathered fp32 log-softmax.

Each multi-rank test is one spawned group per TP degree looping over its cases (tiny shapes),
reporting every failing case by name. TP 1-4 over V = 7 (shards 2, 2, 2, 1 at TP 4) and V = 5 (2,
2, 1, 0: an empty shard).
"""

from __future__ import annotations

import math

import pytest
import torch

import vparallel_ce
from vparallel_ce import sampling_set
from vparallel_ce.layout import VocabLayout
from vparallel_ce.sampling_masks import SamplingMasks, thresholds
from tests.dist import run_ranks, unmet
from tests.reference import TOL, rel_err, shard

N, H = 9, 6


def _group(world):
    import torch.distributed as dist
    return dist.group.WORLD if world > 1 else None


def _data(v: int, k: int, dtype, seed: int):
    """Full logits, targets (two ignored) and a set per token holding its target: rows of ``k``
    ids, one row of all -1 (the whole vocab), one row of one id, padding mixed in."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(N, v, generator=g, dtype=torch.float64) * 2).to(dtype)
    t = torch.randint(0, v, (N,), generator=g)
    sup = torch.full((N, k), -1, dtype=torch.int64)
    for i in range(N):
        others = torch.randperm(v, generator=g)
        others = others[others != t[i]]
        row = torch.cat([t[i : i + 1], others])[:k]
        sup[i, : row.numel()] = row[torch.randperm(row.numel(), generator=g)]
    sup[1] = -1
    sup[2, 1:] = -1
    sup[2, 0] = t[2]  # a set of one id
    if k > 2:  # a hole in a row, not at its target
        sup[3, (sup[3] == t[3]).int().argmax() - 1] = -1
    t[4] = -100
    sup[4] = torch.tensor([v - 1] * 1 + [-1] * (k - 1))  # an ignored token's row is not read
    return x, t, sup


def _set_mask(sup: torch.Tensor, v: int) -> torch.Tensor:
    keep = torch.zeros(sup.shape[0], v, dtype=torch.bool)
    for i, row in enumerate(sup):
        ids = row[row >= 0]
        if ids.numel():
            keep[i, ids] = True
        else:
            keep[i] = True
    return keep


def _reference(x64, t, keep, temperature):
    """(logp, entropy) over each row's kept entries, float64, differentiable; 0 on ignored tokens."""
    z = (x64 / temperature).masked_fill(~keep, float("-inf"))
    lsm = torch.log_softmax(z, -1)
    valid = t != -100
    logp = torch.where(valid, lsm.gather(1, t.clamp(min=0).unsqueeze(-1)).squeeze(-1), 0.0)
    ent = torch.where(valid, -(lsm.exp() * lsm.masked_fill(~keep, 0.0)).sum(-1), 0.0)
    return logp, ent


def _reference_keep(z: torch.Tensor, top_k, top_p, min_p) -> torch.Tensor:
    """The masks' rule read literally, one row and one entry at a time (float64 masses)."""
    v = z.shape[-1]
    keep = torch.ones_like(z, dtype=torch.bool)
    m = z.amax(-1, keepdim=True)
    if min_p:
        keep &= z >= m + math.log(min_p)
    if top_k is not None and top_k < v:
        kth = z.sort(dim=-1, descending=True).values[:, top_k - 1 : top_k]
        keep &= z >= kth
    if top_p is not None and top_p < 1:
        q = torch.where(keep, torch.exp(z.double() - m.double()), 0.0)
        q = q / q.sum(-1, keepdim=True)
        # [i, j, l]: entry l is kept and strictly above entry j
        above = (keep.unsqueeze(1) & (z.unsqueeze(1) > z.unsqueeze(2))).double()
        keep = keep & ((above * q.unsqueeze(1)).sum(-1) < top_p)
    return keep


def _set_cases_rank(rank, world):
    """The logits op and the linear op over a set, every listed case against float64."""
    group = _group(world)
    report = []
    cases = [(7, 1, torch.float64, 1.0), (7, 3, torch.float64, 0.7), (7, 7, torch.float64, 1.0),
             (7, 3, torch.bfloat16, 1.3), (5, 3, torch.float64, 1.0), (5, 5, torch.float64, 0.7)]
    for v, k, dtype, temperature in cases:
        if True:
            if True:
                name = f"[TP{world} V={v} K={k} {dtype} T={temperature}]"
                x, t, sup = _data(v, k, dtype, seed=v * 10 + k)
                keep = _set_mask(sup, v)
                x64 = x.double().requires_grad_()
                rl, re = _reference(x64, t, keep, temperature)
                u, w_ = torch.linspace(-1, 1, N, dtype=torch.float64), torch.linspace(0.5, -0.3, N, dtype=torch.float64)
                rdx, = torch.autograd.grad((rl * u).sum() + (re * w_).sum(), x64)
                xs = shard(x, world, rank).clone().requires_grad_()
                lp, ent = vparallel_ce.token_logprobs(xs, t, group=group, support=sup, temperature=temperature,
                                                      with_entropy=True, chunks=2 if k == 3 else "auto")
                for what, a, b in (("logp", lp, rl), ("entropy", ent, re)):
                    if rel_err(a, b.detach()) > TOL[dtype]:
                        report.append(f"{name} logits op {what}: rel err {rel_err(a, b.detach()):.2e}")
                dx, = torch.autograd.grad((lp * u).sum() + (ent * w_).sum(), xs)
                if rel_err(dx, shard(rdx, world, rank), scale=rdx) > TOL[dtype]:
                    report.append(f"{name} logits op d logits: rel err {rel_err(dx, shard(rdx, world, rank), scale=rdx):.2e}")
                if k == v and dtype == torch.float64:  # every row the whole vocab: the full-vocab op
                    full = vparallel_ce.token_logprobs(xs, t, group=group, temperature=temperature)
                    whole = keep.all(-1)
                    if rel_err(lp[whole], full[whole]) > 1e-12:
                        report.append(f"{name} K=V differs from the full-vocabulary op")
                if dtype == torch.bfloat16 or (k == v and v == 7):
                    continue
                # the linear op: gather mode (ratio 1) and GEMM mode (ratio 10**9), bias, sequence parallelism
                g = torch.Generator().manual_seed(v + k)
                h = torch.randn(N, H, generator=g, dtype=torch.float64)
                wt = torch.randn(v, H, generator=g, dtype=torch.float64)
                bt = torch.randn(v, generator=g, dtype=torch.float64)
                leaves = [a.clone().requires_grad_() for a in (h, wt, bt)]
                xl = leaves[0] @ leaves[1].T + leaves[2]
                rl, re = _reference(xl, t, keep, temperature)
                rg = torch.autograd.grad((rl * u).sum() + (re * w_).sum(), leaves)
                default_ratio = sampling_set.GATHER_RATIO
                for ratio in (1, 10**9):
                    for sp in ((False, True) if world > 1 else (False,)):
                        sampling_set.GATHER_RATIO = ratio
                        case = f"{name} linear ratio={ratio} sp={sp}"
                        rows = shard(torch.arange(N), world, rank, 0) if sp else torch.arange(N)
                        hm = h[rows].clone().requires_grad_()
                        wm = shard(wt, world, rank, 0).clone().requires_grad_()
                        bm = shard(bt, world, rank, 0).clone().requires_grad_()
                        lp, ent = vparallel_ce.linear_token_logprobs(
                            hm, wm, t[rows], bm, group=group, sequence_parallel=sp, support=sup[rows],
                            temperature=temperature, with_entropy=True, chunks=2)
                        for what, a, b in (("logp", lp, rl[rows]), ("entropy", ent, re[rows])):
                            if rel_err(a, b.detach()) > TOL[dtype]:
                                report.append(f"{case} {what}: rel err {rel_err(a, b.detach()):.2e}")
                        got = torch.autograd.grad((lp * u[rows]).sum() + (ent * w_[rows]).sum(), (hm, wm, bm))
                        want = (rg[0][rows], shard(rg[1], world, rank, 0), shard(rg[2], world, rank, 0))
                        for what, a, b, full in zip(("d hidden", "d weight", "d bias"), got, want, rg):
                            if rel_err(a, b, scale=full) > TOL[dtype]:
                                report.append(f"{case} {what}: rel err {rel_err(a, b, scale=full):.2e}")
                sampling_set.GATHER_RATIO = default_ratio
    # bf16 hidden and weight with fp32 logits, against the float64 reference of the bf16 values
    v, k = 7, 3
    x, t, sup = _data(v, k, torch.float64, seed=3)
    g = torch.Generator().manual_seed(1)
    h = torch.randn(N, 16, generator=g).bfloat16()
    wt = torch.randn(v, 16, generator=g).bfloat16()
    for logits_dtype, tol in ((torch.float32, 1e-5), (None, 2e-2)):
        lp = vparallel_ce.linear_token_logprobs(h, shard(wt, world, rank, 0), t, group=group, support=sup,
                                                logits_dtype=logits_dtype)
        rl, _ = _reference(h.double() @ wt.double().T, t, _set_mask(sup, v), 1.0)
        if rel_err(lp, rl) > tol:
            report.append(f"[TP{world}] bf16 logits_dtype={logits_dtype}: rel err {rel_err(lp, rl):.2e}")
    return report


def _mask_cases_rank(rank, world):
    """The masks' kept sets (the op's thresholds) equal the one-process rule, ties included; and the
    op's log-probs are over them."""
    group = _group(world)
    report = []
    g = torch.Generator().manual_seed(5)
    for v in (7, 5):
        ints = torch.randint(-2, 3, (N, v), generator=g).double()  # many ties
        smooth = torch.randn(N, v, generator=g, dtype=torch.float64) * 2
        for label, x in (("ties", ints), ("no ties", smooth)):
            for masks in ((2, None, None), (None, 0.5, None), (None, None, 0.3), (3, 0.7, None), (None, 0.9, 0.1),
                          (2, 0.6, 0.2), (1, None, None), (None, 0.05, None)):
                for temperature in ((1.0, 0.6) if masks == (3, 0.7, None) else (1.0,)):
                    name = f"[TP{world} V={v} {label} top_k,top_p,min_p={masks} T={temperature}]"
                    z = x.float() * (1.0 / temperature)
                    want = _reference_keep(z, *masks)
                    lay = VocabLayout.of_rank(group, world, rank, v)
                    tau = thresholds(shard(z, world, rank), SamplingMasks(*masks), lay)
                    got = z >= tau.unsqueeze(-1)
                    if not torch.equal(got, want):
                        report.append(f"{name} kept set {got.int().tolist()} != {want.int().tolist()}")
                        continue
                    t = torch.where(want.any(-1), want.float().argmax(-1), 0)
                    t[0] = -100
                    t[1] = (~want[1]).float().argmax() if not want[1].all() else t[1]  # a dropped target: -inf
                    xs = shard(x, world, rank).clone().requires_grad_()
                    top_k, top_p, min_p = masks
                    lp, ent = vparallel_ce.token_logprobs(xs, t, group=group, temperature=temperature, top_k=top_k,
                                                          top_p=top_p, min_p=min_p, with_entropy=True)
                    x64 = x.clone().requires_grad_()
                    rl, re = _reference(x64, t, want, temperature)
                    if not torch.equal(torch.isinf(lp), torch.isinf(rl)) or rel_err(lp[~torch.isinf(rl)],
                                                                                     rl[~torch.isinf(rl)]) > 1e-6:
                        report.append(f"{name} logp {lp.tolist()} != {rl.tolist()}")
                    if rel_err(ent, re.detach()) > 1e-6:
                        report.append(f"{name} entropy")
                    fin = ~torch.isinf(rl)
                    rdx, = torch.autograd.grad((rl[fin]).sum() + re.sum(), x64)
                    dx, = torch.autograd.grad((lp[fin]).sum() + ent.sum(), xs)
                    if rel_err(dx, shard(rdx, world, rank), scale=rdx) > 1e-6:
                        report.append(f"{name} d logits")
    # the linear op with masks (one case: it shares the logits op's thresholds)
    h, wt = torch.randn(N, H, generator=g, dtype=torch.float64), torch.randn(7, H, generator=g, dtype=torch.float64)
    xl = h @ wt.T
    want = _reference_keep(xl.float(), 3, 0.8, None)
    t = want.float().argmax(-1)
    lp = vparallel_ce.linear_token_logprobs(h, shard(wt, world, rank, 0), t, group=group, top_k=3, top_p=0.8)
    rl, _ = _reference(xl, t, want, 1.0)
    if rel_err(lp, rl) > 1e-6:
        report.append(f"[TP{world}] linear op with masks: rel err {rel_err(lp, rl):.2e}")
    return report


def _topk_cases_rank(rank, world):
    group = _group(world)
    report = []
    g = torch.Generator().manual_seed(7)
    for v in (7, 5, 13):
        for label, x in (("ties", torch.randint(-2, 3, (N, v), generator=g).float()),
                         ("no ties", torch.randn(N, v, generator=g))):
            for k in (1, 3, v + 2):
                for temperature in ((1.0, 0.5) if k == 3 else (1.0,)):
                    name = f"[TP{world} V={v} {label} k={k} T={temperature}]"
                    lsm = torch.log_softmax(x.float() / temperature, -1)
                    s = lsm.sort(dim=-1, descending=True, stable=True)
                    r = vparallel_ce.topk_logprobs(shard(x, world, rank), k, group=group, temperature=temperature,
                                                   chunks=2)
                    kk = min(k, v)
                    if not torch.equal(r.ids[:, :kk], s.indices[:, :kk]) or (r.ids[:, kk:] != -1).any():
                        report.append(f"{name} ids {r.ids.tolist()} != {s.indices[:, :kk].tolist()}")
                    if rel_err(r.logprobs[:, :kk], s.values[:, :kk]) > 1e-5:
                        report.append(f"{name} logprobs")
                    rest = torch.logsumexp(s.values[:, kk:], -1) if kk < v else torch.full((N,), float("-inf"))
                    if not torch.allclose(r.rest_logprob, rest, atol=1e-5, rtol=1e-4):
                        report.append(f"{name} rest_logprob {r.rest_logprob.tolist()} != {rest.tolist()}")
    h, wt = torch.randn(N, H, generator=g), torch.randn(13, H, generator=g)
    r = vparallel_ce.linear_topk_logprobs(h, shard(wt, world, rank, 0), 4, group=group)
    s = torch.log_softmax(h @ wt.T, -1).sort(dim=-1, descending=True, stable=True)
    if not torch.equal(r.ids, s.indices[:, :4]) or rel_err(r.logprobs, s.values[:, :4]) > 1e-5:
        report.append(f"[TP{world}] linear_topk_logprobs")
    return report


def _bad_sets_rank(rank, world):
    group = _group(world)
    v = 7
    x, t, sup = _data(v, 3, torch.float64, seed=1)
    xs = shard(x, world, rank)
    dup, out, missing = sup.clone(), sup.clone(), sup.clone()
    dup[0, 1] = dup[0, 0]
    out[5, 0] = v
    missing[6] = torch.tensor([(t[6] + 1) % v, -1, -1])
    mine = sup.clone()
    mine[7, 0] = -1 if rank == 0 else mine[7, 0]

    def op(s, **kw):
        return lambda: vparallel_ce.token_logprobs(xs, t, group=group, support=s, **kw)

    cases = {
        "duplicate id": (op(dup), ["repeats an id", "token 0"]),
        "id out of range": (op(out), ["outside [0, 7)", "token 5"]),
        "target not in its set": (op(missing), ["token 6", f"target {t[6].item()}", "not in its support"]),
        "support and masks": (op(sup, top_k=2), ["either support"]),
        "wrong dtype": (op(sup.int()), ["int64"]),
        "wrong shape": (op(sup[:, None]), ["support shape"]),
        "bad top_p": (op(None, top_p=0.0), ["top_p"]),
        "linear duplicate id": (lambda: vparallel_ce.linear_token_logprobs(
            torch.ones(N, H, dtype=torch.float64), shard(torch.ones(v, H, dtype=torch.float64), world, rank, 0), t,
            group=group, support=dup), ["repeats an id"]),
    }
    if world > 1:
        cases["ranks disagree on the set"] = (op(mine), ["disagree on support checksum"])
    if world > 1:
        report = unmet(cases, f"[TP{world}]", group)
    else:
        report = []
        for name, (call, words) in cases.items():
            try:
                call()
                report.append(f"[TP1] {name}: did not raise")
            except (ValueError, TypeError) as exc:
                if not all(w in str(exc) for w in words):
                    report.append(f"[TP1] {name}: {exc} lacks {words}")
    try:  # the masks' thresholds are not made in a fixed order: refused with batch_invariant
        vparallel_ce.token_logprobs(xs, t, group=group, top_k=2, batch_invariant=True)
        report.append(f"[TP{world}] batch_invariant with top_k did not raise")
    except NotImplementedError as exc:
        if "batch_invariant" not in str(exc):
            report.append(f"[TP{world}] batch_invariant message: {exc}")
    # a set with batch_invariant: the set's log-probs (over the whole shard's masked logits)
    inv = vparallel_ce.token_logprobs(xs, t, group=group, support=sup, batch_invariant=True)
    if not torch.allclose(inv, vparallel_ce.token_logprobs(xs, t, group=group, support=sup), rtol=1e-9, atol=1e-12):
        report.append(f"[TP{world}] batch_invariant with support: not the set's log-probs")
    # check=False: a target outside its set has logp = -inf and no gradient
    xg = xs.clone().requires_grad_()
    lp = vparallel_ce.token_logprobs(xg, t, group=group, support=missing, check=False)
    if lp[6] != float("-inf"):
        report.append(f"[TP{world}] check=False: logp of a target outside its set is {lp[6].item()}")
    (dx,) = torch.autograd.grad(torch.where(torch.isinf(lp), 0.0, lp).sum(), xg)
    if not torch.isfinite(dx).all():
        report.append(f"[TP{world}] check=False: non-finite gradient")
    return report


@pytest.mark.parametrize("world", [1, 3, 4])
def test_set_logprobs_match_float64_reference(world):
    reports = run_ranks(_set_cases_rank, world) if world > 1 else [_set_cases_rank(0, 1)]
    failures = [line for r in reports for line in r]
    assert not failures, "\n".join(failures[:40])


@pytest.mark.parametrize("world", [1, 3, 4])
def test_masks_and_topk_match_one_process_rules(world):
    reports = run_ranks(_masks_and_topk_rank, world) if world > 1 else [_masks_and_topk_rank(0, 1)]
    failures = [line for r in reports for line in r]
    assert not failures, "\n".join(failures[:40])


def _masks_and_topk_rank(rank, world):
    return _mask_cases_rank(rank, world) + _topk_cases_rank(rank, world)


@pytest.mark.parametrize("world", [1, 3])
def test_bad_sets_raise_on_every_rank(world):
    reports = run_ranks(_bad_sets_rank, world) if world > 1 else [_bad_sets_rank(0, 1)]
    failures = [line for r in reports for line in r]
    assert not failures, "\n".join(failures)


def test_topk_record_is_a_topk_teacher():
    x = torch.randn(4, 11)
    rec = vparallel_ce.topk_logprobs(x, 3, temperature=2.0)
    teacher = rec.teacher(temperature=2.0)
    ref = vparallel_ce.TopKTeacher.from_logits(x, 3, temperature=2.0)
    assert torch.equal(teacher.ids, ref.ids) and torch.allclose(teacher.logprobs, ref.logprobs)
    loss = vparallel_ce.distillation_loss(torch.randn(4, 11), teacher, temperature=2.0)
    assert torch.isfinite(loss)


def _modes_differ_rank(rank, world):
    """The linear op where each rank's rule picks its own mode per chunk (a per-rank GATHER_RATIO;
    V = 7: shards 2, 2, 2, 1, V = 5: 2, 2, 1, 0): ids only in shard 0 on some rows, whole-vocabulary
    rows, an ignored token, with and without sequence parallelism and check; against float64.
    Returns the failures and, per case, the modes this rank took (gather or not, per chunk)."""
    group = _group(world)
    report, modes = [], []
    rule = sampling_set.gathers
    default = sampling_set.GATHER_RATIO

    def spy(k_loc, width):
        modes[-1].append(rule(k_loc, width))
        return modes[-1][-1]

    sampling_set.gathers = spy
    try:
        for v, k in ((7, 3), (5, 1)):
            x, t, sup = _data(v, k, torch.float64, seed=v + 20 * k)
            sup[5:7] = -1
            sup[5:7, 0] = t[5:7] = 0  # ids of shard 0 only: a chunk that keeps nothing on the other ranks
            keep = _set_mask(sup, v)
            g = torch.Generator().manual_seed(v * k)
            h, wt = (torch.randn(n, H, generator=g, dtype=torch.float64) for n in (N, v))
            bt = torch.randn(v, generator=g, dtype=torch.float64)
            leaves = [a.clone().requires_grad_() for a in (h, wt, bt)]
            u = torch.linspace(-1, 1, N, dtype=torch.float64)
            rl, re = _reference(leaves[0] @ leaves[1].T + leaves[2], t, keep, 0.7)
            rg = torch.autograd.grad((rl * u).sum() + re.sum(), leaves)
            for ratios in ((1, 2, 10**9, 2), (10**9, 1, 2, 1)):
                for sp, check in ((False, True), (True, True), (True, False)):
                    sampling_set.GATHER_RATIO = ratios[rank]
                    modes.append([])
                    case = f"[TP{world} V={v} K={k} ratios={ratios} sp={sp} check={check}]"
                    rows = shard(torch.arange(N), world, rank, 0) if sp else torch.arange(N)
                    ins = [h[rows], shard(wt, world, rank, 0), shard(bt, world, rank, 0)]
                    ins = [a.clone().requires_grad_() for a in ins]
                    lp, ent = vparallel_ce.linear_token_logprobs(
                        ins[0], ins[1], t[rows], ins[2], group=group, sequence_parallel=sp, support=sup[rows],
                        temperature=0.7, with_entropy=True, chunks=3, check=check, vocab_size=v)
                    got = torch.autograd.grad((lp * u[rows]).sum() + ent.sum(), ins)
                    want = (rg[0][rows], shard(rg[1], world, rank, 0), shard(rg[2], world, rank, 0))
                    for what, a, b, full in (("logp", lp, rl[rows], rl), ("entropy", ent, re[rows], re)) + tuple(
                            zip(("d hidden", "d weight", "d bias"), got, want, rg)):
                        if rel_err(a, b.detach(), scale=full) > 1e-10:
                            report.append(f"{case} {what}: rel err {rel_err(a, b.detach(), scale=full):.2e}")
    finally:
        sampling_set.gathers = rule
        sampling_set.GATHER_RATIO = default
    return report, modes


def test_ranks_taking_different_set_modes_match_float64():
    # a rank's modes follow its own shard (K_loc per chunk): the collectives (sequence parallelism's
    # all-gathers and reduce-scatters, the statistics' exchanges) must not, forward or backward
    results = run_ranks(_modes_differ_rank, 4)
    failures = [line for report, _ in results for line in report]
    assert not failures, "\n".join(failures[:40])
    per_case = list(zip(*(modes for _, modes in results)))
    assert any(len({tuple(m) for m in case}) > 1 for case in per_case), "no case had ranks in different modes"
    assert any(len(set(m)) > 1 for case in per_case for m in case), "no rank mixed the modes over its chunks"


def test_a_repeated_id_with_check_false_counts_twice_in_both_modes():
    # check=False takes the set as given: an id twice in a row is two entries of the renormalised
    # sum; each mode's gradient is the derivative of that value
    x, t, sup = _data(7, 3, torch.float64, seed=8)
    other = (t[0] + 1) % 7
    sup[0] = torch.stack([other, t[0], other])  # two copies of an id beside the target
    g = torch.Generator().manual_seed(2)
    h, w = torch.randn(N, H, generator=g, dtype=torch.float64), torch.randn(7, H, generator=g, dtype=torch.float64)
    leaves = [a.clone().requires_grad_() for a in (h, w)]
    xl = leaves[0] @ leaves[1].T
    want = xl.gather(1, t.clamp(min=0)[:, None])[:, 0] - torch.logsumexp(xl.gather(1, sup.clamp(min=0)), -1)
    want_g = torch.autograd.grad(want[0], leaves)
    default = sampling_set.GATHER_RATIO
    try:
        for ratio in (1, 10**9):
            sampling_set.GATHER_RATIO = ratio
            ins = [a.clone().requires_grad_() for a in (h, w)]
            lp = vparallel_ce.linear_token_logprobs(ins[0], ins[1], t, support=sup, check=False)
            assert rel_err(lp[0], want[0].detach()) < 1e-12, (ratio, lp[0], want[0])
            for what, a, b in zip(("d hidden", "d weight"), torch.autograd.grad(lp[0], ins), want_g):
                assert rel_err(a, b) < 1e-12, (ratio, what, rel_err(a, b))
    finally:
        sampling_set.GATHER_RATIO = default
