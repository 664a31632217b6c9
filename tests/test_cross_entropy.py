"""Specification of ``vparallel_ce.cross_entropy``: loss and logits gradient equal a float64
``F.cross_entropy`` on the gathered logits, on 1-4 gloo ranks with uneven vocab shards."""

from __future__ import annotations

import itertools

import pytest
import torch

import vparallel_ce
from tests.dist import errors_of, run_ranks
from tests.reference import TOL, local_grad, reference_loss, rel_err, shard

OPTIONS = [
    {},
    {"label_smoothing": 0.1},
    {"z_loss": 1e-3},
    {"softcap": 3.0},
    {"label_smoothing": 0.25, "z_loss": 1e-2, "softcap": 2.0, "ignore_index": 7},
]
REDUCTIONS = ["mean", "sum", "none"]
CHUNKS = [1, 3, "auto"]


def make_case(seed: int, tokens=(3, 7), vocab=37, ignore_frac=0.3, ignore_index=-100):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(*tokens, vocab, generator=g, dtype=torch.float64) * 4
    target = torch.randint(0, vocab, tokens, generator=g)
    target[torch.rand(tokens, generator=g) < ignore_frac] = ignore_index
    return logits, target


def check_case(rank, world, group, logits, target, dtype, opts, reduction, chunks):
    """Run the op on this rank's shard; return (loss error, grad error) vs the float64 reference."""
    full = logits.clone().requires_grad_()
    ref = reference_loss(full, target, reduction=reduction, **opts)
    weight = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    (ref * weight).sum().backward()
    mine = shard(logits, world, rank).to(dtype).clone().requires_grad_()
    out = vparallel_ce.cross_entropy(mine, target, group=group, reduction=reduction, chunks=chunks, **opts)
    assert out.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert out.shape == ref.shape
    (out * weight.to(out.dtype)).sum().backward()
    assert mine.grad.dtype == dtype
    return rel_err(out, ref), rel_err(mine.grad, shard(full.grad, world, rank), full.grad)


DTYPES = [torch.float64, torch.float32, torch.bfloat16]


def grid(world):
    """A covering subset of option set x reduction x chunks x dtype: every option x reduction x
    dtype triple once per world, its chunk count rotating with the world size, so each triple meets
    every chunk option over the TP degrees and each pair meets every chunk option at each degree
    (45 cases per call instead of 135)."""
    for (i, opts), (r, reduction), (d, dtype) in itertools.product(
        enumerate(OPTIONS), enumerate(REDUCTIONS), enumerate(DTYPES)
    ):
        yield i, opts, reduction, CHUNKS[(i + r + d + world) % len(CHUNKS)], dtype


def grid_rank(rank, world, vocab):
    """Every grid case on this rank: the failures (case named) and the worst error per dtype."""
    import torch.distributed as dist

    group = dist.group.WORLD if world > 1 else None
    worst, failures = {}, []
    for i, opts, reduction, chunks, dtype in grid(world):
        logits, target = make_case(i, vocab=vocab, ignore_index=opts.get("ignore_index", -100))
        loss_err, grad_err = check_case(rank, world, group, logits, target, dtype, opts, reduction, chunks)
        worst[str(dtype)] = max(worst.get(str(dtype), 0.0), loss_err, grad_err)
        if not (loss_err < TOL[dtype] and grad_err < TOL[dtype]):  # NaN fails
            failures.append(f"rank {rank}/{world} V={vocab} {opts} reduction={reduction} chunks={chunks} "
                            f"{dtype}: loss error {loss_err:.3g}, grad error {grad_err:.3g} (tol {TOL[dtype]:.0e})")
    return worst, failures


@pytest.mark.parametrize("world,vocab", [(1, 37), (2, 37), (3, 37), (4, 37), (4, 5)])
def test_matches_float64_reference_for_every_option(world, vocab):
    # V=37 over 2/3/4 ranks gives uneven shards; V=5 over 4 ranks leaves the last rank empty
    results = run_ranks(grid_rank, world, vocab) if world > 1 else [grid_rank(0, 1, vocab)]
    failures = [f for _, per_rank in results for f in per_rank]
    assert not failures, "\n".join(failures)
    for worst, _ in results:  # every dtype was checked
        assert sorted(worst) == sorted(str(d) for d in DTYPES), worst


def test_unsharded_call_equals_f_cross_entropy_exactly_for_float64():
    logits, target = make_case(0)
    out = vparallel_ce.cross_entropy(logits, target)
    expect = torch.nn.functional.cross_entropy(logits.reshape(-1, 37), target.reshape(-1))
    assert rel_err(out, expect) < 1e-14


def test_chunk_count_does_not_change_the_result():
    logits, target = make_case(3, tokens=(64,), vocab=50)
    x = logits.float()
    outs, grads = [], []
    for chunks in (1, 2, 5, 64):
        xi = x.clone().requires_grad_()
        out = vparallel_ce.cross_entropy(xi, target, chunks=chunks, label_smoothing=0.1)
        out.backward()
        outs.append(out)
        grads.append(xi.grad)
    for out, grad in zip(outs[1:], grads[1:]):
        assert rel_err(out, outs[0]) < 1e-6 and rel_err(grad, grads[0]) < 1e-6


def test_callers_logits_are_not_modified_and_all_ignored_mean_is_nan():
    logits, target = make_case(4)
    x = logits.float().requires_grad_()
    before = x.detach().clone()
    vparallel_ce.cross_entropy(x, target, chunks=2).backward()
    assert torch.equal(x.detach(), before)
    out = vparallel_ce.cross_entropy(x, torch.full_like(target, -100))
    assert torch.isnan(out)  # like F.cross_entropy: 0 / 0


# ---------------------------------------------------------------------------------------------
# Communication pattern


def count_collectives_rank(rank, world):
    import torch.distributed as dist

    import vparallel_ce.comm as comm

    calls = {"all_reduce": 0, "all_gather": 0}
    real = {name: getattr(comm.dist, name) for name in calls}

    def counting(name):
        def call(*args, **kwargs):
            calls[name] += 1
            return real[name](*args, **kwargs)

        return call

    logits, target = make_case(5, tokens=(10,), vocab=11)
    x = shard(logits, world, rank).float().requires_grad_()
    for name in calls:
        setattr(comm.dist, name, counting(name))
    try:
        loss = vparallel_ce.cross_entropy(x, target, group=dist.group.WORLD, chunks=3)
        forward = dict(calls)
        loss.backward()
        backward = {k: calls[k] - forward[k] for k in calls}
    finally:
        for name in calls:
            setattr(comm.dist, name, real[name])
    return forward, backward


def test_two_all_reduces_per_chunk_and_no_collective_in_backward():
    for forward, backward in run_ranks(count_collectives_rank, 2):
        assert forward == {"all_reduce": 2 * 3, "all_gather": 1}  # MAX + SUM per chunk; one size exchange
        assert backward == {"all_reduce": 0, "all_gather": 0}


# ---------------------------------------------------------------------------------------------
# DTensor input and PyTorch's loss_parallel


def dtensor_rank(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import loss_parallel

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    logits, target = make_case(6, tokens=(4, 5), vocab=23, ignore_frac=0.2)
    results = {}
    for label_smoothing in (0.0, 0.1):
        full = logits.clone().requires_grad_()
        ref = reference_loss(full, target, label_smoothing=label_smoothing)
        ref.backward()
        dt = distribute_tensor(logits.clone(), mesh, [Shard(-1)]).requires_grad_()
        out = vparallel_ce.cross_entropy(dt, target, label_smoothing=label_smoothing, chunks=2)
        out.backward()
        assert not isinstance(out, type(dt)), "documented: a plain tensor comes back"
        results[f"ours ls={label_smoothing}"] = (
            rel_err(out, ref), rel_err(local_grad(dt), shard(full.grad, world, rank))
        )
    # PyTorch's own loss_parallel (no label smoothing support there): same numbers
    dt = distribute_tensor(logits.clone(), mesh, [Shard(-1)]).requires_grad_()
    with loss_parallel():
        theirs = torch.nn.functional.cross_entropy(dt.flatten(0, 1), distribute_tensor(target.flatten(), mesh, [Replicate()]))
        theirs.backward()
    ours_dt = distribute_tensor(logits.clone(), mesh, [Shard(-1)]).requires_grad_()
    ours = vparallel_ce.cross_entropy(ours_dt, target)
    ours.backward()
    theirs_full = theirs.full_tensor() if hasattr(theirs, "full_tensor") else theirs
    results["vs loss_parallel"] = (rel_err(ours, theirs_full), rel_err(local_grad(ours_dt), local_grad(dt)))
    return results


@pytest.mark.parametrize("world", [2, 4])
def test_dtensor_logits_match_reference_and_loss_parallel(world):
    for results in run_ranks(dtensor_rank, world):
        for name, (loss_err, grad_err) in results.items():
            assert loss_err < 1e-12 and grad_err < 1e-12, (name, loss_err, grad_err)


# ---------------------------------------------------------------------------------------------
# Bad input: a clear error, raised on EVERY rank (never a hang, never a garbage loss)


def _bad_calls(rank, world, group):
    logits, target = make_case(7, tokens=(6,), vocab=13)
    x = shard(logits, world, rank).float()
    other = target.clone()
    other[0] = 13  # one past the vocab
    negative = target.clone()
    negative[1] = -5
    return {
        "target shape": lambda: vparallel_ce.cross_entropy(x, target[:5], group=group),
        "float target": lambda: vparallel_ce.cross_entropy(x, target.float(), group=group),
        "integer logits": lambda: vparallel_ce.cross_entropy(x.long(), target, group=group),
        "reduction": lambda: vparallel_ce.cross_entropy(x, target, group=group, reduction="avg"),
        "label_smoothing": lambda: vparallel_ce.cross_entropy(x, target, group=group, label_smoothing=1.5),
        "chunks": lambda: vparallel_ce.cross_entropy(x, target, group=group, chunks=0),
        "target out of range": lambda: vparallel_ce.cross_entropy(x, other, group=group),
        "negative target": lambda: vparallel_ce.cross_entropy(x, negative, group=group),
        "only rank 1 has a bad shape": lambda: vparallel_ce.cross_entropy(
            x, target[: 5 if rank == 1 else 6], group=group),
        "vocab_size does not add up": lambda: vparallel_ce.cross_entropy(x, target, group=group, vocab_size=14),
        "ranks pass different tokens": lambda: vparallel_ce.cross_entropy(
            x, target if rank else (target + 1) % 13, group=group),
        "ranks pass different chunks": lambda: vparallel_ce.cross_entropy(x, target, group=group, chunks=1 + rank),
        "ranks pass different reductions": lambda: vparallel_ce.cross_entropy(
            x, target, group=group, reduction="sum" if rank else "mean"),
        "ranks pass different policies": lambda: vparallel_ce.cross_entropy(
            x, target, group=group, policy=vparallel_ce.ChunkPolicy(budget_bytes=4096 * (rank + 1))),
        "policy is not a ChunkPolicy": lambda: vparallel_ce.cross_entropy(
            x, target, group=group, policy=None if rank else {"budget_bytes": 4096}),
        "full logits on every rank": lambda: vparallel_ce.cross_entropy(
            logits.float(), target, group=group, vocab_size=13),
    }


def bad_input_rank(rank, world):
    import torch.distributed as dist

    return errors_of(_bad_calls(rank, world, dist.group.WORLD))


EXPECTED_MESSAGES = {
    "target shape": "target shape",
    "float target": "integer class ids",
    "integer logits": "floating-point",
    "reduction": "reduction must be",
    "label_smoothing": "label_smoothing must be",
    "chunks": "chunks must be",
    "target out of range": "outside [0, 13)",
    "negative target": "outside [0, 13)",
    "only rank 1 has a bad shape": "",
    "vocab_size does not add up": "add up to",
    "ranks pass different tokens": "disagree on target checksum",
    "ranks pass different chunks": "disagree on chunks: rank 0: 1, rank 1: 2",
    "ranks pass different reductions": "disagree on reduction",
    "ranks pass different policies": "disagree on chunk policy",
    "policy is not a ChunkPolicy": "",
    "full logits on every rank": "add up to",
}


@pytest.mark.parametrize("world", [2, 3])
def test_bad_input_raises_a_clear_error_on_every_rank(world):
    results = run_ranks(bad_input_rank, world, timeout=120)
    for rank, errors in enumerate(results):
        for name, expected in EXPECTED_MESSAGES.items():
            assert errors[name] is not None, f"rank {rank} did not raise for {name!r}"
            assert expected in errors[name], (name, errors[name])
    # the rank with the bad input names the problem; the others point at it
    assert "target shape" in results[1]["only rank 1 has a bad shape"]
    assert "rank(s) 1: target shape" in results[0]["only rank 1 has a bad shape"]
    assert "policy must be a vparallel_ce.ChunkPolicy" in results[0]["policy is not a ChunkPolicy"]
    assert "rank(s) 0: policy must be" in results[1]["policy is not a ChunkPolicy"]


def dtensor_bad_rank(rank, world):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    logits, target = make_case(8, tokens=(6,), vocab=13)
    # a 2-D mesh (dp, tp) with the vocab sharded over tp works ...
    good = distribute_tensor(logits, mesh, [Replicate(), Shard(-1)]).requires_grad_()
    full = logits.clone().requires_grad_()
    reference_loss(full, target).backward()
    vparallel_ce.cross_entropy(good, target).backward()
    errors = {"2-D mesh grad error": rel_err(local_grad(good), shard(full.grad, world // 2, rank % (world // 2)))}
    cases = {
        "not sharded on the last dim": lambda: vparallel_ce.cross_entropy(
            distribute_tensor(logits, mesh, [Replicate(), Shard(0)]), target),
        "replicated": lambda: vparallel_ce.cross_entropy(
            distribute_tensor(logits, mesh, [Replicate(), Replicate()]), target),
        "group size disagrees": lambda: vparallel_ce.cross_entropy(good, target, group=dist.group.WORLD),
    }
    for name, call in cases.items():
        try:
            call()
            errors[name] = None
        except ValueError as exc:
            errors[name] = str(exc)
    return errors


def test_dtensor_on_a_2d_mesh_and_bad_dtensor_input_is_named():
    for errors in run_ranks(dtensor_bad_rank, 4):
        assert errors["2-D mesh grad error"] < 1e-12
        assert "must be Shard(1)" in errors["not sharded on the last dim"]
        assert "sharded on its last" in errors["replicated"]
        assert "group has 4 ranks" in errors["group size disagrees"]


def test_single_process_errors():
    logits, target = make_case(9, tokens=(4,), vocab=5)
    with pytest.raises(ValueError, match="outside"):
        vparallel_ce.cross_entropy(logits, torch.tensor([0, 1, 5, 2]))
    with pytest.raises(ValueError, match="vocab_size=6"):
        vparallel_ce.cross_entropy(logits, target, vocab_size=6)
    # check=False skips the target check (documented as a speed switch)
    vparallel_ce.cross_entropy(logits, target, check=False)


def unchecked_rank(rank, world):
    import torch.distributed as dist

    logits, target = make_case(10, tokens=(9,), vocab=17)
    full = logits.clone().requires_grad_()
    ref = reference_loss(full, target, reduction="sum")
    ref.backward()
    x = shard(logits, world, rank).clone().requires_grad_()
    out = vparallel_ce.cross_entropy(x, target, group=dist.group.WORLD, vocab_size=17, check=False, reduction="sum")
    out.backward()
    return rel_err(out, ref), rel_err(x.grad, shard(full.grad, world, rank))


def test_check_false_with_vocab_size_needs_no_size_exchange():
    for errs in run_ranks(unchecked_rank, 3):
        assert max(errs) < 1e-12


def test_no_full_fp32_copy_of_the_logits_when_chunked():
    """Peak extra memory is one chunk's fp32 working set plus the gradient buffer (in the logits'
    dtype): no fp32 tensor as large as the local logits is ever created, forward or backward."""
    from torch.utils._python_dispatch import TorchDispatchMode

    n, v = 64, 40
    logits, target = make_case(11, tokens=(n,), vocab=v)
    x = logits.bfloat16().requires_grad_()

    class Watch(TorchDispatchMode):
        largest_fp32 = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                    Watch.largest_fp32 = max(Watch.largest_fp32, t.numel())
            return out

    with Watch():
        vparallel_ce.cross_entropy(x, target, chunks=4, label_smoothing=0.1).backward()
    assert n * v // 4 <= Watch.largest_fp32 < n * v
    assert x.grad.dtype == torch.bfloat16


def test_all_ignored_mean_gives_zero_gradients_like_pytorch():
    # F.cross_entropy: loss 0/0 = nan, gradient exactly 0 -- a fully padded microbatch must not
    # poison the weights with nan gradients
    x = torch.randn(4, 7, dtype=torch.float64, requires_grad=True)
    vparallel_ce.cross_entropy(x, torch.full((4,), -100)).backward()
    assert torch.equal(x.grad, torch.zeros_like(x))
