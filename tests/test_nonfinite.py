"""Non-finite values come out exactly where ``F.cross_entropy`` on the gathered logits has them.

For every op, TP degree (1, 2, 4: uneven shards, an empty one at 4 with 3 columns... see VOCAB),
schedule and reduction: a nan or +inf logit (or a nan row of the lm_head shard, or nan hidden
states) on each rank in turn, and -inf masking (a masked entry, a masked shard, a fully masked row,
a masked target). The loss and every input's gradient must be nan / +inf / -inf at exactly the
positions the float64 reference has them, and equal it elsewhere.

The reference is PyTorch on the gathered logits over the VALID tokens: an ignored token counts 0
and its logits' gradient is exactly 0 whatever its logits (the one documented difference from
``F.cross_entropy``, which puts a nan gradient row on an ignored token whose logits hold a nan or are
all -inf; docs/api.md, "Errors and non-finite values"). For the linear ops that logits gradient is
chained through the lm_head's matmuls. A nan or inf upstream gradient of a "mean" or "sum" loss
reaches only the valid tokens, on every plan of the linear ops (the gradients made in forward
included), as ``F.cross_entropy`` itself on the full logits has it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import vparallel_ce
from tests.dist import run_ranks
from tests.reference import shard

NAN, INF = float("nan"), float("inf")
N, V, H = 8, 11, 5  # 11 columns: shards of 6+5 at TP 2, 3+3+3+2 at TP 4
IGNORE = -100


def _case(kind: str, world: int, owner: int):
    """Full fp64 logits [N, V] and targets with the non-finite pattern ``kind`` placed in the
    columns of rank ``owner`` (in the torch.chunk layout over ``world`` ranks)."""
    g = torch.Generator().manual_seed(world * 10 + owner)
    x = torch.randn(N, V, generator=g, dtype=torch.float64)
    t = torch.randint(0, V, (N,), generator=g)
    t[6] = IGNORE
    cols = torch.chunk(torch.arange(V), world)[owner]
    c = int(cols[len(cols) // 2])
    if kind == "nan":
        x[1, c] = NAN  # a valid token
        x[6, c] = NAN  # an ignored one: no effect
        x[:, cols[0]] = torch.where(torch.arange(N) == 3, NAN, x[:, cols[0]])
    elif kind == "+inf":
        x[2, c] = INF
        t[2] = c  # the +inf logit is the target: inf - inf
        x[4, c] = INF
        x[6, c] = INF
    elif kind == "-inf masks":
        x[0, c] = -INF  # a masked entry
        x[1, cols] = -INF  # a masked shard
        x[3, :] = -INF  # a fully masked valid row: nan, as F.cross_entropy
        x[6, :] = -INF  # a fully masked ignored row: 0 and gradient 0
        x[5, c] = -INF
        t[5] = c  # a masked target: +inf loss, finite gradient
    return x, t


def _reference(x, t, reduction, *, upstream=None, softcap=None):
    """Loss and logits gradient of F.cross_entropy on the valid rows (ignored rows: 0, gradient 0),
    of the logits softcapped first with ``softcap``; ``upstream``: reduction none's gradient."""
    x = x.clone().requires_grad_()
    valid = t != IGNORE
    z = x[valid] if softcap is None else softcap * torch.tanh(x[valid] / softcap)
    per = torch.zeros(N, dtype=x.dtype)
    per = per.index_put((valid.nonzero().squeeze(1),), F.cross_entropy(z, t[valid], reduction="none"))
    out = per if reduction == "none" else per.sum() / valid.sum() if reduction == "mean" else per.sum()
    if reduction == "none":
        out.backward(torch.linspace(0.5, 1.5, N, dtype=x.dtype) if upstream is None else upstream)
    else:
        out.backward()
    return out.detach(), x.grad


TOLERANCE = {torch.float64: dict(rtol=1e-9, atol=1e-12), torch.float32: dict(rtol=1e-4, atol=1e-5),
             torch.bfloat16: dict(rtol=5e-2, atol=2e-2)}


def _same(got: torch.Tensor, want: torch.Tensor, what: str, dtype=torch.float64) -> None:
    got, want = got.double().cpu(), want.double()
    assert got.shape == want.shape, (what, got.shape, want.shape)
    for name, test in (("nan", torch.isnan), ("+inf", lambda v: v == INF), ("-inf", lambda v: v == -INF)):
        mismatch = test(got) != test(want)
        assert not mismatch.any(), f"{what}: {name} at {mismatch.nonzero().tolist()}\ngot {got}\nwant {want}"
    finite = torch.isfinite(want)
    torch.testing.assert_close(got[finite], want[finite], **TOLERANCE[dtype], msg=lambda m: f"{what}: {m}")


def _upstream(out, reduction):
    return torch.linspace(0.5, 1.5, N, dtype=torch.float64) if reduction == "none" else None


def logits_ops_rank(rank, world, kind, op, device="cpu", dtype=torch.float64):
    import torch.distributed as dist

    group = dist.group.WORLD if world > 1 else None
    checked = 0
    for owner in range(world):
        x, t = _case(kind, world, owner)
        x = x.to(dtype).double()  # the reference sees the values the op sees
        for reduction in (("mean", "sum", "none") if op == "cross_entropy" else ("none",)):
            for chunks in (1, 3):
                mine = shard(x, world, rank).to(device, dtype, copy=True).requires_grad_()
                td = t.to(device)
                if op == "cross_entropy":
                    out = vparallel_ce.cross_entropy(mine, td, group=group, reduction=reduction, chunks=chunks)
                    ref, ref_grad = _reference(x, t, reduction)
                else:  # token_logprobs: -loss per token
                    out = vparallel_ce.token_logprobs(mine, td, group=group, chunks=chunks)
                    ref, ref_grad = _reference(x, t, "none")
                    ref = -ref  # backward of -upstream * logp: the loss' gradient for upstream
                    out.backward(-_upstream(out, "none").to(device))
                    out = out.detach()
                if op == "cross_entropy":
                    up = _upstream(out, reduction)
                    out.backward(None if up is None else up.to(device))
                case = f"{op} {kind} on rank {owner}'s columns, TP {world}, {reduction}, chunks={chunks}"
                _same(out.detach(), ref, f"{case}: loss", dtype)
                _same(mine.grad, shard(ref_grad, world, rank), f"{case}: logits grad on rank {rank}", dtype)
                checked += 1
    return checked


@pytest.mark.parametrize("op", ["cross_entropy", "token_logprobs"])
@pytest.mark.parametrize("kind", ["nan", "+inf", "-inf masks"])
@pytest.mark.parametrize("world", [1, 2, 4])
def test_logits_ops_put_non_finite_values_where_the_reference_has_them(world, kind, op):
    fn = logits_ops_rank
    results = [fn(0, 1, kind, op)] if world == 1 else run_ranks(fn, world, kind, op, timeout=120)
    assert all(n > 0 for n in results)


LINEAR_PLANS = [  # (schedule, recompute, chunks): every gradient mode of the linear op
    ("token", None, 1),  # logits kept for the backward (one pass at world 1)
    ("token", None, 2),  # gradients made in forward
    ("token", True, 2),  # recomputed in backward
    ("vocab", None, 3),  # vocab blocks
]


def _linear_case(kind: str, world: int, owner: int):
    g = torch.Generator().manual_seed(100 + world * 10 + owner)
    h = torch.randn(N, H, generator=g, dtype=torch.float64)
    w = torch.randn(V, H, generator=g, dtype=torch.float64)
    t = torch.randint(0, V, (N,), generator=g)
    t[6] = IGNORE
    rows = torch.chunk(torch.arange(V), world)[owner]
    if kind == "nan weight row":  # every token's logit in that column: every valid row is nan
        w[int(rows[-1])] = NAN
    elif kind == "nan hidden":
        h[2, 1] = NAN
        h[6, 0] = NAN  # an ignored token: nothing
    elif kind == "inf hidden":
        h[5, 3] = INF
    return h, w, t


def _linear_reference(h, w, t, reduction, **opts):
    """The logits' reference (:func:`_reference`) chained through the lm_head matmuls, in IEEE
    arithmetic as the op's own: ``dh = dx W``, ``dW = dx^T h`` (a nan weight row or hidden state of an
    ignored token still reaches them through ``0 * nan``)."""
    out, dx = _reference(F.linear(h, w), t, reduction, **opts)
    return out, dx @ w, dx.t() @ h


def linear_ops_rank(rank, world, kind, op, device="cpu", dtype=torch.float64):
    import torch.distributed as dist

    group = dist.group.WORLD if world > 1 else None
    checked = 0
    for owner in range(world if kind == "nan weight row" else 1):
        h_full, w_full, t = _linear_case(kind, world, owner)
        h_full, w_full = h_full.to(dtype).double(), w_full.to(dtype).double()  # the values the op sees
        for schedule, recompute, chunks in LINEAR_PLANS:
            for reduction in (("mean", "none") if op == "linear_cross_entropy" else ("none",)):
                if reduction == "none" and recompute is None and chunks == 2 and schedule == "token":
                    continue  # gradients in forward need a scalar loss: the policy recomputes instead
                h = h_full.to(device, dtype, copy=True).requires_grad_()
                w = shard(w_full, world, rank, 0).to(device, dtype, copy=True).requires_grad_()
                td = t.to(device)
                if op == "linear_cross_entropy":
                    out = vparallel_ce.linear_cross_entropy(h, w, td, group=group, reduction=reduction,
                                                            schedule=schedule, recompute=recompute, chunks=chunks)
                    up = _upstream(out, reduction)
                    out.backward(None if up is None else up.to(device, out.dtype))
                    ref, dh, dw = _linear_reference(h_full, w_full, t, reduction)
                else:
                    if schedule == "token" and chunks == 2 and recompute is None:
                        continue
                    out = vparallel_ce.linear_token_logprobs(h, w, td, group=group, chunks=chunks)
                    out.backward(-_upstream(out, "none").to(device, out.dtype))
                    ref, dh, dw = _linear_reference(h_full, w_full, t, "none")
                    ref = -ref
                case = (f"{op} {kind} (rank {owner}'s shard), TP {world}, {schedule} x{chunks} "
                        f"recompute={recompute}, {reduction}")
                _same(out.detach(), ref, f"{case}: loss", dtype)
                _same(h.grad, dh, f"{case}: hidden grad on rank {rank}", dtype)
                _same(w.grad, shard(dw, world, rank, 0), f"{case}: weight grad on rank {rank}", dtype)
                checked += 1
    return checked


@pytest.mark.parametrize("op", ["linear_cross_entropy", "linear_token_logprobs"])
@pytest.mark.parametrize("kind", ["nan weight row", "nan hidden", "inf hidden"])
@pytest.mark.parametrize("world", [1, 2, 4])
def test_linear_ops_put_non_finite_values_where_the_reference_has_them(world, kind, op):
    fn = linear_ops_rank
    results = [fn(0, 1, kind, op)] if world == 1 else run_ranks(fn, world, kind, op, timeout=120)
    assert all(n > 0 for n in results)


def ignored_rows_rank(rank, world, device="cpu", dtype=torch.float64):
    """An ignored token whose logits hold a nan (from a nan hidden state), softcapped, with a nan
    upstream gradient at its position (reduction none): its gradient row is exactly 0, as the
    reference's, and nothing else changes."""
    import torch.distributed as dist

    group = dist.group.WORLD if world > 1 else None
    cap = 4.0
    up = torch.linspace(0.5, 1.5, N, dtype=torch.float64)
    up[6] = NAN  # the ignored token's
    h_full, w_full, t = _linear_case("nan hidden", world, 0)
    h_full, w_full = h_full.to(dtype).double(), w_full.to(dtype).double()
    h_full[2] = 0.5  # only the ignored token's hidden state is nan: its logits row is nan
    x = F.linear(h_full, w_full).to(dtype).double()
    checked = 0
    for reduction in ("mean", "none"):
        upstream = up if reduction == "none" else None
        for chunks in (1, 3):
            mine = shard(x, world, rank).to(device, dtype, copy=True).requires_grad_()
            out = vparallel_ce.cross_entropy(mine, t.to(device), group=group, reduction=reduction, chunks=chunks,
                                             softcap=cap)
            out.backward(None if upstream is None else upstream.to(device, out.dtype))
            ref, ref_grad = _reference(x, t, reduction, upstream=upstream, softcap=cap)
            case = f"cross_entropy, TP {world}, {reduction}, chunks={chunks}"
            _same(out.detach(), ref, f"{case}: loss", dtype)
            _same(mine.grad, shard(ref_grad, world, rank), f"{case}: logits grad on rank {rank}", dtype)
            checked += 1
        for schedule, recompute, chunks in LINEAR_PLANS:
            if reduction == "none" and recompute is None and chunks == 2 and schedule == "token":
                continue
            h = h_full.to(device, dtype, copy=True).requires_grad_()
            w = shard(w_full, world, rank, 0).to(device, dtype, copy=True).requires_grad_()
            out = vparallel_ce.linear_cross_entropy(h, w, t.to(device), group=group, reduction=reduction,
                                                    schedule=schedule, recompute=recompute, chunks=chunks, softcap=cap)
            out.backward(None if upstream is None else upstream.to(device, out.dtype))
            ref, dh, dw = _linear_reference(h_full, w_full, t, reduction, upstream=upstream, softcap=cap)
            case = f"linear_cross_entropy, TP {world}, {schedule} x{chunks} recompute={recompute}, {reduction}"
            _same(out.detach(), ref, f"{case}: loss", dtype)
            _same(h.grad, dh, f"{case}: hidden grad on rank {rank}", dtype)
            _same(w.grad, shard(dw, world, rank, 0), f"{case}: weight grad on rank {rank}", dtype)
            checked += 1
    return checked


@pytest.mark.parametrize("world", [1, 2])
def test_an_ignored_token_keeps_a_zero_gradient_under_softcap_and_a_nan_upstream(world):
    fn = ignored_rows_rank
    results = [fn(0, 1)] if world == 1 else run_ranks(fn, world, timeout=120)
    assert all(n > 0 for n in results)


def test_a_nan_logit_is_never_hidden_by_its_position():
    # the case that was once silently finite: a nan column on one rank, every token nan
    x = torch.randn(N, V, dtype=torch.float64)
    x[:, 5] = NAN
    t = torch.randint(0, V, (N,))
    for chunks in (1, 2):
        got = vparallel_ce.cross_entropy(x, t, reduction="none", chunks=chunks)
        assert torch.isnan(got).all(), got


# The same on a GPU: the Triton kernels (fp32) and the fused GEMM kernels (bf16), at world 1 and on
# a gloo group of 2 ranks sharing cuda:0 (gloo carries CUDA tensors).
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("world", [1, 2])
def test_on_cuda_non_finite_values_follow_the_reference(world, dtype):
    for op, fn, kinds in (("cross_entropy", logits_ops_rank, ["nan", "+inf", "-inf masks"]),
                          ("token_logprobs", logits_ops_rank, ["nan", "+inf", "-inf masks"]),
                          ("linear_cross_entropy", linear_ops_rank, ["nan weight row", "nan hidden", "inf hidden"]),
                          ("linear_token_logprobs", linear_ops_rank, ["nan weight row", "nan hidden"])):
        for kind in kinds:
            results = ([fn(0, 1, kind, op, "cuda", dtype)] if world == 1
                       else run_ranks(fn, world, kind, op, "cuda", dtype, timeout=300))
            assert all(n > 0 for n in results), (op, kind)
    results = ([ignored_rows_rank(0, 1, "cuda", dtype)] if world == 1
               else run_ranks(ignored_rows_rank, world, "cuda", dtype, timeout=300))
    assert all(n > 0 for n in results)


# A non-finite upstream gradient of a "mean" or "sum" loss (a user's loss * nan, or a sum divided by a
# count of 0 -- inf): F.cross_entropy leaves an ignored token's gradient row 0 and, with no valid
# token at all, every gradient 0; only the valid tokens' rows take it. The same for every plan of the
# linear ops, those that make their gradients in forward (and scale them by it in backward) included.
# An infinite one: where PyTorch's GEMMs sum infinities of both signs into nan, ours scales finite
# sums by it into +-inf -- non-finite at the same positions, not always of the same kind.

UPSTREAMS = {"nan": NAN, "inf": INF, "2": 2.0}


def _same_non_finite(got: torch.Tensor, want: torch.Tensor, what: str, dtype, exact_kind: bool) -> None:
    if exact_kind:
        return _same(got, want, what, dtype)
    got, want = got.double().cpu(), want.double()
    mismatch = torch.isfinite(got) != torch.isfinite(want)
    assert not mismatch.any(), f"{what}: non-finite at {mismatch.nonzero().tolist()}\ngot {got}\nwant {want}"
    finite = torch.isfinite(want)
    torch.testing.assert_close(got[finite], want[finite], **TOLERANCE[dtype], msg=lambda m: f"{what}: {m}")


def _scalar_upstream_reference(h, w, b, t, reduction, g):
    """F.cross_entropy itself on the full logits, its loss' gradient ``g``."""
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    b = None if b is None else b.clone().requires_grad_()
    out = F.cross_entropy(F.linear(h, w, b), t, ignore_index=IGNORE, reduction=reduction)
    out.backward(torch.tensor(g, dtype=out.dtype))
    return out.detach(), h.grad, w.grad, None if b is None else b.grad


def _distill_upstream_reference(hs, ws, ht, wt, t, reduction, g, hard_weight):
    from tests.reference import reference_distillation

    hs, ws = hs.clone().requires_grad_(), ws.clone().requires_grad_()
    out = reference_distillation(hs @ ws.T, ht @ wt.T, t, kind="forward_kl", temperature=2.0, hard_weight=hard_weight,
                                 ignore_index=IGNORE, reduction=reduction)
    out.backward(torch.tensor(g, dtype=out.dtype))
    return out.detach(), hs.grad, ws.grad


def upstream_rank(rank, world, device="cpu", dtype=torch.float64):
    import torch.distributed as dist

    group = dist.group.WORLD if world > 1 else None
    checked = 0
    g_ = torch.Generator().manual_seed(7)
    h_full = torch.randn(N, H, generator=g_, dtype=torch.float64).to(dtype).double()
    w_full = torch.randn(V, H, generator=g_, dtype=torch.float64).to(dtype).double()
    b_full = torch.randn(V, generator=g_, dtype=torch.float64).to(dtype).double()
    ht_full = torch.randn(N, 2 * H, generator=g_, dtype=torch.float64).to(dtype).double()
    wt_full = torch.randn(V, 2 * H, generator=g_, dtype=torch.float64).to(dtype).double()
    t_some = torch.randint(0, V, (N,), generator=g_)
    t_some[[0, 6]] = IGNORE
    t_half = t_some.clone()
    t_half[: N // 2] = IGNORE  # with sequence parallelism at TP 2, one rank holds no valid token
    targets = {"some ignored": t_some, "the first half ignored": t_half, "all ignored": torch.full((N,), IGNORE)}

    def local(x, dim=0):
        return shard(x, world, rank, dim).to(device, dtype, copy=True)

    # on a group the finite upstream and the some-ignored pattern are left to world 1 (the suite's time)
    cases = [(tt, gg, r) for tt in targets.items() for gg in UPSTREAMS.items() for r in ("mean", "sum")
             if world == 1 or (gg[0] != "2" and tt[0] != "some ignored")]
    for (tname, t), (gname, g), reduction in cases:
        up = torch.tensor(g, dtype=torch.float32 if dtype != torch.float64 else dtype, device=device)
        # a bias where db is scaled (the logits kept for the backward, the gradients made in forward)
        plans = [(p, False, False) for p in LINEAR_PLANS] + [(p, True, False) for p in LINEAR_PLANS[:2]]
        for (schedule, recompute, chunks), bias, sp in plans + ([(("token", None, 2), False, True)] if world > 1 else []):
            h = (shard(h_full, world, rank, 0) if sp else h_full).to(device, dtype, copy=True).requires_grad_()
            w = local(w_full).requires_grad_()
            b = local(b_full).requires_grad_() if bias else None
            t_in = (shard(t, world, rank, 0) if sp else t).to(device)
            out = vparallel_ce.linear_cross_entropy(h, w, t_in, b, group=group, reduction=reduction, schedule=schedule,
                                                    recompute=recompute, chunks=chunks, sequence_parallel=sp)
            out.backward(up.to(out.dtype))
            ref, dh, dw, db = _scalar_upstream_reference(h_full, w_full, b_full if bias else None, t, reduction, g)
            case = (f"linear_cross_entropy TP {world}{' SP' if sp else ''}, {schedule} x{chunks} recompute={recompute}"
                    f"{' bias' if bias else ''}, {reduction}, {tname}, upstream {gname}")
            exact = "inf" not in gname
            _same(out.detach(), ref, f"{case}: loss", dtype)
            _same_non_finite(h.grad, shard(dh, world, rank, 0) if sp else dh, f"{case}: hidden grad on rank {rank}",
                             dtype, exact)
            _same_non_finite(w.grad, shard(dw, world, rank, 0), f"{case}: weight grad on rank {rank}", dtype, exact)
            if bias:
                _same_non_finite(b.grad, shard(db, world, rank, 0), f"{case}: bias grad on rank {rank}", dtype, exact)
            checked += 1
        for hard_weight, chunks in ((0.0, 2), (0.5, 1)):  # both plans make the gradients in forward
            case = f"linear_distillation_loss TP {world} x{chunks} hard {hard_weight}, {reduction}, {tname}, upstream {gname}"
            checked += _check_distillation(case, rank, world, device, dtype, (h_full, w_full, ht_full, wt_full), t,
                                           reduction, gname, hard_weight=hard_weight, chunks=chunks)
    for tokens, gname, reduction in [(n, gg, r) for n in (N, 0) for gg in UPSTREAMS for r in ("mean", "sum")
                                     if world == 1 or gg != "2"]:
        # without a target every token counts; none at all: no gradient holds a contribution
        case = f"linear_distillation_loss TP {world}, no target, {tokens} tokens, {reduction}, upstream {gname}"
        inputs = (h_full[:tokens], w_full, ht_full[:tokens], wt_full)
        checked += _check_distillation(case, rank, world, device, dtype, inputs, None, reduction, gname, hard_weight=0.0,
                                       chunks=2)
    return checked


def _check_distillation(case, rank, world, device, dtype, inputs, t, reduction, gname, *, hard_weight, chunks) -> int:
    """``linear_distillation_loss`` (forward KL, T = 2) on this rank's shard with upstream gradient
    ``UPSTREAMS[gname]`` against the float64 reference on the full inputs."""
    import torch.distributed as dist

    group = dist.group.WORLD if world > 1 else None
    h_full, w_full, ht_full, wt_full = inputs
    g = UPSTREAMS[gname]
    hs = h_full.to(device, dtype, copy=True).requires_grad_()
    ws = shard(w_full, world, rank, 0).to(device, dtype, copy=True).requires_grad_()
    wt = shard(wt_full, world, rank, 0).to(device, dtype, copy=True)
    out = vparallel_ce.linear_distillation_loss(hs, ws, ht_full.to(device, dtype), wt, None if t is None else t.to(device),
                                                group=group, temperature=2.0, hard_weight=hard_weight,
                                                reduction=reduction, chunks=chunks)
    out.backward(torch.tensor(g, dtype=out.dtype, device=device))
    ref, dh, dw = _distill_upstream_reference(h_full, w_full, ht_full, wt_full, t, reduction, g, hard_weight)
    exact = "inf" not in gname
    _same(out.detach(), ref, f"{case}: loss", dtype)
    _same_non_finite(hs.grad, dh, f"{case}: hidden grad on rank {rank}", dtype, exact)
    _same_non_finite(ws.grad, shard(dw, world, rank, 0), f"{case}: weight grad on rank {rank}", dtype, exact)
    return 1


@pytest.mark.parametrize("world", [1, 2])
def test_a_non_finite_upstream_gradient_reaches_only_the_valid_tokens(world):
    results = [upstream_rank(0, 1)] if world == 1 else run_ranks(upstream_rank, world, timeout=180)
    assert all(n > 0 for n in results)


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("world", [1, 2])
def test_on_cuda_a_non_finite_upstream_gradient_reaches_only_the_valid_tokens(world, dtype):
    results = ([upstream_rank(0, 1, "cuda", dtype)] if world == 1
               else run_ranks(upstream_rank, world, "cuda", dtype, timeout=300))
    assert all(n > 0 for n in results)
