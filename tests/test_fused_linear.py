"""The fused GEMM + cross-entropy kernels (``vparallel_ce.kernels.fused_linear``) against the torch
reference ``stats.local_stats`` / ``stats.grad_logits`` of ``F.linear(h, w, b)``.

On CPU they run under the Triton interpreter, with fp32 operands (the interpreter's bf16 ``tl.dot``
is not exact) at small, odd sizes, for every tile schedule, TMA and masked loads, and every loss
option. ``TRITON_INTERPRET=1`` must be set before triton is imported (see ``test_kernels.py``), so
the checks run in fresh subprocesses. With CUDA, bf16 at a medium size.
"""

from __future__ import annotations

import importlib.util
import textwrap

import pytest
import torch

from tests.test_kernels import _run_interpreted

HAS_TRITON = importlib.util.find_spec("triton") is not None

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")

# Shared by the interpreter scripts and the CUDA tests: one case = inputs + reference + kernels.
_CASES = textwrap.dedent(
    r"""
    import torch
    import torch.nn.functional as F
    from vparallel_ce import stats
    from vparallel_ce.kernels import fused_linear as fl

    OPTIONS = [
        dict(label_smoothing=0.0, z_loss=0.0, softcap=None),
        dict(label_smoothing=0.1, z_loss=1e-3, softcap=None),
        dict(label_smoothing=0.05, z_loss=1e-4, softcap=3.0),
        dict(temperature=0.7, entropy=True, softcap=3.0),  # log-prob ops: statistics fall back, gradient fused
    ]

    def inputs(c, hdim, width, offset, vocab, dtype, device, bias):
        h = torch.randn(c, hdim, device=device).to(dtype)
        w = (torch.randn(width, hdim, device=device) * (2.0 / hdim ** 0.5)).to(dtype)
        b = torch.randn(width, device=device).to(dtype) if bias else None
        target = torch.randint(0, vocab, (c,), device=device)
        if width and c > 4:
            target[0] = offset + width - 1  # owned, last column (the ragged tail tile)
            target[1] = offset  # owned, first column
            target[2] = offset + width // 2
            target[3] = -100  # ignored row
        if c > 5 and width > 2:
            w[width // 3] = h[5] * (8.0 / hdim)  # a dominant logit in row 5, owned by it
            target[5] = offset + width // 3
        local_t, owned, valid = stats.local_targets(target, offset, width, -100)
        return h, w, b, local_t, owned, valid

    FP32_TOL = dict(stats=dict(rtol=1e-5, atol=1e-5), logits=dict(rtol=1e-5, atol=1e-5),
                    grad=dict(rtol=1e-5, atol=1e-5))
    # bf16 operands: the reference is the fp32 GEMM (the kernels keep the fp32 accumulator: their
    # statistics agree to ~1e-5, logits and gradients to their bf16 rounding)
    BF16_TOL = dict(stats=dict(rtol=1e-4, atol=1e-4), logits=dict(rtol=1e-2, atol=1e-2),
                    grad=dict(rtol=1e-2, atol=1e-4))

    def fp32_logits(h, w, b):
        tf32 = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False
        try:
            return F.linear(h.float(), w.float(), None if b is None else b.float())
        finally:
            torch.backends.cuda.matmul.allow_tf32 = tf32

    def check(c, hdim, width, offset, vocab, opts, cfg, dtype=torch.float32, device="cpu", bias=True, tol=FP32_TOL):
        spec = stats.LossSpec(vocab, -100, **opts)
        h, w, b, local_t, owned, valid = inputs(c, hdim, width, offset, vocab, dtype, device, bias)
        x = fp32_logits(h, w, b)
        fused = fl._stats_fused(h, w, spec)  # else the statistics are the reference's on F.linear's logits
        ref = stats.local_stats(x if fused else F.linear(h, w, b), local_t, owned, spec)
        abs_sum = float(stats._transform(x, spec).abs().sum(-1).max()) if width and c else 0.0
        got = fl.linear_stats(h, w, b, local_t, owned, spec, config=cfg)
        got_keep, logits = fl.linear_stats_keep(h, w, b, local_t, owned, spec, config=cfg)
        assert logits.shape == x.shape and logits.dtype == dtype, (logits.shape, logits.dtype)
        if fused:
            torch.testing.assert_close(logits.float(), x, **tol["logits"])
        else:  # the reference path returns F.linear's own logits (cuBLAS rounds before its bias epilogue)
            assert torch.equal(logits, F.linear(h, w, b))
        st_tol = tol["stats"]
        for st in (got, got_keep):
            for name, r, g in zip(ref._fields, ref, st):
                if r is None or g is None:  # the entropy statistic: present in both or in neither
                    assert r is None and g is None, name
                    continue
                assert g.dtype == torch.float32 and g.shape == r.shape, (name, g.dtype, g.shape)
                atol = st_tol["atol"] + (st_tol["rtol"] * abs_sum if name == "sum" else 0.0)
                torch.testing.assert_close(g, r, rtol=st_tol["rtol"], atol=atol,
                                           msg=lambda m: f"{name} {(c, hdim, width)} {opts} {cfg}: {m}")
        lse = torch.logsumexp(stats._transform(x, spec), -1) if width else torch.zeros(c, device=device)
        lse = lse + 0.5 * torch.rand(c, device=device)  # any lse: the global one is larger than the local
        gscale = valid.float() * (0.5 + torch.rand(c, device=device))
        shift = lse - 0.3 * torch.rand(c, device=device)  # the global max; log S = lse - shift
        if spec.entropy:  # the log-prob ops' coefficients: a log-prob term and an entropy bonus
            coefs = stats.logprob_grad_coefs(gscale, valid.float() * torch.randn(c, device=device),
                                             torch.rand(c, device=device), lse - shift)
        else:
            coefs = stats.loss_grad_coefs(shift, lse - shift, gscale, spec)
        dref = stats.grad_logits(x, local_t, owned, shift, coefs, spec)
        d = fl.linear_grad_logits(h, w, b, local_t, owned, shift, coefs, spec, config=cfg)
        assert d.shape == dref.shape and d.dtype == dtype, (d.shape, d.dtype)
        torch.testing.assert_close(d.float(), dref, **tol["grad"],
                                   msg=lambda m: f"grad {(c, hdim, width)} {opts} {cfg}: {m}")
        if c > 3 and width:
            assert (d[3] == 0).all()  # ignored row: exactly zero
        return 1
    """
)

_STATS_AND_GRADS = _CASES + textwrap.dedent(
    r"""
    import os, sys
    assert os.environ["TRITON_INTERPRET"] == "1"
    torch.manual_seed(int(sys.argv[1]))
    C = fl.TileConfig
    small = dict(block_m=16, block_n=32, block_k=16, num_stages=2, num_warps=4, group_m=2)
    ran = 0
    if sys.argv[1] == "0":  # every schedule / load path, every option, one odd shape (3 x 2 row tiles)
        configs = [C(**small, schedule=s, tma=t) for s in ("tiles", "persistent", "ws") for t in (True, False)]
        configs.append(C(**small, split_store=True))
        configs.append(C(**small, schedule="ws", tma_store=False))
        for i, cfg in enumerate(configs):
            for opts in OPTIONS if i < 2 else OPTIONS[2:]:  # all options on the first two, all at once after
                ran += check(37, 24, 70, 100, 300, opts, cfg)
    else:  # odd shapes with the default-like config
        cfg = C(**small)
        shapes = [
            (16, 16, 32, 0, 32),  # exactly one tile, the whole vocab
            (40, 40, 33, 7, 1000),  # one column past a tile boundary; 3 row tiles: a partial group_m group
            (33, 6, 45, 0, 45),  # H = 6: rows not 16-byte aligned -> masked loads
            (9, 8, 1, 4, 9),  # one column
            (5, 24, 0, 3, 10),  # empty block: the torch fallback
            (0, 24, 40, 0, 40),  # no rows
            (17, 72, 70, 290, 700),  # several K tiles, ragged last one
        ]
        for shape in shapes:
            for i, opts in enumerate(OPTIONS):
                ran += check(*shape, opts, cfg, bias=i != 1)
        # a strided row view of h and a column slice of w (what the vocab schedule passes)
        spec = stats.LossSpec(64)
        big = torch.randn(20, 40)
        w = torch.randn(80, 32) * 0.3
        t = torch.randint(0, 64, (20,))
        lt, own, _ = stats.local_targets(t, 0, 64, -100)
        got = fl.linear_stats(big[:, 4:36], w[8:72], None, lt, own, spec, config=cfg)
        ref = stats.local_stats(F.linear(big[:, 4:36], w[8:72]), lt, own, spec)
        for r, g in zip(ref[:4], got[:4]):  # (the entropy statistic is not asked for)
            torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)
        # a bias of -inf over whole column tiles (masked vocab entries): partial sums 0, not nan
        b_inf = torch.zeros(80)
        b_inf[:40] = float("-inf")  # tile 0 (32 columns) all -inf, tile 1 partly
        lt80, own80, _ = stats.local_targets(torch.randint(40, 80, (20,)), 0, 80, -100)
        ref = stats.local_stats(F.linear(big[:, :32], w, b_inf), lt80, own80, spec)
        got = fl.linear_stats(big[:, :32], w, b_inf, lt80, own80, spec, config=cfg)
        for name, r, g in zip(ref._fields[:4], ref[:4], got[:4]):
            assert not g.isnan().any(), name
            torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5, msg=lambda m: f"-inf bias {name}: {m}")
        # not covered: fp64, mixed dtypes -> the torch reference, same results
        h64, w64 = big[:, :32].double(), w.double()
        assert not fl.covered(h64, w64) and not fl.covered(big[:, :32], w64) and fl.covered(big[:, :32], w)
        ref64 = stats.local_stats(F.linear(h64, w64), lt, own, spec)
        for r, g in zip(ref64[:4], fl.linear_stats(h64, w64, None, lt, own, spec)[:4]):
            assert g.dtype == torch.float64
            torch.testing.assert_close(g, r)
        ran += 1
    print("FUSED_CHECKS_OK", ran)
    """
)


def _interpreted(script: str, *args: str, kernels: str | None = None) -> None:
    proc = _run_interpreted(script, *args, kernels=kernels, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "FUSED_CHECKS_OK" in proc.stdout


@pytest.mark.slow
def test_fused_schedules_and_options_in_interpreter():
    _interpreted(_STATS_AND_GRADS, "0")


@pytest.mark.slow
def test_fused_odd_shapes_in_interpreter():
    _interpreted(_STATS_AND_GRADS, "1")


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _cuda_namespace():
    ns: dict = {}
    exec(compile(_CASES, "fused_cases", "exec"), ns)
    return ns


_CUDA_CONFIGS = {  # the warp-specialised schedule is left out: it faults on Triton 3.6 (docs/kernels.md)
    "default": None,
    "tiles": dict(schedule="tiles"),
    "persistent": dict(schedule="persistent"),
    "masked_loads": dict(tma=False),
}


@cuda
@pytest.mark.parametrize("variant", list(_CUDA_CONFIGS))
def test_fused_bf16_cuda(variant):
    ns = _cuda_namespace()
    fl = ns["fl"]
    opts = _CUDA_CONFIGS[variant]
    cfg = None if opts is None else fl.TileConfig(**opts)
    torch.manual_seed(0)
    options = ns["OPTIONS"] if cfg is None else ns["OPTIONS"][2:]  # every option at once, for the variants
    for loss_opts in options:
        ns["check"](1000, 512, 5003, 2000, 20000, loss_opts, cfg, dtype=torch.bfloat16, device="cuda",
                    tol=ns["BF16_TOL"])


def _half_ulp_bf16(v: torch.Tensor) -> torch.Tensor:
    """Half a bf16 unit in the last place of ``|v|`` (8 significant bits): the most that rounding
    an exact value to bf16 can change it."""
    mag = v.abs().clamp(min=2.0 ** -126)
    return torch.exp2(torch.floor(torch.log2(mag)) - 8)


@cuda
@pytest.mark.parametrize("variant", list(_CUDA_CONFIGS))
def test_fused_bf16_error_is_the_rounding_of_the_output(variant):
    # The bf16 logits and logits gradients of the fused kernels differ from the fp32 reference by
    # their one rounding to bf16 (half an ulp) plus the difference of two fp32 accumulations of
    # the same K products in other orders, at most ~K * 2^-24 * sum_k |h_k w_k| (cancellation
    # makes that large next to a small logit); for the gradient, scaled by the softmax. Every
    # element, no outlier: a tile-edge bug (a wrong column, row or K slice) is far larger.
    ns = _cuda_namespace()
    fl, stats = ns["fl"], ns["stats"]
    opts = _CUDA_CONFIGS[variant]
    cfg = None if opts is None else fl.TileConfig(**opts)
    torch.manual_seed(0)
    spec = stats.LossSpec(20000, -100)
    h, w, b, local_t, owned, valid = ns["inputs"](1000, 512, 5003, 2000, 20000, torch.bfloat16, "cuda", True)
    x = ns["fp32_logits"](h, w, b)
    accumulation = h.shape[1] * 2.0 ** -24 * ns["fp32_logits"](h.abs(), w.abs(), None)
    _, logits = fl.linear_stats_keep(h, w, b, local_t, owned, spec, config=cfg)
    err = (logits.float() - x).abs()
    bound = _half_ulp_bf16(x) + accumulation
    assert (err <= bound).all(), f"logits: {int((err > bound).sum())} elements over; worst {float((err / bound).max()):.3f}"
    lse = torch.logsumexp(x, -1)
    coefs = stats.loss_grad_coefs(lse, torch.zeros_like(lse), valid.float(), spec, valid)  # shift = lse: softmax
    dref = stats.grad_logits(x, local_t, owned, lse, coefs, spec)
    d = fl.linear_grad_logits(h, w, b, local_t, owned, lse, coefs, spec, config=cfg).float()
    gerr = (d - dref).abs()
    p = torch.exp(x - lse[:, None])  # the softmax: the part of the gradient that the logits' error moves
    gbound = _half_ulp_bf16(dref) + 2 * accumulation * p + 1e-30
    assert (gerr <= gbound).all(), (f"grad: {int((gerr > gbound).sum())} elements over; worst "
                                     f"{float((gerr / gbound).max()):.3f}")


# ------------------------------------------------------------------------------------------------
# The schedules of linear_cross_entropy take these kernels wherever they recompute logits: the
# vocab schedule's statistics (one fused GEMM over the whole shard) and every recomputed gradient
# block. Float64 references of the loss and every gradient at TP 1 and 2 (uneven shards), sequence
# parallelism, every loss option and reduction -- under the interpreter, fp32 operands.

FUSED_PLANS = [("vocab", None, 3), ("token", True, 2)]  # (schedule, recompute, chunks)


def fused_schedule_rank(rank, world, sequence_parallel):
    import itertools

    import torch.distributed as dist

    from tests.reference import TOL
    from tests.test_linear import OPTIONS, make_case, run_case
    from vparallel_ce import kernels
    from vparallel_ce.kernels import fused_linear as fl

    assert kernels.ops_for(torch.empty(1)).name == "triton+fused"
    calls = {"stats": 0, "grad": 0}
    real_stats, real_grad = fl.linear_stats, fl.GradLogits.__call__  # the gradient kernel, one call per block

    def counted_stats(*a, **k):
        calls["stats"] += 1
        return real_stats(*a, **k)

    def counted_grad(*a, **k):
        calls["grad"] += 1
        return real_grad(*a, **k)

    fl.linear_stats, fl.GradLogits.__call__ = counted_stats, counted_grad
    group = dist.group.WORLD if world > 1 else None
    failures = []
    for (i, opts), reduction, plan in itertools.product(enumerate(OPTIONS), ["mean", "none"], FUSED_PLANS):
        case = make_case(i, vocab=29, ignore_index=opts.get("ignore_index", -100), bias=i != 1)
        err = run_case(rank, world, group, case, torch.float32, opts, reduction, plan, sequence_parallel)
        if not err < TOL[torch.float32]:
            failures.append((opts, reduction, plan, err))
    fl.linear_stats, fl.GradLogits.__call__ = real_stats, real_grad
    return failures, calls


_SCHEDULES_FUSED = textwrap.dedent(
    r"""
    import sys
    from tests.dist import run_ranks
    from tests.test_fused_linear import fused_schedule_rank
    # "WORLD:replicated" or "WORLD:sp", in one process (one interpreter start); the ranks forked from
    # it, the multi-rank layouts first (before this process computes)
    for layout in sorted(sys.argv[1:], key=lambda layout: -int(layout.split(":")[0])):
        world, sp = int(layout.split(":")[0]), layout.endswith(":sp")
        results = (run_ranks(fused_schedule_rank, world, sp, fork=True) if world > 1
                   else [fused_schedule_rank(0, 1, sp)])
        for rank, (failures, calls) in enumerate(results):
            assert not failures, f"{layout}, rank {rank}: (options, reduction, plan, error) over tolerance: {failures}"
            # every rank holds a shard at V=29: each case runs the fused statistics and gradients
            assert calls["stats"] > 0 and calls["grad"] > 0, (layout, rank, calls)
    print("FUSED_CHECKS_OK", len(sys.argv) - 1)
    """
)


@pytest.mark.slow
def test_schedules_run_the_fused_kernels_against_float64():
    # TP 1, and TP 2 with sequence parallelism (V=29 and 15 tokens: uneven vocab and token shards),
    # in one interpreted process; the replicated multi-rank layouts differ from these only outside
    # the kernels (tests/test_linear.py checks them at every degree)
    _interpreted(_SCHEDULES_FUSED, "1:replicated", "2:sp", kernels="triton")


_KEPT_THEN_RECOMPUTED = textwrap.dedent(
    r"""
    import torch
    from vparallel_ce import linear_cross_entropy
    from vparallel_ce.kernels import fused_linear as fl
    calls = []
    real = fl.GradLogits.__call__  # the gradient kernel, one call per block
    fl.GradLogits.__call__ = lambda *a, **k: calls.append(1) or real(*a, **k)
    g = torch.Generator().manual_seed(0)
    h = torch.randn(12, 16, generator=g).requires_grad_()
    w = torch.randn(40, 16, generator=g).requires_grad_()
    t = torch.randint(0, 40, (12,), generator=g)
    # chunks=1 keeps the logits (cuBLAS-style unfused statistics); the second backward of the
    # graph finds them used up and must recompute them the same unfused way, not in the fused
    # kernel, whose fp32-accumulator logits would not match the forward's statistics
    out = linear_cross_entropy(h, w, t, chunks=1, reduction="none")
    first = torch.autograd.grad(out.sum(), (h, w), retain_graph=True)
    second = torch.autograd.grad(out.sum(), (h, w))
    assert not calls, calls
    for a, b in zip(first, second):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    # the one-pass kernel's loss and gradients (world 1, chunks=1) against float64, every
    # reduction, an ignored token and label smoothing
    t[3] = -100
    h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    for reduction in ("mean", "sum", "none"):
        out = linear_cross_entropy(h, w, t, chunks=1, reduction=reduction, label_smoothing=0.1)
        up = torch.rand(out.shape, generator=g) + 0.5
        got = torch.autograd.grad((out * up).sum(), (h, w))
        ref = torch.nn.functional.cross_entropy(h64 @ w64.T, t, reduction=reduction, label_smoothing=0.1)
        want = torch.autograd.grad((ref * up.double()).sum(), (h64, w64))
        torch.testing.assert_close(out.double(), ref.detach(), rtol=1e-5, atol=1e-6, msg=lambda m: f"{reduction}: {m}")
        for a, b in zip(got, want):
            torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-6, msg=lambda m: f"{reduction}: {m}")
    assert not calls, calls
    # a recomputing plan takes the fused kernel in both backwards
    out = linear_cross_entropy(h, w, t, chunks=2, schedule="vocab", reduction="none")
    torch.autograd.grad(out.sum(), (h, w), retain_graph=True)
    torch.autograd.grad(out.sum(), (h, w))
    assert len(calls) == 4, calls
    print("FUSED_CHECKS_OK")
    """
)


@pytest.mark.slow
def test_a_second_backward_of_kept_logits_recomputes_them_unfused():
    _interpreted(_KEPT_THEN_RECOMPUTED, kernels="triton")
