"""Specification of ``linear_cross_entropy`` inside ``torch.autocast`` (AMP training, fp32 master
weights): it behaves like ``F.cross_entropy(F.linear(hidden, weight, bias).float(), target)`` does
there -- matmuls in the autocast dtype, statistics in fp32, every gradient in its input's own dtype.

The float64 reference of that computation is the loss of the inputs rounded to the autocast dtype
(what the region's casts do), in float64; our result differs from it only by the rounding of the
logits to the autocast dtype, so the bf16/fp16 tolerance applies. Every schedule, chunk count, TP
degree 1-3 with uneven shards, sequence parallelism and DTensor input; CPU autocast here, CUDA
autocast in the GPU test at the end.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

import vparallel_ce
from tests.dist import run_ranks
from tests.reference import TOL, local_grad, rel_err, shard
from tests.test_linear import OPTIONS, PLANS, make_case, reference

AMP_DTYPES = [torch.bfloat16, torch.float16]
TOL_AMP = {torch.bfloat16: TOL[torch.bfloat16], torch.float16: 5e-3}


def rounded(t, dtype):
    """``t`` as the autocast region's cast sees it, back in float64."""
    return None if t is None else t.to(dtype).double()


def amp_case(rank, world, group, case, amp, opts, reduction, plan, sequence_parallel, hidden_dtype, device="cpu"):
    """Worst relative error of loss, dh, dW, db against the float64 reference of the autocast
    computation; also checks that each gradient has its input's dtype."""
    hidden, weight, bias, target = case
    ref, up, dh_ref, dw_ref, db_ref = reference(rounded(hidden, amp), rounded(weight, amp), rounded(bias, amp),
                                                target, reduction, opts)
    schedule, recompute, chunks = plan
    if reduction == "none" and recompute is False:
        recompute = None
    if sequence_parallel:
        h_in = shard(hidden.reshape(-1, hidden.shape[-1]), world, rank, dim=0)
        t_in = shard(target.reshape(-1), world, rank, dim=0)
        dh_expect = shard(dh_ref.reshape(-1, hidden.shape[-1]), world, rank, dim=0)
        ref_mine = shard(ref.reshape(-1), world, rank, dim=0) if reduction == "none" else ref
        up_mine = shard(up.reshape(-1), world, rank, dim=0) if reduction == "none" else up
    else:
        h_in, t_in, dh_expect, ref_mine, up_mine = hidden, target, dh_ref, ref, up
    h = h_in.to(device, hidden_dtype).requires_grad_()
    w = shard(weight, world, rank, dim=0).to(device, torch.float32).requires_grad_()  # fp32 master weight
    b = None if bias is None else shard(bias, world, rank, dim=0).to(device, torch.float32).requires_grad_()
    with torch.autocast(device, dtype=amp):
        out = vparallel_ce.linear_cross_entropy(
            h, w, t_in.to(device), b, group=group, sequence_parallel=sequence_parallel, reduction=reduction,
            chunks=chunks, schedule=schedule, recompute=recompute, **opts)
    assert out.dtype == torch.float32 and out.shape == ref_mine.shape
    (out * up_mine.to(device, out.dtype)).sum().backward()
    assert h.grad.dtype == hidden_dtype and w.grad.dtype == torch.float32, (h.grad.dtype, w.grad.dtype)
    errs = [rel_err(out.cpu(), ref_mine, ref), rel_err(h.grad.cpu(), dh_expect, dh_ref),
            rel_err(w.grad.cpu(), shard(dw_ref, world, rank, 0), dw_ref)]
    if b is not None:
        assert b.grad.dtype == torch.float32
        errs.append(rel_err(b.grad.cpu(), shard(db_ref, world, rank, 0), db_ref))
    return max(errs)


def amp_grid_rank(rank, world, sequence_parallel):
    import torch.distributed as dist

    group = dist.group.WORLD if world > 1 else None
    worst = {}
    # a covering subset: every reduction x plan x autocast dtype x hidden dtype once per call, the
    # option set rotating with the world size, so each of them meets every option set over the TP
    # degrees and each single choice meets every option set at each degree (56 cases, not 168)
    grid = itertools.product(enumerate(["mean", "none"]), enumerate(PLANS), enumerate(AMP_DTYPES),
                             enumerate([torch.float32, "amp"]))
    for (r, reduction), (p, plan), (a, amp), (d, hidden_dtype) in grid:
        i = (r + p + a + d + world) % len(OPTIONS)
        opts = OPTIONS[i]
        case = make_case(20 + i, ignore_index=opts.get("ignore_index", -100), bias=i != 1)
        hidden_dtype = amp if hidden_dtype == "amp" else hidden_dtype  # AMP models hand the loss amp hidden states
        err = amp_case(rank, world, group, case, amp, opts, reduction, plan, sequence_parallel, hidden_dtype)
        key = f"{amp} hidden={hidden_dtype}"
        if err > worst.get(key, (0.0, None))[0]:
            worst[key] = (err, f"opts={opts} reduction={reduction} plan={plan}")
    return worst


@pytest.mark.parametrize("world,sp", [(1, False), (2, False), (3, False), (2, True), (3, True)])
def test_autocast_matches_the_float64_reference_of_the_autocast_computation(world, sp):
    results = run_ranks(amp_grid_rank, world, sp) if world > 1 else [amp_grid_rank(0, 1, sp)]
    for rank, worst in enumerate(results):
        for key, (err, case) in worst.items():
            amp = torch.bfloat16 if "bfloat16" in key.split()[0] else torch.float16
            assert err < TOL_AMP[amp], f"rank {rank}, {key}: error {err:.2e} at {case}"


def test_autocast_equals_what_torch_does_with_the_plain_loss_there():
    hidden, weight, bias, target = make_case(30, tokens=(6, 7), vocab=40)
    grads = {}
    for name in ("plain", "ours"):
        h = hidden.float().requires_grad_()
        w, b = weight.float().requires_grad_(), bias.float().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if name == "plain":
                loss = F.cross_entropy(F.linear(h, w, b).float().flatten(0, 1), target.flatten())
            else:
                loss = vparallel_ce.linear_cross_entropy(h, w, target, b, chunks=2)
        loss.backward()
        grads[name] = (loss.detach(), h.grad, w.grad, b.grad)
    for plain, ours in zip(grads["plain"], grads["ours"]):
        assert ours.dtype == plain.dtype
        assert rel_err(ours, plain) < 1e-2, rel_err(ours, plain)


def test_mismatched_dtypes_outside_autocast_name_the_fix():
    hidden, weight, _, target = make_case(31)
    with pytest.raises(TypeError, match=r"dtypes differ \(hidden torch.bfloat16, weight torch.float32\).*torch.autocast"):
        vparallel_ce.linear_cross_entropy(hidden.bfloat16(), weight.float(), target)


def test_cross_entropy_inside_autocast_is_fp32():
    hidden, weight, _, target = make_case(32)
    logits = (hidden @ weight.T).bfloat16().requires_grad_()
    expect = F.cross_entropy(logits.double().flatten(0, 1), target.flatten())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = vparallel_ce.cross_entropy(logits, target, chunks=2)
    out.backward()
    assert out.dtype == torch.float32 and logits.grad.dtype == torch.bfloat16
    assert rel_err(out, expect) < 1e-6


def dtensor_amp_rank(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    hidden, weight, _, target = make_case(33, bias=False)
    ref, up, dh_ref, dw_ref, _ = reference(rounded(hidden, torch.bfloat16), rounded(weight, torch.bfloat16), None,
                                           target, "mean", {})
    w = distribute_tensor(weight.float(), mesh, [Shard(0)]).requires_grad_()
    h = distribute_tensor(hidden.float(), mesh, [Replicate()]).requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = vparallel_ce.linear_cross_entropy(h, w, target, chunks=2)
    (out * up.float()).backward()
    assert local_grad(w).dtype == torch.float32
    return max(rel_err(out, ref), rel_err(local_grad(w), shard(dw_ref, world, rank, 0), dw_ref),
               rel_err(local_grad(h), dh_ref))


def test_autocast_with_dtensor_weight():
    assert max(run_ranks(dtensor_amp_rank, 2)) < TOL[torch.bfloat16]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("amp", AMP_DTYPES)
def test_cuda_autocast(amp):
    worst = 0.0
    for (i, opts), plan, reduction in itertools.product(enumerate(OPTIONS), PLANS, ["mean", "none"]):
        case = make_case(40 + i, tokens=(16, 33), vocab=300, ignore_index=opts.get("ignore_index", -100))
        worst = max(worst, amp_case(0, 1, None, case, amp, opts, reduction, plan, False, torch.float32, "cuda"))
    assert worst < TOL_AMP[amp], worst
