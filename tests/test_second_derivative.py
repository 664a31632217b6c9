"""Second derivatives raise a clear error for every op; first derivatives are unchanged by
``create_graph=True``. (A hand-written backward differentiated as a constant would give a silently
wrong Hessian-vector product.)"""

from __future__ import annotations

import pytest
import torch

import vparallel_ce
from vparallel_ce.second_order import SecondDerivativeError

N, V, H = 6, 9, 4


def _ops():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(N, H, generator=g, dtype=torch.float64)
    w = torch.randn(V, H, generator=g, dtype=torch.float64)
    t = torch.randint(0, V, (N,), generator=g)
    x = torch.randn(N, V, generator=g, dtype=torch.float64)
    support = torch.stack([t, (t + 1) % V, (t + 3) % V], -1)
    return {
        "cross_entropy": ((x,), lambda x: vparallel_ce.cross_entropy(x, t)),
        "token_logprobs": ((x,), lambda x: vparallel_ce.token_logprobs(x, t).sum()),
        "token_logprobs with entropy": ((x,), lambda x: sum(
            o.sum() for o in vparallel_ce.token_logprobs(x, t, with_entropy=True))),
        "linear_cross_entropy kept logits": ((h, w), lambda h, w: vparallel_ce.linear_cross_entropy(h, w, t, chunks=1)),
        "linear_cross_entropy grads in forward": (
            (h, w), lambda h, w: vparallel_ce.linear_cross_entropy(h, w, t, chunks=2)),
        "linear_cross_entropy vocab blocks": (
            (h, w), lambda h, w: vparallel_ce.linear_cross_entropy(h, w, t, schedule="vocab", chunks=2)),
        "linear_token_logprobs": ((h, w), lambda h, w: vparallel_ce.linear_token_logprobs(h, w, t).sum()),
        # over a sampling set: the given logits' op, and the linear op in each mode of the rule
        "token_logprobs over a set": ((x,), lambda x: vparallel_ce.token_logprobs(x, t, support=support).sum()),
        "token_logprobs over top_k": ((x,), lambda x: vparallel_ce.token_logprobs(x, t, top_k=3).sum()),
        "linear_token_logprobs over a set, gather mode": (
            (h, w), lambda h, w: _with_ratio(1, lambda: vparallel_ce.linear_token_logprobs(h, w, t, support=support))),
        "linear_token_logprobs over a set, GEMM mode": (
            (h, w), lambda h, w: _with_ratio(10**9, lambda: vparallel_ce.linear_token_logprobs(h, w, t,
                                                                                                support=support))),
    }


def _with_ratio(ratio: int, op):
    """``op()``'s summed output with the sampling set's mode rule at ``GATHER_RATIO = ratio`` (1: every
    chunk gathers its rows; huge: every chunk takes the GEMM)."""
    from vparallel_ce import sampling_set

    default = sampling_set.GATHER_RATIO
    sampling_set.GATHER_RATIO = ratio
    try:
        return op().sum()
    finally:
        sampling_set.GATHER_RATIO = default


@pytest.mark.parametrize("name", list(_ops()))
def test_a_second_derivative_raises_and_names_the_op(name):
    inputs, fn = _ops()[name]
    leaves = [i.clone().requires_grad_() for i in inputs]
    with pytest.raises(SecondDerivativeError, match="has no second derivative"):
        grads = torch.autograd.grad(fn(*leaves), leaves, create_graph=True)
        hvp = sum((g * torch.randn_like(g)).sum() for g in grads)
        torch.autograd.grad(hvp, leaves)


@pytest.mark.parametrize("name", [n for n in _ops() if "grads in forward" not in n])
def test_create_graph_leaves_the_first_derivative_unchanged(name):
    inputs, fn = _ops()[name]
    leaves = [i.clone().requires_grad_() for i in inputs]
    want = torch.autograd.grad(fn(*leaves), leaves)
    leaves = [i.clone().requires_grad_() for i in inputs]
    got = torch.autograd.grad(fn(*leaves), leaves, create_graph=True)
    for g, r in zip(got, want):
        assert torch.equal(g.detach(), r)


@pytest.mark.parametrize("reduction", ["none", "mean"])
@pytest.mark.parametrize("op", ["cross_entropy", "linear_cross_entropy", "linear_cross_entropy grads in forward"])
def test_a_derivative_with_respect_to_the_upstream_gradient_raises(op, reduction):
    """The gradients are linear in the upstream gradient ``v``; d(grad)/dv through a backward run
    without autograd would come out as nothing (or zero), so it raises too."""
    g = torch.Generator().manual_seed(1)
    h = torch.randn(N, H, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(V, H, generator=g, dtype=torch.float64)
    t = torch.randint(0, V, (N,), generator=g)
    if op == "cross_entropy":
        out = vparallel_ce.cross_entropy(h @ w.T, t, reduction=reduction, chunks=1)
    elif op == "linear_cross_entropy":
        out = vparallel_ce.linear_cross_entropy(h, w, t, reduction=reduction, chunks=1)
    else:  # the gradients for 1 are made in forward (mean/sum only): a loss weight that needs grad
        out = vparallel_ce.linear_cross_entropy(h, w, t, reduction="sum" if reduction == "none" else reduction,
                                                chunks=2, recompute=False)
    v = torch.randn(out.shape, generator=g, dtype=torch.float64, requires_grad=True)
    with pytest.raises(SecondDerivativeError, match="has no second derivative"):
        (dh,) = torch.autograd.grad(out, h, grad_outputs=v, create_graph=True)
        torch.autograd.grad(dh.square().sum(), (v, h))
