"""Specification of ``vparallel_ce.linear_cross_entropy``: loss, dh, dW and db equal a float64
reference (``logits = h @ W.T + b`` on the full W, then ``F.cross_entropy``), on 1-4 gloo ranks with
uneven vocab shards, for both schedules, every option and reduction, and sequence parallelism."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import vparallel_ce
from tests.dist import run_ranks
from tests.reference import TOL, largest_tensor, local_grad, reference_loss, rel_err, shard

H = 8
OPTIONS = [{}, {"label_smoothing": 0.1, "z_loss": 1e-3}, {"softcap": 2.0, "ignore_index": 3}]
PLANS = [  # (schedule, recompute, chunks)
    ("token", False, 1), ("token", False, 4), ("token", True, 7), ("vocab", None, 1), ("vocab", None, 4),
    ("vocab", None, 7), ("auto", None, "auto"),
]


def make_case(seed, tokens=(3, 5), vocab=29, ignore_frac=0.3, ignore_index=-100, bias=True):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*tokens, H, generator=g, dtype=torch.float64)
    weight = torch.randn(vocab, H, generator=g, dtype=torch.float64)
    b = torch.randn(vocab, generator=g, dtype=torch.float64) if bias else None
    target = torch.randint(0, vocab, tokens, generator=g)
    target[torch.rand(tokens, generator=g) < ignore_frac] = ignore_index
    return hidden, weight, b, target


def reference(hidden, weight, bias, target, reduction, opts):
    """Loss and the float64 gradients of hidden, weight, bias for a fixed random upstream weight."""
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    b = None if bias is None else bias.clone().requires_grad_()
    logits = h @ w.T + (0 if b is None else b)
    ref = reference_loss(logits, target, reduction=reduction, **opts)
    up = torch.randn(ref.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    (ref * up).sum().backward()
    return ref, up, h.grad, w.grad, None if b is None else b.grad


def run_case(rank, world, group, case, dtype, opts, reduction, plan, sequence_parallel=False):
    hidden, weight, bias, target = case
    ref, up, dh_ref, dw_ref, db_ref = reference(hidden, weight, bias, target, reduction, opts)
    schedule, recompute, chunks = plan
    if reduction == "none" and recompute is False:  # gradients in forward need mean/sum (an error, tested below)
        recompute = None
    if sequence_parallel:  # tokens split over the group, torch.chunk layout on the flattened tokens
        h_in = shard(hidden.reshape(-1, H), world, rank, dim=0)
        t_in = shard(target.reshape(-1), world, rank, dim=0)
        dh_expect = shard(dh_ref.reshape(-1, H), world, rank, dim=0)
        ref_mine = shard(ref.reshape(-1), world, rank, dim=0) if reduction == "none" else ref
        up_mine = shard(up.reshape(-1), world, rank, dim=0) if reduction == "none" else up
    else:
        h_in, t_in, dh_expect, ref_mine, up_mine = hidden, target, dh_ref, ref, up
    h = h_in.to(dtype).clone().requires_grad_()
    w = shard(weight, world, rank, dim=0).to(dtype).clone().requires_grad_()
    b = None if bias is None else shard(bias, world, rank, dim=0).to(dtype).clone().requires_grad_()
    out = vparallel_ce.linear_cross_entropy(
        h, w, t_in, b, group=group, sequence_parallel=sequence_parallel, reduction=reduction,
        chunks=chunks, schedule=schedule, recompute=recompute, **opts,
    )
    assert out.shape == ref_mine.shape
    (out * up_mine.to(out.dtype)).sum().backward()
    assert h.grad.dtype == w.grad.dtype == dtype
    errs = [rel_err(out, ref_mine, ref), rel_err(h.grad, dh_expect, dh_ref),
            rel_err(w.grad, shard(dw_ref, world, rank, 0), dw_ref)]
    if b is not None:
        errs.append(rel_err(b.grad, shard(db_ref, world, rank, 0), db_ref))
    return max(errs)


REDUCTIONS = ["mean", "sum", "none"]
DTYPES = [torch.float64, torch.bfloat16]


def grid(world):
    """A covering subset of option set x reduction x plan x dtype: every reduction x plan x dtype
    triple once per call, its option set rotating with the world size, so each triple meets every
    option set over the TP degrees and each pair meets every option set at each degree (42 cases
    per call instead of 126)."""
    for (r, reduction), (p, plan), (d, dtype) in itertools.product(
        enumerate(REDUCTIONS), enumerate(PLANS), enumerate(DTYPES)
    ):
        i = (r + p + d + world) % len(OPTIONS)
        yield i, OPTIONS[i], reduction, plan, dtype


def grid_rank(rank, world, vocab, sequence_parallel):
    """Every grid case on this rank: the failures (case named) and the worst error per dtype."""
    import torch.distributed as dist

    group = dist.group.WORLD if world > 1 else None
    worst, failures = {}, []
    for i, opts, reduction, plan, dtype in grid(world):
        case = make_case(i, vocab=vocab, ignore_index=opts.get("ignore_index", -100), bias=i != 1)
        err = run_case(rank, world, group, case, dtype, opts, reduction, plan, sequence_parallel)
        worst[str(dtype)] = max(worst.get(str(dtype), 0.0), err)
        if not err < TOL[dtype]:  # NaN fails
            failures.append(f"rank {rank}/{world} V={vocab} sp={sequence_parallel} {opts}{'' if i != 1 else ' no bias'} "
                            f"reduction={reduction} plan={plan} {dtype}: error {err:.3g} (tol {TOL[dtype]:.0e})")
    return worst, failures


@pytest.mark.parametrize(
    "world,vocab,sp", [(1, 29, False), (2, 29, False), (3, 29, False), (4, 29, False), (4, 3, False),
                       (2, 29, True), (3, 29, True)],
)
def test_matches_float64_reference(world, vocab, sp):
    # V=29 is uneven over 2/3/4 ranks; V=3 over 4 ranks leaves the last rank without a shard;
    # 15 tokens over 2 or 3 ranks with sequence parallelism gives uneven token shards too
    results = run_ranks(grid_rank, world, vocab, sp) if world > 1 else [grid_rank(0, 1, vocab, sp)]
    failures = [f for _, per_rank in results for f in per_rank]
    assert not failures, "\n".join(failures)
    for worst, _ in results:  # every dtype was checked
        assert sorted(worst) == sorted(str(d) for d in DTYPES), worst


def odd_width_rank(rank, world):
    """Shards wider than 128 whose width is not a multiple of 8 take the aligned-main + tail path."""
    import torch.distributed as dist

    group = dist.group.WORLD if world > 1 else None
    worst = 0.0
    for plan, reduction, sp in itertools.product(PLANS, ["mean", "none"], [False, True] if world > 1 else [False]):
        case = make_case(12, tokens=(2, 9), vocab=301)
        worst = max(worst, run_case(rank, world, group, case, torch.float64, {"label_smoothing": 0.1}, reduction,
                                    plan, sp))
    return worst


@pytest.mark.parametrize("world", [1, 2])
def test_odd_shard_widths_split_into_aligned_parts_match_the_reference(world):
    # V=301: one rank holds 301 (128-aligned main 256 + tail 45), two ranks hold 151 and 150
    from vparallel_ce.layout import aligned_parts

    assert aligned_parts(301) == [slice(0, 256), slice(256, 301)] and aligned_parts(256) == [slice(0, 256)]
    results = run_ranks(odd_width_rank, world) if world > 1 else [odd_width_rank(0, 1)]
    assert max(results) < 1e-10


def bf16_drift_rank(rank, world):
    import torch.distributed as dist

    g = torch.Generator().manual_seed(11)
    n, hsz, v = 512, 64, 96
    # inputs exactly representable in bf16, so the error measured is the op's own arithmetic
    hidden = torch.randn(n, hsz, generator=g, dtype=torch.float64).bfloat16().double()
    weight = (torch.randn(v, hsz, generator=g, dtype=torch.float64) * 0.3).bfloat16().double()
    target = torch.randint(0, v, (n,), generator=g)
    _, _, _, dw_ref, _ = reference(hidden, weight, None, target, "sum", {})
    dw_ref = shard(dw_ref, world, rank, 0)
    errors = {}
    for schedule, chunks in itertools.product(["token", "vocab"], [1, 32]):
        h = hidden.bfloat16().requires_grad_()
        w = shard(weight, world, rank, 0).bfloat16().requires_grad_()
        out = vparallel_ce.linear_cross_entropy(
            h, w, target, group=dist.group.WORLD, chunks=chunks, schedule=schedule, recompute=False, reduction="sum")
        (out * up_scalar()).backward()
        errors[(schedule, chunks)] = rel_err(w.grad, dw_ref)
    return errors


def up_scalar():
    return torch.tensor(torch.randn((), generator=torch.Generator().manual_seed(2), dtype=torch.float64).item())


def test_bf16_weight_grad_error_does_not_grow_with_chunks():
    for errors in run_ranks(bf16_drift_rank, 2):
        for schedule in ("token", "vocab"):
            one, many = errors[(schedule, 1)], errors[(schedule, 32)]
            # bf16 level (logits and dW rounded once), and no growth from 1 to 32 chunks; summing
            # the 32 per-chunk contributions in bf16 instead would add ~sqrt(32) roundings
            assert one < 1e-2 and many <= 1.1 * one, (schedule, one, many)


def test_no_tensor_as_large_as_the_local_logits_when_chunked():
    n, v = 64, 40
    hidden, weight, bias, target = make_case(5, tokens=(n,), vocab=v)
    for schedule, recompute in (("token", False), ("token", True), ("vocab", None)):
        h, w = hidden.float().requires_grad_(), weight.float().requires_grad_()
        largest = largest_tensor(lambda: vparallel_ce.linear_cross_entropy(
            h, w, target, chunks=4, schedule=schedule, recompute=recompute).backward())
        assert largest < n * v, (schedule, largest)
        assert largest >= n * v // 4  # one chunk of logits did exist: the watch works


def test_bad_input_is_named():
    hidden, weight, bias, target = make_case(6)
    f = vparallel_ce.linear_cross_entropy
    with pytest.raises(ValueError, match="does not match weight's hidden size"):
        f(hidden[..., :5], weight, target)
    with pytest.raises(TypeError, match="dtypes differ .* torch.autocast"):
        f(hidden.float(), weight, target)
    with pytest.raises(ValueError, match="bias must be"):
        f(hidden, weight, target, bias[:3])
    with pytest.raises(ValueError, match="target shape"):
        f(hidden, weight, target[:, :2])
    with pytest.raises(ValueError, match="schedule must be"):
        f(hidden, weight, target, schedule="rows")
    with pytest.raises(ValueError, match="recompute=False .* needs reduction 'mean' or 'sum'"):
        f(hidden, weight, target, reduction="none", recompute=False)
    with pytest.raises(ValueError, match="outside"):
        f(hidden, weight, torch.full_like(target, 29))
    with pytest.raises(ValueError, match=r"weight must be \[V_local, H\]"):
        f(hidden, weight[0], target)


def dtensor_rank(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    hidden, weight, bias, target = make_case(7, bias=False)
    ref, up, dh_ref, dw_ref, _ = reference(hidden, weight, None, target, "mean", {})
    w = distribute_tensor(weight.clone(), mesh, [Shard(0)]).requires_grad_()
    h = distribute_tensor(hidden.clone(), mesh, [Replicate()]).requires_grad_()
    out = vparallel_ce.linear_cross_entropy(h, w, target, chunks=2)
    (out * up).backward()
    errs = [rel_err(out, ref), rel_err(local_grad(w), shard(dw_ref, world, rank, 0)), rel_err(local_grad(h), dh_ref)]
    # sequence parallel: hidden is a DTensor sharded on its token dim, target split the same way
    hs = distribute_tensor(hidden.clone(), mesh, [Shard(1)]).requires_grad_()
    w2 = distribute_tensor(weight.clone(), mesh, [Shard(0)]).requires_grad_()
    t_local = torch.chunk(target, world, dim=1)[rank]
    out = vparallel_ce.linear_cross_entropy(hs, w2, t_local, sequence_parallel=True, chunks=2)
    (out * up).backward()
    errs += [rel_err(out, ref), rel_err(local_grad(w2), shard(dw_ref, world, rank, 0), dw_ref),
             rel_err(local_grad(hs), torch.chunk(dh_ref, world, dim=1)[rank], dh_ref)]
    try:
        vparallel_ce.linear_cross_entropy(hidden, distribute_tensor(weight, mesh, [Shard(1)]), target)
        message = None
    except ValueError as exc:
        message = str(exc)
    return errs, message


def test_dtensor_weight_and_hidden():
    for errs, message in run_ranks(dtensor_rank, 2):
        assert max(errs) < 1e-12, errs
        assert "must be Shard(0)" in message


def test_runs_under_torch_compile():
    hidden, weight, bias, target = make_case(8)
    h, w = hidden.float().requires_grad_(), weight.float().requires_grad_()
    compiled = torch.compile(lambda h, w: vparallel_ce.linear_cross_entropy(h, w, target, chunks=3), backend="eager")
    ref, up, dh_ref, dw_ref, _ = reference(hidden, weight, None, target, "mean", {})
    (compiled(h, w) * up.float()).backward()
    assert rel_err(h.grad, dh_ref.float()) < 1e-4 and rel_err(w.grad, dw_ref.float()) < 1e-4


def unchecked_rank(rank, world):
    import torch.distributed as dist

    hidden, weight, bias, target = make_case(13, vocab=23)
    ref, up, dh_ref, dw_ref, db_ref = reference(hidden, weight, bias, target, "sum", {})
    h = hidden.clone().requires_grad_()
    w = shard(weight, world, rank, 0).clone().requires_grad_()
    b = shard(bias, world, rank, 0).clone().requires_grad_()
    out = vparallel_ce.linear_cross_entropy(h, w, target, b, group=dist.group.WORLD, vocab_size=23, check=False,
                                            reduction="sum", chunks=2)
    (out * up).backward()
    return max(rel_err(out, ref), rel_err(h.grad, dh_ref), rel_err(w.grad, shard(dw_ref, world, rank, 0), dw_ref),
               rel_err(b.grad, shard(db_ref, world, rank, 0), db_ref))


def test_check_false_with_vocab_size():
    assert max(run_ranks(unchecked_rank, 3)) < 1e-12


class _Launches(TorchDispatchMode):
    """The ATen ops an op dispatches, in order."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def count_matmuls(fn):
    """Matrix products run by ``fn()`` (forward and backward), counted at the dispatcher."""
    with _Launches() as seen:
        fn()
    return sum(name in ("mm", "addmm", "addmm_", "bmm", "baddbmm") for name in seen.ops)


@pytest.mark.parametrize("chunks,matmuls", [(1, 3), (4, 12)])
def test_an_integer_chunk_count_means_token_chunks_with_three_matmuls_each(chunks, matmuls):
    # chunks=1 is "don't chunk": the 3-matmul fast point (the logits kept for the backward), never the
    # vocab schedule; several token chunks make their gradients in forward
    hidden, weight, _, target = make_case(14, tokens=(4, 16), vocab=64)
    h, w = hidden.float().requires_grad_(), weight.float().requires_grad_()
    assert count_matmuls(lambda: vparallel_ce.linear_cross_entropy(h, w, target, chunks=chunks).backward()) == matmuls
    plan = vparallel_ce.policy.choose_plan(64, 64, hidden_size=H, chunks=chunks)
    assert (plan.schedule, plan.chunks, plan.grad_in_forward, plan.keep_logits) == ("token", chunks, chunks > 1,
                                                                                    chunks == 1)


def test_the_vocab_schedule_only_when_asked_for_or_chosen_by_the_policy():
    hidden, weight, _, target = make_case(15, tokens=(4, 16), vocab=64)
    h, w = hidden.float().requires_grad_(), weight.float().requires_grad_()
    # 2 blocks: statistics (2 matmuls), then per block recompute + dh + dW (6)
    assert count_matmuls(lambda: vparallel_ce.linear_cross_entropy(
        h, w, target, chunks=2, schedule="vocab").backward()) == 8
    # recompute=True is the one switch for "gradients in backward": 1 + 3 matmuls per token chunk
    assert count_matmuls(lambda: vparallel_ce.linear_cross_entropy(
        h, w, target, chunks=2, recompute=True).backward()) == 8


def test_per_token_losses_keep_the_one_chunk_of_logits_and_a_second_backward_recomputes():
    # reduction="none" has its upstream gradient only in backward: with one chunk the forward keeps
    # the logits (3 matmuls, not 4); the gradient overwrites them, so a second backward of the same
    # graph (zero-bubble pipeline schedules run input and weight passes apart) must recompute
    hidden, weight, bias, target = make_case(16, tokens=(4, 16), vocab=64)
    h, w = hidden.requires_grad_(), weight.requires_grad_()
    up = torch.randn(target.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3))

    def twice():
        out = vparallel_ce.linear_cross_entropy(h, w, target, chunks=1, reduction="none")
        first = torch.autograd.grad(out, (h, w), up, retain_graph=True)
        second = torch.autograd.grad(out, (h, w), up)
        return first, second

    assert count_matmuls(lambda: twice()) == 3 + 3  # 3, then the recompute + dh + dW
    first, second = twice()
    h2, w2 = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    expect = torch.autograd.grad(reference_loss(h2 @ w2.T, target, reduction="none"), (h2, w2), up)
    for got in (first, second):
        assert rel_err(got[0], expect[0]) < 1e-12 and rel_err(got[1], expect[1]) < 1e-12


def _counting_ops(monkeypatch) -> dict:
    """Calls of the reference ops' row passes (the CPU path), by name."""
    from vparallel_ce import kernels

    calls = {}
    for name in ("loss_stats_grad_", "local_stats", "grad_logits"):
        def counted(*args, _fn=getattr(kernels.TORCH_OPS, name), _name=name, **kwargs):
            calls[_name] = calls.get(_name, 0) + 1
            return _fn(*args, **kwargs)

        monkeypatch.setattr(kernels.TORCH_OPS, name, counted)
    return calls


@pytest.mark.parametrize("reduction,bias", [("mean", True), ("sum", False), ("none", False)])
def test_one_chunk_on_one_rank_makes_its_gradient_with_the_statistics_in_one_pass(monkeypatch, reduction, bias):
    # one chunk of a rank holding the whole vocab: the forward's statistics step also turns the kept
    # logits into their gradient for an upstream gradient of 1 (one pass over them, no second); the
    # backward applies the upstream gradient to [N, H] operands and runs the two gradient GEMMs only
    calls = _counting_ops(monkeypatch)
    hidden, weight, b0, target = make_case(18, tokens=(4, 16), vocab=64, bias=bias)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    b = None if b0 is None else b0.clone().requires_grad_()
    out = vparallel_ce.linear_cross_entropy(h, w, target, b, chunks=1, reduction=reduction)
    assert calls == {"loss_stats_grad_": 1}, calls
    ref, up, dh, dw, db = reference(hidden, weight, b0, target, reduction, {})
    assert count_matmuls(lambda: (out * up).sum().backward()) == 2
    assert calls == {"loss_stats_grad_": 1}, calls
    assert rel_err(out, ref) < 1e-12 and rel_err(h.grad, dh) < 1e-12 and rel_err(w.grad, dw) < 1e-12
    if bias:
        assert rel_err(b.grad, db) < 1e-12


def _one_chunk_on_a_group_rank(rank, world):
    import pytest as _pytest

    with _pytest.MonkeyPatch.context() as mp:
        calls = _counting_ops(mp)
        hidden, weight, _, target = make_case(19, tokens=(4, 16), vocab=64, bias=False)
        vparallel_ce.linear_cross_entropy(hidden, shard(weight, world, rank, 0).requires_grad_(), target, chunks=1,
                                          group=torch.distributed.group.WORLD).backward()
        return dict(calls)


def test_on_a_group_the_statistics_are_exchanged_before_the_gradient_pass():
    # a vocab shard needs the group's statistics before its gradient: two passes, as before
    for calls in run_ranks(_one_chunk_on_a_group_rank, 2):
        assert calls == {"local_stats": 1, "grad_logits": 1}, calls


def _policy_mismatch_rank(rank, world):
    hidden, weight, _, target = make_case(20, tokens=(4, 16), vocab=64, bias=False)
    try:  # a budget from each rank's own free memory, say: the chunk counts would differ and hang
        vparallel_ce.linear_cross_entropy(hidden, shard(weight, world, rank, 0), target,
                                          policy=vparallel_ce.ChunkPolicy(budget_bytes=(rank + 1) << 10),
                                          group=torch.distributed.group.WORLD)
    except ValueError as exc:
        return str(exc)
    return None


def test_ranks_with_different_chunk_policies_get_an_error_on_every_rank_not_a_hang():
    for error in run_ranks(_policy_mismatch_rank, 2, timeout=120):
        assert error is not None and "disagree on chunk policy" in error, error


def _bad_policy_rank(rank, world):
    hidden, weight, _, target = make_case(21, tokens=(4, 16), vocab=64, bias=False)
    policy = vparallel_ce.ChunkPolicy(memory_bytes=-1 if rank == 1 else None)  # say, a target from free memory
    try:
        vparallel_ce.linear_cross_entropy(hidden, shard(weight, world, rank, 0), target, policy=policy,
                                          group=torch.distributed.group.WORLD)
    except ValueError as exc:
        return str(exc)
    return None


def test_a_bad_policy_field_on_one_rank_raises_on_every_rank():
    errors = run_ranks(_bad_policy_rank, 2, timeout=120)
    assert errors[1] is not None and "ChunkPolicy.memory_bytes must be" in errors[1], errors
    assert errors[0] is not None and "invalid input on rank(s) 1: " in errors[0], errors


def _bad_target_rank(rank, world):
    hidden, weight, _, target = make_case(17, tokens=(4, 16), vocab=64)
    target[2, 3] = 64  # replicated over the group, as the op requires
    errors = []

    def call():
        try:
            vparallel_ce.linear_cross_entropy(hidden, shard(weight, world, rank, 0), target, chunks=2,
                                              group=torch.distributed.group.WORLD)
        except ValueError as exc:
            errors.append(str(exc))

    return count_matmuls(call), errors


def test_on_a_group_a_bad_target_raises_on_every_rank_before_any_matmul():
    # the range check rides on the call's one metadata exchange: no kernel of the op runs
    for rank, (matmuls, errors) in enumerate(run_ranks(_bad_target_rank, 2)):
        assert matmuls == 0, rank
        assert len(errors) == 1 and "outside [0, 64)" in errors[0] and "e.g. 64" in errors[0], (rank, errors)


@pytest.mark.parametrize("chunks,schedule", [(1, "token"), (2, "token"), (2, "vocab")])
def test_at_world_1_a_bad_target_raises_once_the_first_matmul_is_queued_and_before_a_value(chunks, schedule):
    # no exchange to ride on: the span's host read-back waits until the forward has queued its
    # matmuls (a read at the front door would first drain the GPU queue -- in a training step, the
    # model's whole forward), and the error still comes before the op returns anything
    from torch.utils._python_dispatch import TorchDispatchMode

    from vparallel_ce.target_check import DeferredTargetCheck

    hidden, weight, _, target = make_case(17, tokens=(4, 16), vocab=64)
    target[2, 3] = 64
    events, settle = [], DeferredTargetCheck.settle

    class Log(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ in ("mm", "addmm"):
                events.append("matmul")
            return func(*args, **(kwargs or {}))

    def logged_settle(self):
        events.append("settle")
        return settle(self)

    DeferredTargetCheck.settle = logged_settle
    try:
        with Log(), pytest.raises(ValueError, match=r"outside \[0, 64\).*e\.g\. 64") as raised:
            out = vparallel_ce.linear_cross_entropy(hidden, weight, target, chunks=chunks, schedule=schedule)
            events.append(f"returned {out}")
    finally:
        DeferredTargetCheck.settle = settle
    assert isinstance(raised.value, vparallel_ce.InvalidInputError)
    assert events and events[0] == "matmul" and events[-1] == "settle", events


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("op", ["cross_entropy", "linear_cross_entropy", "token_logprobs", "linear_token_logprobs"])
def test_on_cuda_the_deferred_target_check_raises_for_every_op_and_passes_good_targets(op):
    # the CUDA path of the world-1 check: span copied to pinned memory behind the queued kernels
    hidden, weight, _, target = make_case(5, tokens=(4, 16), vocab=64)
    h, w = hidden.float().cuda(), weight.float().cuda()
    fn = {
        "cross_entropy": lambda t: vparallel_ce.cross_entropy(h @ w.T, t),
        "linear_cross_entropy": lambda t: vparallel_ce.linear_cross_entropy(h, w, t),
        "token_logprobs": lambda t: vparallel_ce.token_logprobs(h @ w.T, t),
        "linear_token_logprobs": lambda t: vparallel_ce.linear_token_logprobs(h, w, t),
    }[op]
    good = target.cuda()
    assert torch.isfinite(fn(good)).all()
    for bad_id in (64, -3):
        bad = good.clone()
        bad[1, 2] = bad_id
        with pytest.raises(vparallel_ce.InvalidInputError, match=rf"outside \[0, 64\).*e\.g\. {bad_id}"):
            fn(bad)


def _deferred_cases(h, w, b=None):
    """op name -> fn(target) -> outputs, for each op whose world-1 target check can be deferred."""
    return {
        "cross_entropy": lambda t: (vparallel_ce.cross_entropy(h @ w.T, t, reduction="none"),),
        # a mean divided by the check's own count (NaN on a bad id) needs no masking pass; a sum
        # or a given divisor does
        "cross_entropy_mean": lambda t: (vparallel_ce.cross_entropy(h @ w.T, t),),
        "cross_entropy_sum": lambda t: (vparallel_ce.cross_entropy(h @ w.T, t, reduction="sum"),),
        "linear_cross_entropy": lambda t: (vparallel_ce.linear_cross_entropy(h, w, t, bias=b),),
        "linear_cross_entropy_one_chunk": lambda t: (vparallel_ce.linear_cross_entropy(h, w, t, chunks=1),),
        "linear_cross_entropy_chunks_sum": lambda t: (vparallel_ce.linear_cross_entropy(h, w, t, chunks=3,
                                                                                        reduction="sum"),),
        "linear_cross_entropy_num_valid": lambda t: (vparallel_ce.linear_cross_entropy(h, w, t, num_valid_tokens=5),),
        "linear_cross_entropy_vocab": lambda t: (vparallel_ce.linear_cross_entropy(h, w, t, schedule="vocab", chunks=2),),
        "token_logprobs": lambda t: vparallel_ce.token_logprobs(h @ w.T, t, with_entropy=True),
        "linear_token_logprobs": lambda t: vparallel_ce.linear_token_logprobs(h, w, t, with_entropy=True),
        "distillation_loss": lambda t: (vparallel_ce.distillation_loss(h @ w.T, (h @ w.T).detach().flip(-1), t,
                                                                       hard_weight=0.5),),
        "linear_distillation_loss": lambda t: (vparallel_ce.linear_distillation_loss(
            h, w, h.detach().flip(-1), w.detach().flip(0), t, hard_weight=0.5),),
    }


def _check_deferred_to_backward(h, w, b, good):
    for op, fn in _deferred_cases(h, w, b).items():
        with torch.no_grad():
            expected = fn(good)  # no backward follows: settled in forward
        outs = fn(good)
        for o, e in zip(outs, expected):
            assert torch.equal(o.detach(), e), f"{op}: a good target's values change when the check is deferred"
        sum(o.sum() for o in outs).backward()
        h.grad = w.grad = None
        bad = good.clone()
        bad.view(-1)[1] = w.shape[0]
        outs = fn(bad)  # no error yet: the forward never waits for the device
        assert all(torch.isnan(o).all() for o in outs), f"{op}: the forward's values are not all NaN for a bad id"
        with pytest.raises(vparallel_ce.InvalidInputError, match=rf"outside \[0, {w.shape[0]}\)"):
            sum(o.sum() for o in outs).backward()
        h.grad = w.grad = None


def test_when_the_check_would_wait_for_the_device_a_bad_target_gives_nan_and_the_backward_raises(monkeypatch):
    # on CUDA a host read of the span waits for the queue; with a backward to follow the forward
    # does not read it: NaN outputs (never a plausible number), and the backward raises once its
    # kernels are queued. Simulated here by making the CPU check report that it would wait.
    from vparallel_ce.target_check import DeferredTargetCheck

    monkeypatch.setattr(DeferredTargetCheck, "waits_on_device", property(lambda self: not self.settled))
    hidden, weight, bias, target = make_case(8, tokens=(4, 6), vocab=40)
    _check_deferred_to_backward(hidden.requires_grad_(), weight.requires_grad_(), bias, target)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_a_bad_target_gives_nan_in_forward_and_raises_in_backward():
    hidden, weight, bias, target = make_case(9, tokens=(4, 16), vocab=64)
    h, w = hidden.float().cuda().requires_grad_(), weight.float().cuda().requires_grad_()
    _check_deferred_to_backward(h, w, bias.float().cuda(), target.cuda())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_deferred_check_reuses_its_pinned_pair_only_once_settled():
    # the pinned span and its event are pooled (host time before the first GEMM); a check still
    # pending keeps its pair, so a later call's copy never lands in its buffer or vice versa
    from vparallel_ce.target_check import DeferredTargetCheck

    good = torch.tensor([1, 5, -100], device="cuda")
    bad = torch.tensor([1, 70, -100], device="cuda")
    first = DeferredTargetCheck(good, -100, 64)
    first.settle()
    pending = DeferredTargetCheck(bad, -100, 64)
    assert pending.span is None, "nothing is launched before the check's first use"
    pending.launch()
    assert pending.span is first.span, "a settled pair is reused"
    other = DeferredTargetCheck(good, -100, 64)
    other.launch()
    assert other.span is not pending.span, "a pending pair is not shared"
    with pytest.raises(vparallel_ce.InvalidInputError, match=r"e\.g\. 70"):
        pending.settle()
    other.settle()  # its own span: good
    again = DeferredTargetCheck(bad, -100, 64)  # settled unlaunched: launched then
    with pytest.raises(vparallel_ce.InvalidInputError, match=r"e\.g\. 70"):
        again.settle()


def test_an_option_seen_valid_is_still_checked_by_its_type():
    # check_options remembers the (name, type, value) it accepted; True == 1 == 1.0 in a set, but
    # chunks=True and temperature=True are not chunks=1 and temperature=1.0
    hidden, weight, _, target = make_case(6)
    vparallel_ce.linear_cross_entropy(hidden, weight, target, chunks=1)
    with pytest.raises(ValueError, match="chunks must be an int in \\[1, 2\\*\\*31\\] or 'auto', got True"):
        vparallel_ce.linear_cross_entropy(hidden, weight, target, chunks=True)
    vparallel_ce.linear_token_logprobs(hidden, weight, target, temperature=1.0)
    with pytest.raises(ValueError, match="temperature must be a finite positive number, got True"):
        vparallel_ce.linear_token_logprobs(hidden, weight, target, temperature=True)
    with pytest.raises(ValueError, match="policy must be a vparallel_ce.ChunkPolicy or None, got \\[1\\]"):
        vparallel_ce.linear_cross_entropy(hidden, weight, target, policy=[1])  # unhashable: checked as ever
    smoothing = torch.tensor(0.1)  # a tensor option is checked on every call: it can change in place
    vparallel_ce.linear_cross_entropy(hidden, weight, target, label_smoothing=smoothing)
    smoothing.fill_(2.0)
    with pytest.raises(ValueError, match="label_smoothing must be in \\[0, 1\\], got tensor\\(2.\\)"):
        vparallel_ce.linear_cross_entropy(hidden, weight, target, label_smoothing=smoothing)


def test_a_memory_target_runs_the_plan_the_policy_picks_and_matches_the_reference():
    # 256 tokens x V=512: one token chunk would peak at ~0.27 MB (bf16 model); a 0.1 MB target
    # takes vocab blocks (4 of 128 columns), whose loss and gradients are the reference's
    from vparallel_ce.policy import ChunkPolicy, choose_plan, peak_bytes

    hidden, weight, _, target = make_case(21, tokens=(4, 64), vocab=512, bias=False)
    policy = ChunkPolicy(memory_bytes=100_000)
    plan = choose_plan(256, 512, hidden_size=H, policy=policy)
    assert (plan.schedule, plan.chunks) == ("vocab", 4) and peak_bytes(plan, 256, 512, hidden_size=H) <= 100_000
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    assert count_matmuls(lambda: vparallel_ce.linear_cross_entropy(h, w, target, policy=policy).backward()) == 4 + 4 * 3
    ref, up, dh, dw, _ = reference(hidden, weight, None, target, "mean", {})
    h.grad = w.grad = None
    (vparallel_ce.linear_cross_entropy(h, w, target, policy=policy) * up).backward()
    assert rel_err(h.grad, dh) < 1e-12 and rel_err(w.grad, dw) < 1e-12


def _memory_target_rank(rank, world):
    from vparallel_ce.policy import ChunkPolicy, choose_plan

    hidden, weight, _, target = make_case(22, tokens=(4, 64), vocab=512, bias=False)
    policy = ChunkPolicy(memory_bytes=80_000)  # one token chunk of a 256-column shard: ~0.14 MB
    plan = choose_plan(256, 512, world, hidden_size=H, policy=policy)
    h, w = hidden.clone().requires_grad_(), shard(weight, world, rank, 0).clone().requires_grad_()
    out = vparallel_ce.linear_cross_entropy(h, w, target, group=torch.distributed.group.WORLD, policy=policy)
    ref, up, dh, dw, _ = reference(hidden, weight, None, target, "mean", {})
    (out * up).backward()
    errs = rel_err(out, ref), rel_err(h.grad, dh), rel_err(w.grad, shard(dw, world, rank, 0))
    return (plan.schedule, plan.chunks), *errs


def test_a_memory_target_on_a_group_runs_vocab_blocks_that_match_the_reference():
    for (plan, *errs) in run_ranks(_memory_target_rank, 2):
        assert plan == ("vocab", 2), plan
        assert max(errs) < 1e-12, errs


# ops that launch no kernel: views and allocations
_NO_KERNEL = {"t", "slice", "detach", "empty", "empty_like", "view", "_unsafe_view", "reshape", "as_strided", "alias",
              "select", "expand", "unsqueeze", "squeeze", "transpose"}


@pytest.mark.parametrize("op,chunks", [("linear_cross_entropy", 1), ("linear_cross_entropy", 3),
                                       ("linear_distillation_loss", "auto"), ("linear_distillation_loss", 3)])
def test_at_world_1_a_linear_op_launches_its_first_gemm_before_any_other_kernel(op, chunks):
    # from an idle GPU, host time before the first GEMM is time the GPU waits: the target check's
    # kernel (span, flag, valid count), the mean's divisor and the chunk's target maps come after it
    hidden, weight, _, target = make_case(13, tokens=(4, 6), vocab=40)
    h, w = hidden.requires_grad_(), weight.requires_grad_()
    teacher_h, teacher_w = hidden.detach().flip(-1), weight.detach().flip(0)
    with _Launches() as seen:
        if op == "linear_cross_entropy":
            vparallel_ce.linear_cross_entropy(h, w, target, chunks=chunks)
        else:
            vparallel_ce.linear_distillation_loss(h, w, teacher_h, teacher_w, target, chunks=chunks)
    first = next(i for i, name in enumerate(seen.ops) if name in ("mm", "addmm", "linear"))
    early = [name for name in seen.ops[:first] if name not in _NO_KERNEL]
    assert not early, f"{op} chunks={chunks}: kernels before the first GEMM: {early}"
    assert any(name in ("aminmax", "min", "max") for name in seen.ops[first:]), \
        f"{op} chunks={chunks}: the target check did not run: {seen.ops}"
