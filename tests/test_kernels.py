"""The Triton kernels (``vparallel_ce.kernels.triton_ce``) against the torch reference ops of
:mod:`vparallel_ce.stats`.

On CPU the kernels run under the Triton interpreter. ``TRITON_INTERPRET=1`` must be set before
triton is first imported, and pytest-xdist shares worker processes between modules, so the checks
run in a fresh subprocess. With CUDA, the full ops are also compared, Triton path vs
``kernels.use("torch")``. Also here: the kernel settings (read from the environment once, at import;
set for a block with ``kernels.use``).
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tests.reference import reference_loss
from tests.warm import run_python

ROOT = Path(__file__).resolve().parents[1]
HAS_TRITON = importlib.util.find_spec("triton") is not None

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")

_INTERPRETER_CHECKS = textwrap.dedent(
    r"""
    import dataclasses, os
    assert os.environ["TRITON_INTERPRET"] == "1"
    import torch
    from vparallel_ce import stats
    from vparallel_ce.kernels import triton_ce as tc

    torch.manual_seed(1234)
    ran = 0
    # (rows, width of the block, offset of the block in the global vocab, global vocab)
    shapes = [(6, 300, 0, 1000), (5, 1000, 1000, 3000), (4, 4096 + 37, 50, 9000), (3, 0, 20, 100), (1, 1, 0, 1)]
    options = [
        dict(label_smoothing=0.0, z_loss=0.0, softcap=None),
        dict(label_smoothing=0.1, z_loss=0.0, softcap=None),
        dict(label_smoothing=0.0, z_loss=1e-3, softcap=None),
        dict(label_smoothing=0.05, z_loss=1e-4, softcap=20.0),
        dict(temperature=0.7, entropy=True),  # the log-prob / entropy ops' statistics and gradients
        dict(softcap=20.0, temperature=1.5, entropy=True),
    ]
    # every shape x option in float32 (the tight tolerances) and in one 16-bit dtype, bfloat16 and
    # float16 alternating (they share the kernels' 16-bit load and store path), so each shape and
    # each option meets both
    grid = [(shape, opts, dtype) for si, shape in enumerate(shapes) for oi, opts in enumerate(options)
            for dtype in (torch.float32, (torch.bfloat16, torch.float16)[(si + oi) % 2])]
    for (c, width, offset, vocab), opts, dtype in grid:
        spec = stats.LossSpec(vocab, -100, **opts)
        x = (torch.randn(c, width) * 4).to(dtype)
        if width > 2 and c > 1:
            x[0, 1] = 40.0  # a dominant logit: softmax(x_t) - 1 must not cancel badly
        target = torch.randint(0, vocab, (c,))
        if width and c > 2:
            target[1] = offset + width - 1  # owned, last column (the ragged tail block)
            target[2] = offset  # owned, first column
        if c > 3:
            target[3] = -100  # ignored row
        if width > 2 and c > 1:
            target[0] = offset + 1
        local_t, owned, valid = stats.local_targets(target, offset, width, -100)

        ref = stats.local_stats(x, local_t, owned, spec)
        got = tc.local_stats(x, local_t, owned, spec)
        abs_sum = float(stats._transform(x, spec).abs().sum(-1).max()) if width else 0.0
        assert (got.zexp is None) == (ref.zexp is None)
        for name, r, g in zip(ref._fields, ref, got):
            if r is None:
                continue
            assert g.dtype == torch.float32, (name, g.dtype)
            atol = 2e-5 + (2e-7 * abs_sum if name == "sum" else 0.0)  # a sum with cancellation
            torch.testing.assert_close(g, r, rtol=1e-5, atol=atol, msg=lambda m: f"{name} {width} {opts} {dtype}: {m}")

        lse = torch.logsumexp(stats._transform(x, spec), -1) + torch.rand(c) if width else torch.randn(c)
        gscale = valid.float() * (0.5 + torch.rand(c))
        shift = lse - torch.rand(c)  # the global max; log S = lse - max
        if spec.entropy:  # a log-prob term and an entropy bonus, both with per-token weights
            coefs = stats.logprob_grad_coefs(gscale, valid.float() * torch.randn(c), torch.rand(c), lse - shift)
        else:
            coefs = stats.loss_grad_coefs(shift, lse - shift, gscale, spec)
        gscale, lse = coefs, shift
        ref = stats.grad_logits(x, local_t, owned, lse, gscale, spec)
        got = tc.grad_logits(x, local_t, owned, lse, gscale, spec)
        assert got.dtype == x.dtype and got.shape == x.shape
        tol = dict(rtol=2e-6, atol=2e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-3)
        torch.testing.assert_close(got.float(), ref.float(), **tol, msg=lambda m: f"grad {width} {opts} {dtype}: {m}")
        if width:
            assert (got[3] == 0).all() if c > 3 else True  # ignored row: exactly zero
        f32 = tc.grad_logits(x, local_t, owned, lse, gscale, spec, out_dtype=torch.float32)
        assert f32.dtype == torch.float32
        torch.testing.assert_close(f32, stats.grad_logits(x, local_t, owned, lse, gscale, spec, torch.float32),
                                   rtol=2e-6, atol=2e-6)
        inplace = x.clone()
        assert tc.grad_logits_(inplace, local_t, owned, lse, gscale, spec) is inplace
        assert torch.equal(inplace, got)
        if not spec.entropy and width:
            # one kernel for a rank holding the whole vocab: target maps, statistics, per-token loss
            # and the loss' gradient for 1 written over the logits, for every reduction's weights;
            # an ignored row and an (unchecked) id outside the vocab, which owns no logit
            whole = dataclasses.replace(spec, vocab_size=width)
            t1 = torch.randint(0, width, (c,))
            t1[0] = width - 1
            if c > 3:
                t1[3] = -100
            if c > 4:
                t1[4] = width + 3
            n_valid = (t1 != -100).sum()
            for reduction in ("mean", "sum", "none"):
                ref_x, got_x = x.clone(), x.clone()
                ref, ref_loss = stats.loss_stats_grad_(ref_x, t1, n_valid, reduction, whole)
                got, got_loss = tc.loss_stats_grad_(got_x, t1, n_valid, reduction, whole)
                where = f"one-pass {reduction} {width} {opts} {dtype}"
                for name, r, g in zip(ref._fields[:4], ref, got):
                    atol = 2e-5 + (2e-7 * abs_sum if name == "sum" else 0.0)
                    torch.testing.assert_close(g, r, rtol=1e-5, atol=atol, msg=lambda m: f"{where} {name}: {m}")
                torch.testing.assert_close(got_loss, ref_loss, rtol=1e-5, atol=2e-5 + 2e-7 * abs_sum,
                                           msg=lambda m: f"{where} loss: {m}")
                torch.testing.assert_close(got_x.float(), ref_x.float(), **tol, msg=lambda m: f"{where} grad: {m}")
                if c > 3:  # ignored row: loss and gradient exactly zero
                    assert got_loss[3] == 0 and (got_x[3] == 0).all(), where
        ran += 1

    # vocab blocks of a shard: the kernels map the shard's targets to a block (col_offset) -- bitwise
    # as given the block's targets (block_targets) -- and the blocks' statistics, written into one
    # buffer, are merged by one fold kernel, bitwise as merge block by block; rows whose
    # logits are all -inf in a block (a zero sum), hold a nan or a +inf, or are ignored
    from vparallel_ce.kernels import block_merge
    for opts in (dict(entropy=True, temperature=0.7), dict(label_smoothing=0.1)):
        spec = stats.LossSpec(700, -100, **opts)
        x = torch.randn(7, 700) * 6
        x[0, :300] = float("-inf")  # the first blocks hold no mass: their sums are 0
        x[1, 350] = float("nan")
        x[2, 20] = float("inf")
        x[3] = float("-inf")
        t = torch.tensor([650, 0, 20, 5, -100, 299, 300])
        lt, own, valid = stats.local_targets(t, 0, 700, -100)
        blocks = [slice(0, 300), slice(300, 301), slice(301, 700)]
        parts = torch.empty(len(blocks), 5, 7)
        for i, blk in enumerate(blocks):
            got = tc.local_stats(x[:, blk], lt, own, spec, col_offset=blk.start, out=parts[i])
            bt, bo = stats.block_targets(lt, own, blk.start, blk.stop)
            for r, g in zip(tc.local_stats(x[:, blk], bt, bo, spec), got):
                assert (r is None) == (g is None) and (r is None or torch.equal(r.nan_to_num(), g.nan_to_num())), opts
        ref, got = stats.merge_blocks(parts, spec), block_merge.merge_blocks(parts, spec)
        for name, r, g in zip(ref._fields, ref, got):
            assert (r is None) == (g is None), name
            if r is not None:
                assert torch.equal(r.isnan(), g.isnan()) and torch.equal(r.nan_to_num(), g.nan_to_num()), (name, r, g)
        shift, log_s = ref.max.nan_to_num(0.0, 0.0, 0.0), torch.log(ref.sumexp).nan_to_num(0.0, 0.0, 0.0)
        coefs = stats.logprob_grad_coefs(valid.float(), valid.float() * 0.3, torch.rand(7), log_s, valid)
        for blk in blocks:
            bt, bo = stats.block_targets(lt, own, blk.start, blk.stop)
            want = tc.grad_logits(x[:, blk], bt, bo, shift, coefs, spec)
            got = tc.grad_logits(x[:, blk], lt, own, shift, coefs, spec, col_offset=blk.start)
            assert torch.equal(want.isnan(), got.isnan()) and torch.equal(want.nan_to_num(), got.nan_to_num()), blk

    # with_top1: each row's largest logit and its first column, read in the pass that then writes the
    # gradient over the row (linear_mtp_loss's acceptance): ties in a tile and across tiles, a nan
    # row (its id means nothing: the value says nan), an all -inf row, a +inf logit
    from vparallel_ce import top1
    for dtype in (torch.float32, torch.bfloat16):
        width = 2 * 4096 + 300
        x = torch.randn(6, width).to(dtype)
        x[0, 7] = x[0, 9] = 60.0
        x[1, 5] = x[1, 4096 + 10] = x[1, 8192 + 1] = 50.0
        x[2, 100] = float("nan")
        x[3] = float("-inf")
        x[4, 8200] = float("inf")
        t = torch.tensor([7, 4106, 1, -100, 8200, 3])
        want = top1.local(x, 0)
        spec = stats.LossSpec(width)
        for fn in (tc.loss_stats_grad_, stats.loss_stats_grad_):
            y = x.clone()
            *_, got = fn(y, t, (t != -100).sum(), "mean", spec, with_top1=True)
            rows = [0, 1, 3, 4, 5]
            assert torch.equal(got.id[rows], want.id[rows]), (fn, dtype, got.id, want.id)
            assert torch.equal(got.value[rows], want.value[rows]) and got.value[2].isnan(), (fn, dtype, got.value)
            assert got.id[0] == 7 and got.id[1] == 5 and got.id[3] == 0 and got.id[4] == 8200
            assert not torch.equal(y, x)  # the gradient was written over the logits after the read

    # g * x with the product in fp32, rounded once, per row or scalar, in place: fp32 bitwise the
    # reference's; 16-bit within one ulp (the interpreter's fp32 -> bf16 rounding is not the GPU's
    # round-to-nearest-even; the CUDA test checks bitwise)
    for dtype, ulp in ((torch.float32, 0.0), (torch.bfloat16, 2.0**-7), (torch.float16, 2.0**-10)):
        x = torch.randn(5, 37).to(dtype)
        for g in (torch.tensor(1 / 3), torch.rand(5) + 0.5):
            y = x.clone()
            assert tc.scale_rows(y, g, out=y) is y
            for got in (tc.scale_rows(x, g), y):
                assert got.dtype == dtype
                torch.testing.assert_close(got, stats.scale_rows(x, g), rtol=ulp, atol=0,
                                           msg=lambda m: f"scale_rows {dtype}: {m}")
        # an ignored token's row keeps its value whatever g (nan, inf); the others take it
        t = torch.tensor([3, -100, 0, 7, -100])
        for g in (torch.tensor(float("nan")), torch.tensor(float("inf")), torch.tensor(1 / 3)):
            got = tc.scale_rows(x, g, target=t, ignore_index=-100)
            want = stats.scale_rows(x, g, target=t, ignore_index=-100)
            assert torch.equal(got[[1, 4]], x[[1, 4]]), f"scale_rows {dtype} g={g}: an ignored row changed"
            assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.isinf(), want.isinf())
            assert bool(got[[0, 2, 3]].isfinite().all()) == bool(g.isfinite()), f"scale_rows {dtype} g={g}"
            torch.testing.assert_close(got.nan_to_num(), want.nan_to_num(), rtol=ulp, atol=0,
                                       msg=lambda m: f"scale_rows {dtype} g={g} with ignored rows: {m}")

    # a strided row view (row stride > width) is read in place, not copied
    spec = stats.LossSpec(500)
    big = torch.randn(4, 700)
    view = big[:, 100:600]
    t = torch.randint(0, 500, (4,))
    lt, own, _ = stats.local_targets(t, 0, 500, -100)
    for r, g in zip(stats.local_stats(view, lt, own, spec), tc.local_stats(view, lt, own, spec)):
        torch.testing.assert_close(g, r)
    # the dispatcher picks the triton ops when asked
    from vparallel_ce import kernels
    with kernels.use("triton"):
        assert kernels.ops_for(big).name == "triton+fused"
        with kernels.use(fused=False):  # the row passes alone
            assert kernels.ops_for(big).name == "triton" and kernels.ops_for(big).fused is None
    print("KERNEL_CHECKS_OK", ran)
    """
)


def _run_interpreted(script: str, *args: str, kernels: str | None = None,
                     timeout: float = 240) -> subprocess.CompletedProcess:
    """``script`` in a fresh Python with ``TRITON_INTERPRET=1`` (set before triton is imported) and
    the kernel dispatch left at its defaults, or set to ``kernels`` (``"triton"`` takes the Triton
    ops for CPU tensors too)."""
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    env.pop("VPARALLEL_CE_KERNELS", None)
    env.pop("VPARALLEL_CE_FUSED", None)
    if kernels:
        env["VPARALLEL_CE_KERNELS"] = kernels
    proc = run_python("-c", "import tests.fast_interpreter\n" + script, *args, env=env, cwd=ROOT, timeout=timeout)
    if proc.returncode and "only 0-dimensional arrays can be converted to Python scalars" in proc.stderr:
        # the interpreter of older Tritons (3.6) turns loop bounds into 1-element numpy arrays,
        # which numpy >= 2.4 refuses to convert to int; fixed in later Tritons (the compiled
        # kernels are checked by the CUDA tests there)
        pytest.skip("this Triton's interpreter is incompatible with the installed numpy")
    return proc


@pytest.mark.slow
def test_kernels_match_torch_ops_in_interpreter():
    proc = _run_interpreted(_INTERPRETER_CHECKS)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "KERNEL_CHECKS_OK" in proc.stdout


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _run_both(fn):
    """``fn()`` on the triton path and on the torch path: (outputs, grads) of each."""
    from vparallel_ce import kernels

    out = {}
    for choice in ("triton", "torch"):
        with kernels.use(choice):  # forward and backward alike
            out[choice] = fn()
    return out["triton"], out["torch"]


@cuda
@pytest.mark.parametrize("opts", [{}, dict(label_smoothing=0.1, z_loss=1e-4, softcap=30.0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cross_entropy_triton_vs_torch(opts, dtype):
    from vparallel_ce import cross_entropy

    torch.manual_seed(0)
    logits = (torch.randn(300, 5000, device="cuda") * 3).to(dtype)
    target = torch.randint(0, 5000, (300,), device="cuda")
    target[::7] = -100

    def fn():
        x = logits.clone().requires_grad_()
        loss = cross_entropy(x, target, chunks=3, **opts)
        loss.backward()
        return loss.detach(), x.grad

    (la, ga), (lb, gb) = _run_both(fn)
    torch.testing.assert_close(la, lb, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ga.float(), gb.float(), rtol=1e-2 if dtype != torch.float32 else 1e-5, atol=1e-6)


@cuda
@pytest.mark.parametrize("schedule,recompute,chunks", [("token", False, 4), ("token", True, 4), ("vocab", None, 4),
                                                       ("token", None, 1)])
@pytest.mark.parametrize("opts", [{}, dict(label_smoothing=0.1, z_loss=1e-4, softcap=30.0)])
def test_linear_cross_entropy_triton_vs_torch(schedule, recompute, chunks, opts):
    # chunks=1 at an aligned width: the kept logits turned into their gradient by the one-pass kernel
    from vparallel_ce import linear_cross_entropy

    torch.manual_seed(0)
    vocab = 3001 if chunks > 1 else 3008
    h0 = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
    w0 = torch.randn(vocab, 256, device="cuda", dtype=torch.bfloat16) * 0.05
    target = torch.randint(0, vocab, (512,), device="cuda")
    target[::5] = -100

    def fn():
        h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
        loss = linear_cross_entropy(h, w, target, chunks=chunks, schedule=schedule, recompute=recompute, **opts)
        (loss / 3).backward()  # an upstream gradient that bf16 cannot hold exactly
        return loss.detach(), h.grad.float(), w.grad.float()

    # the float64 truth of the same bf16 inputs: where the Triton path recomputes logits it runs the
    # fused GEMM kernels, whose statistics come from the fp32 accumulator (the torch path rounds the
    # logits to bf16 first), so it must be at least as close to it as the torch path
    h64, w64 = h0.double().requires_grad_(), w0.double().requires_grad_()
    ref = reference_loss(h64 @ w64.T, target, **opts)
    (ref / 3).backward()
    a, b = _run_both(fn)
    for name, got_a, got_b, truth in zip(("loss", "dh", "dW"), a, b, (ref.detach(), h64.grad, w64.grad)):
        err_a = float((got_a.double() - truth).norm() / truth.norm())
        err_b = float((got_b.double() - truth).norm() / truth.norm())
        floor = 1e-3 if name == "loss" else 1e-2  # bf16 rounding of the logits / gradients
        assert err_a < floor and err_b < floor and err_a <= 1.5 * err_b + 1e-6, (name, err_a, err_b)


@cuda
@pytest.mark.parametrize("opts", [{}, dict(label_smoothing=0.1, z_loss=1e-4, softcap=30.0)])
def test_one_pass_statistics_and_gradient_on_cuda(opts):
    # several 4096-wide tiles and a ragged tail, bf16: the statistics, per-token loss and in-place
    # gradient of the one-pass kernel against the reference's passes for every reduction;
    # scale_rows bitwise the reference's
    from vparallel_ce import stats
    from vparallel_ce.kernels import triton_ce as tc

    torch.manual_seed(0)
    c, width = 257, 3 * 4096 + 123
    spec = stats.LossSpec(width, **opts)
    x = (torch.randn(c, width, device="cuda") * 3).to(torch.bfloat16)
    target = torch.randint(0, width, (c,), device="cuda")
    target[::7] = -100
    target[1] = width - 1
    target[2] = width + 5  # unchecked, outside the vocab: owns no logit
    for reduction in ("mean", "sum", "none"):
        ref_x, got_x = x.clone(), x.clone()
        n_valid = (target != -100).sum()
        ref, ref_loss = stats.loss_stats_grad_(ref_x, target, n_valid, reduction, spec)
        got, got_loss = tc.loss_stats_grad_(got_x, target, n_valid, reduction, spec)
        abs_sum = float(stats._transform(x, spec).abs().sum(-1).max())
        for name, r, g in zip(ref._fields[:4], ref, got):
            atol = 2e-5 + (2e-7 * abs_sum if name == "sum" else 0.0)  # a sum with cancellation
            torch.testing.assert_close(g, r, rtol=1e-5, atol=atol, msg=lambda m: f"{name} {reduction} {opts}: {m}")
        torch.testing.assert_close(got_loss, ref_loss, rtol=1e-5, atol=2e-5 + 2e-7 * abs_sum,
                                   msg=lambda m: f"loss {reduction} {opts}: {m}")
        torch.testing.assert_close(got_x.float(), ref_x.float(), rtol=1e-2, atol=1e-7,
                                   msg=lambda m: f"dx {reduction} {opts}: {m}")
        assert (got_x[::7] == 0).all() and (got_loss[::7] == 0).all()
    # the top-1 of the same pass, bf16 logits with many ties within a tile (values on a coarse grid)
    from vparallel_ce import top1
    tied = (torch.randint(0, 8, (c, width), device="cuda") * 0.5).to(torch.bfloat16)
    *_, best = tc.loss_stats_grad_(tied.clone(), target, None, "sum", spec, with_top1=True)
    want = top1.local(tied, 0)
    assert torch.equal(best.value, want.value) and torch.equal(best.id, want.id)
    for g in (torch.tensor(1 / 3, device="cuda"), torch.rand(c, device="cuda") + 0.5):
        assert torch.equal(tc.scale_rows(x, g), stats.scale_rows(x, g))
        got = tc.scale_rows(x, g, target=target, ignore_index=-100)
        assert torch.equal(got, stats.scale_rows(x, g, target=target, ignore_index=-100))
        assert torch.equal(got[::7], x[::7])  # the ignored rows keep their values
    nan = torch.tensor(float("nan"), device="cuda")
    got = tc.scale_rows(x, nan, target=target, ignore_index=-100)
    assert torch.equal(got[::7], x[::7]) and got[target != -100].isnan().all()


_TARGET_FACTS_CHECKS = textwrap.dedent(
    """
    import os, sys
    import torch
    from vparallel_ce.kernels.targets import target_facts, word_checksum
    from vparallel_ce import checksums
    device = sys.argv[1]
    g = torch.Generator().manual_seed(0)

    def mixed(i, v):  # checksums.target_checksum's mix of one (position, id), in Python integers
        m = (1 << 64) - 1
        k1, k2, k3 = checksums.TARGET_MIX
        x = (v * k1 + (i + 1) * k2) & m
        x ^= x >> 32 if x < 1 << 63 else (x >> 32) | (m ^ (m >> 32))  # an arithmetic shift
        x = (x * k3) & m
        return x ^ (x >> 29 if x < 1 << 63 else (x >> 29) | (m ^ (m >> 29)))

    def want(u, ignore):
        valid = u[u != ignore]
        lo = min(0, int(valid.min())) if valid.numel() else 0
        hi = max(0, int(valid.max())) if valid.numel() else 0
        checksum = sum(mixed(i, int(v)) for i, v in enumerate(u.tolist())) % (1 << 64)
        return [lo, hi, checksum - (1 << 64) if checksum >= 1 << 63 else checksum, int((u != ignore).sum())]

    for n, ignore in [(1, -100), (7, -100), (2048, -100), (2049, 5), (5000, -1), (4097, 0)]:
        t = torch.randint(0, 50, (n,), generator=g)
        t[torch.rand(n, generator=g) < 0.3] = ignore
        for bad in (None, -7, 50, 1 << 40):
            u = t.clone()
            if bad is not None:
                u[n // 2] = bad
            expected = want(u, ignore)
            assert int(checksums.target_checksum(u)) == expected[2], (n, ignore, bad, "torch version")
            got = target_facts(u.to(device), ignore).tolist()  # the valid count in the fourth slot
            assert got == expected, (n, ignore, bad, got, expected)
            for vocab in (50, 51, 1 << 41):  # the flag of the deferred check: an id outside [0, vocab)
                facts, flag, count = target_facts(u.to(device), ignore, vocab)
                assert facts.tolist() == expected[:3] and flag.dtype == torch.bool and flag.dim() == 0
                out_of_range = expected[0] < 0 or expected[1] >= vocab
                assert bool(flag) == out_of_range, (n, ignore, bad, vocab)
                # the mean's divisor: the valid count in fp32, NaN where an id is out of range
                assert count.dtype == torch.float32 and count.dim() == 0
                if out_of_range:
                    assert count.isnan(), (n, ignore, bad, vocab, count)
                else:
                    assert count.item() == int((u != ignore).sum()), (n, ignore, bad, vocab, count)
            # written straight into a given buffer (on a GPU, pinned host memory: no copy after it)
            host = torch.empty(3, dtype=torch.int64, pin_memory=device == "cuda")
            written = target_facts(u.to(device), ignore, 50, out=host)
            if device == "cuda":
                torch.cuda.synchronize()
            assert written[0] is host and host.tolist() == expected[:3], (n, ignore, bad, host)
            if bad != 1 << 40:
                assert target_facts(u.to(device, torch.int32), ignore).tolist() == expected, (n, bad, "int32")
        if n >= 3 and len(set(t[:3].tolist())) == 3:  # a 3-cycle of the first ids changes the checksum
            cycled = t.clone()
            cycled[[0, 1, 2]] = t[[1, 2, 0]]
            assert target_facts(cycled.to(device), ignore)[2] != target_facts(t.to(device), ignore)[2], n
    for n in (1, 4095, 65536, 65536 * 2 + 3):  # one word; a partial tile; one program; three
        words = torch.randint(-(1 << 31), 1 << 31, (n,), generator=g, dtype=torch.int64).to(torch.int32)
        want_sum = int(checksums.word_checksum(words))
        assert int(word_checksum(words.to(device))) == want_sum, n
        if n > 1:  # two words swapped: another checksum
            assert int(word_checksum(words.flip(0).contiguous().to(device))) != want_sum, n
    print("TARGET_FACTS_OK")
    """
)


_ON_DEVICES = pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))])


def _run_checks(script: str, device: str, done: str) -> None:
    """``script`` run for ``device`` in a fresh Python (in Triton's interpreter on the CPU), which
    prints ``done`` once every check in it has passed."""
    proc = _run_interpreted(script, device) if device == "cpu" else subprocess.run(
        [sys.executable, "-c", script, device], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0 and done in proc.stdout, proc.stdout[-2000:] + proc.stderr[-4000:]


@_ON_DEVICES
def test_target_facts_kernel(device):
    # the front door's one launch: [min(0, lowest valid id), max(0, highest), the target checksum]
    # (and, given a vocab size, whether an id lies outside it and the valid count, NaN if so) for
    # ignored ids anywhere, one and several 2048-wide tiles, int64 and int32 targets, equal to the
    # torch version and to Python integers; and the hidden states' replication checksum (mixed
    # 32-bit words) equal to its torch version across program boundaries
    _run_checks(_TARGET_FACTS_CHECKS, device, "TARGET_FACTS_OK")


_MEAN_CHECKS = textwrap.dedent(
    """
    import sys
    import torch
    from vparallel_ce import stats
    from vparallel_ce.kernels import triton_ce
    device = sys.argv[1]
    g = torch.Generator().manual_seed(0)
    for n in (0, 1, 7, 4096, 4097, 16384, 16385):  # empty, one tile, a partial tile, four, past one program
        x = (torch.rand(n, generator=g, dtype=torch.float64) * 12).to(torch.float32)
        for divisor in (torch.tensor(max(n - 3, 0)), torch.tensor(float(n) / 3, dtype=torch.float64),
                        torch.tensor(5.0), torch.tensor(0.0), torch.tensor(float("nan"))):
            got = triton_ce.reduce(x.to(device), divisor.to(device), "mean")
            want = x.double().sum() / divisor.to(torch.float32).double()  # the divisor rounded to fp32 first
            assert got.dtype == torch.float32 and got.dim() == 0 and got.device.type == device, (n, divisor)
            if want.isnan() or want.isinf():
                assert (got.isnan() and want.isnan()) or got.item() == want.item(), (n, divisor, got, want)
            else:
                assert abs(got.item() - want.item()) <= 2e-7 * abs(want.item()) + 1e-30, (n, divisor, got, want)
        for reduction in ("sum", "none"):  # as torch does them
            assert torch.equal(triton_ce.reduce(x.to(device), None, reduction), stats.reduce(x.to(device), None, reduction))
    print("MEAN_OK")
    """
)


@_ON_DEVICES
def test_mean_kernel(device):
    # the "mean" of a loss' per-token values in one launch: the divisor (a count, a float64
    # num_valid_tokens, 0, NaN) rounded to fp32 first, an IEEE division, within fp32 summation
    # error of the float64 mean, for empty, one-tile, multi-tile inputs and past one program's cap
    _run_checks(_MEAN_CHECKS, device, "MEAN_OK")


# ------------------------------------------------------------------------------------- the settings

_SETTINGS_FROM_ENVIRONMENT = textwrap.dedent(
    r"""
    import os
    import torch
    from vparallel_ce import kernels
    # set before the process started: read at import
    found = kernels.settings()
    assert found == kernels.KernelSettings(kernels.KernelChoice.TORCH, fused=False, warp_specialized=True), found
    # changed afterwards: no effect on the settings of any later call
    os.environ["VPARALLEL_CE_KERNELS"] = "triton"
    os.environ["VPARALLEL_CE_FUSED"] = "1"
    del os.environ["VPARALLEL_CE_FUSED_WS"]
    assert kernels.settings() == found
    assert kernels.ops_for(torch.zeros(2, 3)) is kernels.TORCH_OPS
    assert not kernels.fused_applies("cuda", torch.bfloat16)
    print("SETTINGS_OK")
    """
)


def test_settings_come_from_the_environment_at_import_only():
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path, "VPARALLEL_CE_KERNELS": "torch", "VPARALLEL_CE_FUSED": "0",
           "VPARALLEL_CE_FUSED_WS": "1"}
    proc = run_python("-c", _SETTINGS_FROM_ENVIRONMENT, env=env, cwd=ROOT, timeout=240)
    assert proc.returncode == 0 and "SETTINGS_OK" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-4000:]


def test_environment_changes_after_import_change_no_choice(monkeypatch):
    from vparallel_ce import kernels

    x = torch.zeros(2, 3)
    before, ops = kernels.settings(), kernels.ops_for(x)
    monkeypatch.setenv("VPARALLEL_CE_KERNELS", "torch" if before.choice is kernels.KernelChoice.TRITON else "triton")
    monkeypatch.setenv("VPARALLEL_CE_FUSED", "1" if not before.fused else "0")
    monkeypatch.setenv("VPARALLEL_CE_FUSED_WS", "1" if not before.warp_specialized else "0")
    assert kernels.settings() == before
    assert kernels.ops_for(x) is ops


def test_use_sets_the_backend_for_its_block_and_restores_it():
    from vparallel_ce import kernels

    x = torch.zeros(2, 3)
    before = kernels.settings()
    with kernels.use("triton") as chosen:
        assert kernels.settings() == chosen == kernels.KernelSettings("triton", before.fused, before.warp_specialized)
        assert kernels.ops_for(x).name.startswith("triton")  # CPU tensors too, when asked
        with kernels.use("torch"):
            assert kernels.ops_for(x) is kernels.TORCH_OPS
            assert not kernels.fused_applies("cuda", torch.bfloat16)
        assert kernels.ops_for(x).name.startswith("triton")
        with kernels.use(fused=False):  # only what is given changes
            assert kernels.settings().choice is kernels.KernelChoice.TRITON
            assert kernels.ops_for(x).name == "triton" and kernels.ops_for(x).fused is None
    assert kernels.settings() == before
    with pytest.raises(RuntimeError, match="inside"):  # an exception leaves the block's settings too
        with kernels.use(kernels.KernelChoice.TORCH, fused=False, warp_specialized=True):
            raise RuntimeError("inside")
    assert kernels.settings() == before


@pytest.mark.parametrize("kwargs,message", [
    (dict(kernels="cuda"), "kernels must be one of 'auto', 'torch', 'triton', got 'cuda'"),
    (dict(kernels="Torch"), "got 'Torch'"),
    (dict(fused=1), "fused must be True or False, got 1"),
    (dict(warp_specialized="yes"), "warp_specialized must be True or False, got 'yes'"),
])
def test_use_rejects_bad_arguments_when_called(kwargs, message):
    from vparallel_ce import kernels

    with pytest.raises(ValueError, match=re.escape(message)):
        kernels.use(**kwargs)  # before any block is entered


def test_settings_from_an_environment():
    from vparallel_ce.kernels import KernelChoice, KernelSettings

    assert KernelSettings.from_environment({}) == KernelSettings(KernelChoice.AUTO, True, False)
    env = {"VPARALLEL_CE_KERNELS": "", "VPARALLEL_CE_FUSED": "0", "VPARALLEL_CE_FUSED_WS": "1"}
    assert KernelSettings.from_environment(env) == KernelSettings(KernelChoice.AUTO, False, True)
    with pytest.raises(ValueError, match=re.escape("VPARALLEL_CE_KERNELS must be one of 'auto', 'torch', 'triton', "
                                                   "got 'cpu'")):
        KernelSettings.from_environment({"VPARALLEL_CE_KERNELS": "cpu"})
    with pytest.raises(ValueError, match=re.escape("VPARALLEL_CE_FUSED must be 0 or 1, got 'false'")):
        KernelSettings.from_environment({"VPARALLEL_CE_FUSED": "false"})
    with pytest.raises(ValueError, match=re.escape("KernelSettings.fused must be True or False, got 'no'")):
        KernelSettings(fused="no")


@pytest.mark.parametrize("op", ["cross_entropy", "linear_cross_entropy", "token_logprobs", "linear_token_logprobs"])
def test_a_backward_runs_with_the_kernel_settings_of_its_forward(op, monkeypatch):
    # a call keeps the settings in force at its front door: its backward (which autograd may run
    # on a thread of its own, outside the caller's use block) picks its kernels with those
    import vparallel_ce
    from vparallel_ce import kernels

    seen = []
    real = kernels.ops_for
    monkeypatch.setattr(kernels, "ops_for", lambda x, current=None: seen.append(current) or real(x, current))
    h = torch.randn(6, 4, requires_grad=True)
    w = torch.randn(9, 4, requires_grad=True)
    t = torch.randint(0, 9, (6,))
    x = (h @ w.T).detach().requires_grad_()
    with kernels.use("torch", fused=False) as chosen:
        out = {"cross_entropy": lambda: vparallel_ce.cross_entropy(x, t, chunks=1),
               "linear_cross_entropy": lambda: vparallel_ce.linear_cross_entropy(h, w, t, chunks=2, recompute=True),
               "token_logprobs": lambda: vparallel_ce.token_logprobs(x, t).sum(),
               "linear_token_logprobs": lambda: vparallel_ce.linear_token_logprobs(h, w, t).sum()}[op]()
    forward_calls = len(seen)
    out.backward()
    assert forward_calls >= 1 and len(seen) > forward_calls, seen
    assert all(s == chosen for s in seen), (chosen, seen)
    assert chosen != kernels.settings()