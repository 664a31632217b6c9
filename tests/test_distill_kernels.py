"""The distillation ops' Triton local passes (``vparallel_ce.kernels.triton_distill``) against their
torch reference in :mod:`vparallel_ce.divergence`, step by step and through the two ops.

On CPU the kernels run under the Triton interpreter, in a fresh subprocess (``TRITON_INTERPRET=1``
must be set before triton is first imported). With CUDA, the compiled kernels are compared the same
way, and the full ops, Triton path vs ``kernels.use("torch")``.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tests.test_kernels import _run_interpreted

ROOT = Path(__file__).resolve().parents[1]
HAS_TRITON = importlib.util.find_spec("triton") is not None

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")

# Every step of every divergence, temperature and hard-term mode, on logits with the values that
# decide a row's special cases; argv[1] is the device.
_STEP_CHECKS = textwrap.dedent(
    r"""
    import itertools, sys
    import torch
    from vparallel_ce import divergence as dv
    from vparallel_ce.kernels import triton_distill as td

    dev = sys.argv[1]
    torch.manual_seed(0)
    NEG = float("-inf")


    def problem(c, width, dtype, offset):
        s = (torch.randn(c, width) * 3).to(dtype)
        t = (torch.randn(c, width) * 3).to(dtype)
        if width > 2 and c > 4:
            s[0, 1] = 30.0        # a dominant student logit
            t[1, :] = NEG         # a teacher row masked on this whole shard
            s[2, width - 1] = NEG  # one masked student logit, in the ragged last tile
            t[2, 0] = NEG
            t[3, 1] = float("nan")  # a nan teacher logit: the row's statistics are nan
        local_t = torch.randint(0, max(width, 1), (c,))
        owned = torch.rand(c) < 0.7
        return s.to(dev), t.to(dev), local_t.to(dev), owned.to(dev)


    def close(got, ref, what):
        assert got.shape == ref.shape and got.dtype == ref.dtype, (what, got.shape, ref.shape, got.dtype, ref.dtype)
        assert torch.equal(got.isnan(), ref.isnan()), (what, "nan positions", got, ref)
        g, r = got.double().nan_to_num(0.0), ref.double().nan_to_num(0.0)
        tol = 1e-5 if got.dtype == torch.float32 else 1e-2
        err = ((g - r).abs() / (r.abs() + 1.0)).max().item() if g.numel() else 0.0
        assert err <= tol, (what, err)


    class World:  # a layout of one rank: divergence.statistics' collectives are no-ops
        group = None


    ran = 0
    kinds = list(dv.Divergence)
    # every option at a one-tile width; the multi-tile walk (a ragged last tile past 2048 columns) and
    # a 1-column shard at one setting each
    cases = list(itertools.product([(6, 300)], [torch.float32, torch.bfloat16], kinds, [1.0, 0.7], [0.0, 0.4]))
    cases += [((5, 2048 + 37), torch.bfloat16, kind, 0.7, 0.4) for kind in kinds]
    cases += [((1, 1), torch.float32, kind, 1.0, 0.4) for kind in kinds]
    for (c, width), dtype, kind, T, hw in cases:
        spec = dv.DistillSpec(kind, 0.3 if kind is dv.Divergence.JSD else 0.5, T, hw)
        s, t, local_t, owned = problem(c, width, dtype, 0)
        what = f"{c}x{width} {dtype} {kind.value} T={T} hard={hw}"
        m_ref, m = dv.local_maxima(s, t, spec), td.maxima(s, t, spec)
        close(m, m_ref, what + " maxima")
        # the global maxima as another rank may have raised them, and -inf where a row is masked everywhere
        g = m_ref + torch.rand_like(m_ref)
        if c > 4:
            g[0, 1] = NEG
        close(td.sums(s, t, g, spec), dv.local_sums(s, t, g, spec), what + " sums")
        # statistics of a world of one, their JSD pass and the gradient for per-token weights with a 0
        st = dv.statistics(s, t, local_t, owned, spec, World())
        if kind is dv.Divergence.JSD:
            close(td.mixture_sums(s, t, st, spec), dv.local_mixture_sums(s, t, st, spec), what + " mixture")
        weight = torch.rand(c, device=dev) + 0.5
        weight[-1] = 0.0
        for out_dtype in (None, torch.float32):
            close(td.grad(s, t, local_t, owned, st, weight, spec, out_dtype),
                  dv.grad_student(s, t, local_t, owned, st, weight, spec, out_dtype), what + f" grad {out_dtype}")
        ran += 1
    print("DISTILL_STEPS_OK", ran)
    """
)

def _run(script: str, device: str) -> subprocess.CompletedProcess:
    """``script`` in a fresh Python: on ``"cpu"`` under the Triton interpreter
    (:func:`tests.test_kernels._run_interpreted`), else with the compiled kernels."""
    if device == "cpu":
        return _run_interpreted(script, device)
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "VPARALLEL_CE_KERNELS")}
    return subprocess.run([sys.executable, "-c", script, device], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=240)


@pytest.mark.slow
def test_each_step_matches_the_torch_reference_in_the_interpreter():
    proc = _run(_STEP_CHECKS, "cpu")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "DISTILL_STEPS_OK" in proc.stdout


# Both ops through the Triton backend (forced with kernels.use("triton") under the interpreter),
# loss and student gradients against the torch backend's: every kind, the KLs' other with a
# temperature, a hard term and three chunks (the steps' own check covers every option).
_OP_CHECKS = textwrap.dedent(
    r"""
    import sys
    import torch
    import vparallel_ce
    from vparallel_ce import kernels

    dev = sys.argv[1]
    torch.manual_seed(0)
    n, hs, ht, V = 24, 24, 32, 300
    target = torch.randint(0, V, (n,), device=dev)
    target[3] = -100
    ran = 0
    for kind, opts in (("forward_kl", dict()), ("reverse_kl", dict(temperature=2.0, hard_weight=0.3, chunks=3)),
                       ("jsd", dict(temperature=2.0, hard_weight=0.3, chunks=3))):
        g = torch.Generator().manual_seed(ran)
        h = torch.randn(n, hs, generator=g).to(dev, torch.bfloat16).requires_grad_()
        w = (torch.randn(V, hs, generator=g) * 0.3).to(dev, torch.bfloat16).requires_grad_()
        th = torch.randn(n, ht, generator=g).to(dev, torch.bfloat16)
        tw = (torch.randn(V, ht, generator=g) * 0.3).to(dev, torch.bfloat16)
        out = {}
        for choice in ("triton", "torch"):
            with kernels.use(choice):
                fused = vparallel_ce.linear_distillation_loss(h, w, th, tw, target, kind=kind, **opts)
                dh, dw = torch.autograd.grad(fused, (h, w))
                s = (h.detach() @ w.detach().t()).requires_grad_()
                plain = vparallel_ce.distillation_loss(s, th @ tw.t(), target, kind=kind, **opts)
                (ds,) = torch.autograd.grad(plain, (s,))
            out[choice] = (fused, dh, dw, plain, ds)
        for name, a, b in zip(("fused loss", "dh", "dW", "logits loss", "ds"), out["triton"], out["torch"]):
            # within the bf16 rounding of the logits' gradient, relative to the tensor's largest entry
            err = ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()
            assert err <= 1e-2, (kind, opts, name, err)
        ran += 1
    print("DISTILL_OPS_OK", ran)
    """
)


# The plan counts the Triton passes' memory only where they run: every tensor they read must be one
# the kernels take (a fp64 teacher, or a sparse one, keeps the torch passes and their temporaries).
_PLAN_CHECKS = textwrap.dedent(
    r"""
    import torch
    from vparallel_ce import kernels
    from vparallel_ce.distillation_call import distillation_call, linear_distillation_call
    from vparallel_ce.kernels import triton_distill
    from vparallel_ce.options import Options
    from vparallel_ce.topk import TopKTeacher

    def row_kernels(call):
        return any("the logits' gradient" in line for line in call.plan.why)

    s = torch.randn(8, 50)
    sparse = TopKTeacher(torch.arange(3).repeat(8, 1), torch.full((8, 3), -2.0))
    cases = [("triton", s, torch.randn(8, 50), True), ("triton", s, torch.randn(8, 50).double(), False),
             ("triton", s.bfloat16(), torch.randn(8, 50).double(), False), ("triton", s.double(), s, False),
             ("triton", s, sparse, False), ("auto", s, torch.randn(8, 50), False), ("torch", s, s, False)]
    for choice, student, teacher, want in cases:
        with kernels.use(choice):
            call, inp, rows = distillation_call(student, teacher, None, group=None, options=Options())
            runs = (call.ops(inp.x).distill is triton_distill.STEPS and not isinstance(teacher, TopKTeacher)
                    and triton_distill._covered(inp.x, rows))
        assert row_kernels(call) == want == runs, (choice, student.dtype, type(teacher), row_kernels(call), runs)
    for dtype, want in ((torch.float32, True), (torch.float64, False)):
        with kernels.use("triton"):
            hs, ws, ht, wt = (torch.randn(8, 4, dtype=dtype), torch.randn(50, 4, dtype=dtype),
                              torch.randn(8, 6, dtype=dtype), torch.randn(50, 6, dtype=dtype))
            call, _, _ = linear_distillation_call(hs, ws, ht, wt, None, None, None, group=None, options=Options())
        assert row_kernels(call) == want, (dtype, call.plan.why)
    print("DISTILL_PLAN_OK")
    """
)


def test_the_plan_counts_the_triton_passes_only_where_they_run():
    proc = _run(_PLAN_CHECKS, "cpu")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "DISTILL_PLAN_OK" in proc.stdout


@pytest.mark.slow
def test_both_ops_on_the_triton_backend_match_the_torch_backend_in_the_interpreter():
    proc = _run(_OP_CHECKS, "cpu")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "DISTILL_OPS_OK" in proc.stdout


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@cuda
def test_each_step_matches_the_torch_reference_on_cuda():
    proc = _run(_STEP_CHECKS, "cuda")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "DISTILL_STEPS_OK" in proc.stdout


@cuda
def test_both_ops_on_the_triton_backend_match_the_torch_backend_on_cuda():
    proc = _run(_OP_CHECKS, "cuda")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "DISTILL_OPS_OK" in proc.stdout
