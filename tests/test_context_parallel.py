"""Specification of context parallelism (CP) for the losses: the labels of every head made across
CP shards (contiguous and head-tail load-balanced) lose no token at a shard boundary, and at CP 2 x
TP 2 (4 gloo ranks) the CE and MTP losses and gradients summed over the CP ranks equal the
one-process float64 reference; gradient accumulation x DP 2 x CP 2 equals one big batch."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import vparallel_ce
from tests.dist import run_ranks
from tests.reference import rel_err, shard
from tests.test_mtp import make_case, reference
from vparallel_ce.labels import context_parallel_labels, context_parallel_shard, count_head_tokens, mtp_labels

SEQ = 8  # 2 x CP parts of 4 or 4 x 2 (load-balanced)


def _sum(t, group):
    import torch.distributed as dist

    t = t.clone()
    dist.all_reduce(t, group=group)
    return t


def labels_failures(cp_rank, cp, cp_group, lb) -> list[str]:
    """Each head's CP-made labels are this rank's part of the whole sequence's rolled labels
    (a local roll would lose d labels per boundary); from input ids with ``next_token`` too."""
    _, _, _, labels, positions = make_case(0, depths=3, seq=SEQ)
    mine = lambda x: context_parallel_shard(x, cp_rank, cp, load_balanced=lb)  # noqa: E731
    got = context_parallel_labels(mine(labels), group=cp_group, depths=3, positions=mine(positions),
                                  load_balanced=lb)
    want = [mine(t) for t in mtp_labels(labels, 3, positions=positions)]
    failures = [f"cp={cp} lb={lb} head {d}" for d, (a, b) in enumerate(zip(got, want)) if not torch.equal(a, b)]
    ids = torch.randint(0, 13, (2, SEQ), generator=torch.Generator().manual_seed(1))
    next_labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], dim=1)
    got = context_parallel_labels(mine(ids), group=cp_group, next_token=True, load_balanced=lb)
    if not torch.equal(got[0], mine(next_labels)):
        failures.append(f"cp={cp} lb={lb} next-token labels from ids")
    return failures


def tp_cp_failures(tp_rank, tp, tp_group, cp_rank, cp, cp_group, lb, depths, tol=1e-10) -> list[str]:
    """MTP and CE on this rank's CP shard of the sequence and TP shard of the vocab, the counts
    summed over CP: the loss summed over CP, dh and the CP-summed dW / db equal the reference."""
    case = make_case(3 + depths, depths=depths, seq=SEQ)
    hiddens, weight, bias, labels, positions = case
    loss_ref, _, _, grads = reference(case)
    mine = lambda x, dim=-1: context_parallel_shard(x, cp_rank, cp, load_balanced=lb, dim=dim)  # noqa: E731
    heads = context_parallel_labels(mine(labels), group=cp_group, depths=depths, positions=mine(positions),
                                    load_balanced=lb)
    counts = count_head_tokens(heads, group=cp_group)
    hs = [mine(h, -2).clone().requires_grad_() for h in hiddens]
    w = shard(weight, tp, tp_rank, 0).clone().requires_grad_()
    b = shard(bias, tp, tp_rank, 0).clone().requires_grad_()
    out = vparallel_ce.linear_mtp_loss(hs, w, heads, b, group=tp_group, num_valid_tokens=counts, chunks=2)
    out.loss.backward()
    errs = {"mtp loss": rel_err(_sum(out.loss.detach(), cp_group), loss_ref),
            "mtp dW": rel_err(_sum(w.grad, cp_group), shard(grads[-2], tp, tp_rank, 0), grads[-2]),
            "mtp db": rel_err(_sum(b.grad, cp_group), shard(grads[-1], tp, tp_rank, 0), grads[-1])}
    for d, h in enumerate(hs):
        errs[f"mtp dh{d}"] = rel_err(h.grad, mine(grads[d], -2), grads[d])
    # plain CE from input ids: the next-token labels cross the CP boundary too
    ids = torch.randint(0, 13, (2, SEQ), generator=torch.Generator().manual_seed(depths))
    full = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], dim=1)
    h0 = hiddens[0].clone().requires_grad_()
    w0 = weight.clone().requires_grad_()
    F.cross_entropy(F.linear(h0, w0).reshape(-1, weight.shape[0]), full.reshape(-1)).backward()
    (target,) = context_parallel_labels(mine(ids), group=cp_group, next_token=True, load_balanced=lb)
    h = mine(hiddens[0], -2).clone().requires_grad_()
    w = shard(weight, tp, tp_rank, 0).clone().requires_grad_()
    n = vparallel_ce.count_valid_tokens(target, group=cp_group)
    loss = vparallel_ce.linear_cross_entropy(h, w, target, group=tp_group, num_valid_tokens=n)
    loss.backward()
    ref_loss = F.cross_entropy(F.linear(hiddens[0], weight).reshape(-1, weight.shape[0]), full.reshape(-1))
    errs.update({"ce loss": rel_err(_sum(loss.detach(), cp_group), ref_loss),
                 "ce dh": rel_err(h.grad, mine(h0.grad, -2), h0.grad),
                 "ce dW": rel_err(_sum(w.grad, cp_group), shard(w0.grad, tp, tp_rank, 0), w0.grad)})
    return [f"CP {cp} x TP {tp} lb={lb} D={depths} {k}: {v:.3g}" for k, v in errs.items() if not v < tol]


def accumulation_failures(dp_rank, dp, dp_group, cp_rank, cp, cp_group, world_group, lb) -> list[str]:
    """DP x CP ranks, two microbatches each, per-head counts of the whole step: the gradients summed
    over every rank equal one big batch of every microbatch's whole sequences."""
    depths, batches = 2, [make_case(20 + i, depths=2, seq=SEQ, ignore_frac=0.1 + 0.3 * i) for i in range(2 * dp)]
    mine = lambda x, dim=-1: context_parallel_shard(x, cp_rank, cp, load_balanced=lb, dim=dim)  # noqa: E731
    weight = batches[0][1].clone().requires_grad_()
    own = batches[2 * dp_rank : 2 * dp_rank + 2]  # this DP rank's microbatches
    heads = [context_parallel_labels(mine(c[3]), group=cp_group, depths=depths, positions=mine(c[4]),
                                     load_balanced=lb) for c in own]
    counts = count_head_tokens(heads, group=(dp_group, cp_group))
    for c, labels in zip(own, heads):
        out = vparallel_ce.linear_mtp_loss([mine(h, -2) for h in c[0]], weight, labels, num_valid_tokens=counts)
        out.loss.backward()
    step = _sum(weight.grad, world_group)  # DP x CP gradient sync as a plain sum (divide factor 1)
    big = [torch.cat([c[0][d] for c in batches]) for d in range(depths + 1)]
    w = batches[0][1].clone().requires_grad_()
    vparallel_ce.linear_mtp_loss(big, w, torch.cat([c[3] for c in batches]),
                                 positions=torch.cat([c[4] for c in batches])).loss.backward()
    err = rel_err(step, w.grad)
    return [] if err < 1e-10 else [f"DP {dp} x CP {cp} lb={lb} accumulation: dW error {err:.3g}"]


def grid_rank(rank, world):
    """4 ranks as a 2 x 2 grid: pairs {0,1}, {2,3} are the TP (or DP) groups, {0,2}, {1,3} the CP groups."""
    import torch.distributed as dist

    rows = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    cols = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    inner, cp_rank = rank % 2, rank // 2
    pair, cp_group = rows[cp_rank], cols[inner]
    failures = []
    for lb, depths in ((False, 1), (True, 3)):
        failures += labels_failures(cp_rank, 2, cp_group, lb)
        failures += tp_cp_failures(inner, 2, pair, cp_rank, 2, cp_group, lb, depths)
        failures += accumulation_failures(inner, 2, pair, cp_rank, 2, cp_group, dist.group.WORLD, lb)
    return failures


def test_cp2_by_tp2_and_dp2_by_cp2_match_one_process():
    failures = [f for per_rank in run_ranks(grid_rank, 4) for f in per_rank]
    assert not failures, "\n".join(failures)
