"""Specification of ``vparallel_ce.linear_mtp_loss``: the loss, each head's loss and top-1
acceptance, and the gradients of every hidden, the weight and the bias equal a float64 reference
(each head's ``F.cross_entropy`` on the full logits, ``torch.argmax``) at TP 1-4 with uneven and
empty vocab shards, D = 1-3, packed documents, ignored tokens, both reductions, every plan, sequence
parallelism and autocast; and torchtitan 0.3.0's ``MTPLoss`` where the two mean the same."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import vparallel_ce
from tests.dist import one_thread, run_ranks
from tests.reference import largest_tensor, rel_err, shard
from vparallel_ce.compaction import compacted_head_rows
from vparallel_ce.labels import mtp_labels

H = 6
PLANS = [  # (chunks, schedule, recompute): one chunk kept, gradients in forward, recomputed, vocab blocks
    (1, "token", None), (3, "token", False), (2, "token", True), (2, "vocab", None)]


def make_case(seed, *, depths, vocab=13, batch=2, seq=7, ignore_frac=0.2, packed=True, bias=True):
    g = torch.Generator().manual_seed(seed)
    hiddens = [torch.randn(batch, seq, H, generator=g, dtype=torch.float64) for _ in range(depths + 1)]
    weight = torch.randn(vocab, H, generator=g, dtype=torch.float64)
    b = torch.randn(vocab, generator=g, dtype=torch.float64) if bias else None
    labels = torch.randint(0, vocab, (batch, seq), generator=g)
    labels[torch.rand(batch, seq, generator=g) < ignore_frac] = -100
    positions = None
    if packed:  # documents of 3, 4 (and the rest) tokens in row 0, one document in row 1
        first = torch.cat([torch.arange(3), torch.arange(4), torch.arange(max(seq - 7, 0))])[:seq]
        positions = torch.stack([first, torch.arange(seq)])[:batch]
    return hiddens, weight, b, labels, positions


def reference(case, *, reduction="mean", mtp_scale=0.3, counts=None):
    """Loss, per-head losses and acceptance, gradients (hiddens..., weight, bias) in float64."""
    hiddens, weight, bias, labels, positions = case
    hs = [h.clone().requires_grad_() for h in hiddens]
    w = weight.clone().requires_grad_()
    b = None if bias is None else bias.clone().requires_grad_()
    heads = mtp_labels(labels, len(hs) - 1, positions=positions)
    losses, hits, ns = [], [], []
    for d, (h, t) in enumerate(zip(hs, heads)):
        x = F.linear(h.reshape(-1, H), w, b)
        t = t.reshape(-1)
        valid = t != -100
        n = valid.sum().double() if counts is None else torch.tensor(float(counts[d]), dtype=torch.float64)
        s = F.cross_entropy(x, t, reduction="sum")
        losses.append(s / n if reduction == "mean" else s)
        hit = ((x.argmax(-1) == t) & valid).sum().double()
        hits.append(hit / n if reduction == "mean" else hit)
        ns.append(n)
    total = losses[0] + mtp_scale * sum(losses[1:]) / (len(hs) - 1)
    total.backward()
    grads = [h.grad for h in hs] + [w.grad] + ([] if b is None else [b.grad])
    return total.detach(), torch.stack([x.detach() for x in losses]), torch.stack(hits), grads


def run_case(rank, world, group, case, *, reduction, plan, sp=False, dtype=torch.float64, counts=None, policy=None):
    """The op on this rank's shard; the largest relative error of every output against the reference."""
    hiddens, weight, bias, labels, positions = case
    loss_ref, head_ref, acc_ref, grads_ref = reference(case, reduction=reduction, counts=counts)
    chunks, schedule, recompute = plan
    heads = mtp_labels(labels, len(hiddens) - 1, positions=positions)
    if sp:  # every head's tokens split over the group (torch.chunk of the flattened tokens)
        hs_in = [shard(h.reshape(-1, H), world, rank, 0) for h in hiddens]
        lab_in, pos_in = [shard(t.reshape(-1), world, rank, 0) for t in heads], None
    else:
        hs_in, lab_in, pos_in = hiddens, labels, positions
    hs = [h.to(dtype).clone().requires_grad_() for h in hs_in]
    w = shard(weight, world, rank, 0).to(dtype).clone().requires_grad_()
    b = None if bias is None else shard(bias, world, rank, 0).to(dtype).clone().requires_grad_()
    out = vparallel_ce.linear_mtp_loss(hs, w, lab_in, b, positions=pos_in, group=group, reduction=reduction,
                                       sequence_parallel=sp, chunks=chunks, schedule=schedule, recompute=recompute,
                                       num_valid_tokens=counts, policy=policy)
    out.loss.backward()
    assert not out.head_losses.requires_grad and not out.acceptance.requires_grad
    errs = {"loss": rel_err(out.loss, loss_ref), "head_losses": rel_err(out.head_losses, head_ref),
            "acceptance": (out.acceptance - acc_ref).abs().max().item()}
    for d, (h, g) in enumerate(zip(hs, grads_ref)):
        expect = shard(g.reshape(-1, H), world, rank, 0) if sp else g
        errs[f"dh{d}"] = rel_err(h.grad, expect, g)
    errs["dW"] = rel_err(w.grad, shard(grads_ref[len(hs)], world, rank, 0), grads_ref[len(hs)])
    if b is not None:
        errs["db"] = rel_err(b.grad, shard(grads_ref[-1], world, rank, 0), grads_ref[-1])
    return errs


def cases(world, limit=None):
    """A covering subset per TP degree: every plan once, the reduction alternating (each plan x
    reduction pair over two degrees), depths 1-3, bias, packing and sequence parallelism rotating
    with the degree."""
    for i, plan in enumerate(PLANS[:limit]):
        reduction = ("mean", "sum")[(i + world) % 2]
        depths = 1 + (i + world) % 3
        yield dict(seed=i, depths=depths, bias=(i + world) % 2 == 0, packed=(i + world) % 3 != 1,
                   sp=world > 1 and (i + world) % 2 == 1, plan=plan, reduction=reduction)


def tp_failures(rank, world, group, vocab, limit=None, tol=1e-10) -> list[str]:
    failures = []
    for c in cases(world, limit):
        case = make_case(c["seed"], depths=c["depths"], vocab=vocab, bias=c["bias"], packed=c["packed"])
        errs = run_case(rank, world, group, case, reduction=c["reduction"], plan=c["plan"], sp=c["sp"])
        bad = {k: v for k, v in errs.items() if not v < tol}
        if bad:
            failures.append(f"TP {world} rank {rank} V={vocab} {c}: {bad}")
    # ignored-token compaction: every head keeps the valid rows of the head with the most (a
    # packed batch: the depths' rolled labels drop more at each document's end)
    for i, plan in enumerate((PLANS[1], PLANS[3])[: limit or 2]):  # gradients in forward; vocab blocks
        depths, reduction = 1 + (i + world) % 3, ("mean", "sum")[i % 2]
        case = make_case(10 + i, depths=depths, vocab=vocab, seq=40, ignore_frac=0.5)
        errs = run_case(rank, world, group, case, reduction=reduction, plan=plan,
                        policy=vparallel_ce.ChunkPolicy(compact=True))
        bad = {k: v for k, v in errs.items() if not v < tol}
        if bad:
            failures.append(f"TP {world} rank {rank} V={vocab} compacted {plan} D={depths} {reduction}: {bad}")
    return failures


def disagreement_failures(rank, world, group) -> list[str]:
    """Ranks that disagree on the depths' weight, the number of heads or the counts: an error on
    every rank naming it, never a hang."""
    from tests.dist import unmet

    hiddens, w, _, labels, _ = make_case(2, depths=2, bias=False)
    w = shard(w, world, rank, 0)
    call = lambda **kw: lambda: vparallel_ce.linear_mtp_loss(hiddens[: kw.pop("heads", 3)], w, labels,  # noqa: E731
                                                              group=group, **kw)
    cases = {"mtp_scale": (call(mtp_scale=0.3 + 0.1 * (rank == 1)), ["mtp scale", "0.4"]),
             "depths": (call(heads=3 if rank else 2), ["mtp heads", "rank 0: 2"]),
             "counts": (call(num_valid_tokens=[9, 8, 7 + rank]), ["mtp num valid tokens"])}
    return unmet(cases, f"TP {world} rank {rank}", group)


def tp_grid_rank(rank, world):
    """On 4 ranks: TP 4 (V=13 uneven, V=3 with an empty shard), TP 3 on ranks 0-2, TP 2 on two pairs."""
    import torch.distributed as dist

    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    three = dist.new_group([0, 1, 2])
    failures = tp_failures(rank, 4, dist.group.WORLD, 13) + tp_failures(rank, 4, dist.group.WORLD, 3, limit=2)
    failures += tie_failures(rank, 4, dist.group.WORLD) + disagreement_failures(rank, 4, dist.group.WORLD)
    if rank < 3:
        failures += tp_failures(rank, 3, three, 13) + tie_failures(rank, 3, three)
    failures += tp_failures(rank % 2, 2, pairs[rank // 2], 13)
    return failures


def test_matches_float64_reference_at_one_rank():
    with one_thread():
        failures = tp_failures(0, 1, None, 13)
    assert not failures, "\n".join(failures)


def test_ignored_rows_are_dropped_per_head_and_the_results_stay_the_uncompacted_ones(monkeypatch):
    # each head keeps as many rows as the head with the most valid ones, so chunks stay one head's
    import vparallel_ce.mtp as mtp

    kept = []

    def spy(target, ignore_index, heads, rows):
        kept.append((target.numel(), heads, rows))
        return compacted_head_rows(target, ignore_index, heads, rows)

    monkeypatch.setattr(mtp, "compacted_head_rows", spy)
    case = make_case(5, depths=2, seq=40, ignore_frac=0.5)
    outs = {}
    for compact in (True, False):
        hs = [h.clone().requires_grad_() for h in case[0]]
        w = case[1].clone().requires_grad_()
        out = vparallel_ce.linear_mtp_loss(hs, w, case[3], case[2], positions=case[4],
                                           policy=vparallel_ce.ChunkPolicy(compact=compact))
        out.loss.backward()
        outs[compact] = [out.loss, out.head_losses, out.acceptance, w.grad, *(h.grad for h in hs)]
    valid = [int((t != -100).sum()) for t in mtp_labels(case[3], 2, positions=case[4])]
    assert kept == [(3 * 80, 3, -(-max(valid) // 8) * 8)], (kept, valid)
    for a, b in zip(outs[True], outs[False]):
        assert torch.equal(a, b)


def test_matches_float64_reference_at_tp_2_3_4_with_uneven_and_empty_shards_and_sequence_parallelism():
    failures = [f for per_rank in run_ranks(tp_grid_rank, 4) for f in per_rank]
    assert not failures, "\n".join(failures)


def test_given_counts_per_head_and_one_count_for_every_head():
    case = make_case(5, depths=2)
    with one_thread():
        for counts in ([30, 20, 10], 25):
            per_head = counts if isinstance(counts, list) else [counts] * 3
            errs = run_case(0, 1, None, case, reduction="mean", plan=PLANS[1], counts=per_head)
            assert max(errs.values()) < 1e-10, (counts, errs)
            out = vparallel_ce.linear_mtp_loss(case[0], case[1], case[3], case[2], positions=case[4],
                                               num_valid_tokens=torch.tensor(counts))
            assert torch.equal(out.num_valid_tokens, torch.tensor(per_head, dtype=torch.float64))


def tie_failures(rank, world, group) -> list[str]:
    """Three equal vocab rows (ids 1, 4 and 7: three shards at TP 3 and 4 with V = 9) that win every
    token's argmax: the acceptance counts label 1 (the lowest id) as hits, labels 4 and 7 never,
    as torch.argmax picks on the gathered row."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(9, H, generator=g, dtype=torch.float64)
    w[1] = w[4] = w[7] = 3 * w[1].abs()
    h = [torch.randn(1, 12, H, generator=g, dtype=torch.float64).abs() for _ in range(2)]
    failures = []
    for label in (1, 4, 7):
        out = vparallel_ce.linear_mtp_loss(h, shard(w, world, rank, 0), torch.full((1, 12), label), group=group)
        if out.acceptance.tolist() != [float(label == 1)] * 2:
            failures.append(f"TP {world} rank {rank} tied label {label}: acceptance {out.acceptance.tolist()}")
    return failures


def test_acceptance_ties_go_to_the_lowest_id():
    assert not tie_failures(0, 1, None)


def test_a_detached_depth_gets_no_gradient_and_the_others_are_unchanged():
    hiddens, w, _, labels, pos = make_case(7, depths=2, bias=False)
    hs = [h.clone().requires_grad_(d != 1) for d, h in enumerate(hiddens)]
    wl = w.clone().requires_grad_()
    vparallel_ce.linear_mtp_loss(hs, wl, labels, positions=pos).loss.backward()
    _, _, _, grads = reference((hiddens, w, None, labels, pos))
    assert hs[1].grad is None
    assert rel_err(hs[0].grad, grads[0]) < 1e-12 and rel_err(hs[2].grad, grads[2]) < 1e-12
    assert rel_err(wl.grad, grads[3]) < 1e-12


@pytest.mark.parametrize("amp", [torch.bfloat16])
def test_autocast_runs_the_matmuls_in_its_dtype_and_returns_fp32_master_gradients(amp):
    case = make_case(9, depths=3, vocab=40, seq=7)
    hiddens, weight, bias, labels, pos = case
    loss_ref, _, _, grads = reference(case)
    hs = [h.float().requires_grad_() for h in hiddens]
    w, b = weight.float().requires_grad_(), bias.float().requires_grad_()
    with torch.autocast("cpu", dtype=amp):
        out = vparallel_ce.linear_mtp_loss(hs, w, labels, b, positions=pos, chunks=2)
    out.loss.backward()
    assert out.loss.dtype == out.head_losses.dtype == out.acceptance.dtype == torch.float32
    assert w.grad.dtype == torch.float32 and hs[0].grad.dtype == torch.float32
    assert rel_err(out.loss, loss_ref) < 2e-2
    for got, want in zip([*(h.grad for h in hs), w.grad, b.grad], grads):
        assert rel_err(got, want) < 3e-2


def test_bad_input_is_named():
    hiddens, w, _, labels, _ = make_case(1, depths=1, bias=False)
    with pytest.raises(ValueError, match="D \\+ 1 >= 2"):
        vparallel_ce.linear_mtp_loss(hiddens[:1], w, labels)
    with pytest.raises(ValueError, match="one shape"):
        vparallel_ce.linear_mtp_loss([hiddens[0], hiddens[1][:, :3]], w, labels)
    with pytest.raises(ValueError, match="reduction must be 'mean' or 'sum'"):
        vparallel_ce.linear_mtp_loss(hiddens, w, labels, reduction="none")
    with pytest.raises(ValueError, match="one per head"):
        vparallel_ce.linear_mtp_loss(hiddens, w, labels, num_valid_tokens=[3, 4, 5])
    with pytest.raises(ValueError, match="cannot be rolled locally"):
        vparallel_ce.linear_mtp_loss(hiddens, w, labels, sequence_parallel=True)
    with pytest.raises(ValueError, match="mtp_scale"):
        vparallel_ce.linear_mtp_loss(hiddens, w, labels, mtp_scale=-1.0)


def test_equals_torchtitan_mtp_loss_on_the_same_logits():
    """torchtitan 0.3.0's MTPLoss sums each head's cross-entropy (fp32 upcast), averages the depths'
    sums, scales them, and divides everything by ONE count (``global_valid_tokens``): our ``"sum"``,
    and our ``"mean"`` with that count given for every head. (Our default ``"mean"`` divides each head by
    its own valid tokens instead: depth d has up to d fewer per sequence.)"""
    mtp = pytest.importorskip("torchtitan.models.deepseek_v3.mtp")
    for depths in (1, 3):
        hiddens, w, b, labels, pos = make_case(11 + depths, depths=depths, seq=7)
        logits = [F.linear(h, w, b) for h in hiddens]
        titan = mtp.MTPLoss(mtp.MTPLoss.Config(mtp_scale=0.3))
        n = (labels != -100).sum()
        for reduction, count, titan_count in (("sum", None, None), ("mean", int(n), n)):
            want, _ = titan(logits, labels, titan_count, positions=pos)
            got = vparallel_ce.linear_mtp_loss(hiddens, w, labels, b, positions=pos, reduction=reduction,
                                               num_valid_tokens=count).loss
            assert rel_err(got, want.double()) < 1e-6, (depths, reduction, got, want)
        for d in range(1, depths + 1):  # the depth labels are torchtitan's roll_mtp_sequence
            rolled = mtp.roll_mtp_sequence(labels, shift=d, fill_value=-100, positions=pos)
            assert torch.equal(mtp_labels(labels, depths, positions=pos)[d], rolled)


def test_no_tensor_as_large_as_the_heads_logits_when_chunked():
    # (a vocab of 400: 8 blocks of 50 columns -- the blocks' statistics, 5 floats a row and block,
    # stay below one head's logits)
    hiddens, weight, _, labels, pos = make_case(6, depths=3, vocab=400, seq=16, bias=False)
    rows, v = 4 * labels.numel(), weight.shape[0]
    for schedule, recompute in (("token", False), ("token", True), ("vocab", None)):
        hs = [h.float().requires_grad_() for h in hiddens]
        w = weight.float().requires_grad_()
        largest = largest_tensor(lambda: vparallel_ce.linear_mtp_loss(
            hs, w, labels, positions=pos, chunks=8, schedule=schedule, recompute=recompute).loss.backward())
        assert largest < labels.numel() * v, (schedule, largest)  # not even one head's logits
        assert largest >= rows * v // 8  # one chunk of logits did exist: the watch works


def test_the_default_policy_plans_the_stacked_heads_as_heads(monkeypatch):
    # a default budget this small makes the tiny case what Llama3-8B's lm_head is at full size: one
    # token row of fp32 logits (52 bytes) fits it, the fp32 dW accumulator (312 bytes) does not,
    # so one head's rows walk vocab blocks; the op plans its 2 x 14 stacked rows as 2 heads
    from vparallel_ce import chunk_policy, mtp
    from vparallel_ce.policy import ChunkPolicy, GradMode, choose_plan

    monkeypatch.setattr(chunk_policy, "DEFAULT_BUDGET_BYTES", 200)
    monkeypatch.setattr(chunk_policy, "_PLANS", {})
    policy = ChunkPolicy(min_chunk_tokens=2)
    assert choose_plan(28, 13, hidden_size=H, policy=policy).schedule == "vocab"
    plans, front_door = [], mtp.linear_call

    def spy(*args, **kw):
        call, inputs = front_door(*args, **kw)
        plans.append(call.plan)
        return call, inputs

    monkeypatch.setattr(mtp, "linear_call", spy)
    case = make_case(3, depths=1)
    hiddens, weight, bias, labels, pos = case
    hs = [h.clone().requires_grad_() for h in hiddens]
    w, b = weight.clone().requires_grad_(), bias.clone().requires_grad_()
    out = vparallel_ce.linear_mtp_loss(hs, w, labels, b, positions=pos, policy=policy)
    out.loss.backward()
    assert [(p.schedule, p.chunks, p.grad_mode) for p in plans] == [("token", 4, GradMode.IN_FORWARD)]
    # (each chunk holds one head's rows: its statistics, loss and gradient come out of one pass)
    loss, head_losses, acceptance, grads = reference(case)
    assert rel_err(out.loss, loss) < 1e-12 and rel_err(out.head_losses, head_losses) < 1e-12
    assert torch.equal(out.acceptance, acceptance) and acceptance.sum() > 0
    assert max(rel_err(x.grad, g) for x, g in zip(hs + [w, b], grads)) < 1e-12


def test_runs_under_torch_compile_as_a_graph_break():
    hiddens, w, _, labels, pos = make_case(8, depths=1, bias=False)
    wl = w.clone().requires_grad_()

    def step(hs, weight):
        out = vparallel_ce.linear_mtp_loss(hs, weight, labels, positions=pos)
        return 2 * out.loss, out.acceptance

    loss, acc = torch.compile(step, backend="eager")(hiddens, wl)
    loss.backward()
    want = vparallel_ce.linear_mtp_loss(hiddens, w, labels, positions=pos)
    assert torch.equal(loss, 2 * want.loss) and torch.equal(acc, want.acceptance)
    assert rel_err(wl.grad, 2 * reference((hiddens, w, None, labels, pos))[3][-1]) < 1e-12
