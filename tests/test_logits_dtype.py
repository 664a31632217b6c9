"""``logits_dtype=torch.float32``: the linear ops' log-probs, entropy, loss and gradients from the
lm_head GEMM's fp32 result, for bf16 inputs.

Every case is compared with a float64 reference computed from the SAME bf16-rounded inputs, so
what the default path loses is the bf16 rounding of the logits alone. The logits are large
(standard deviation ~8, as a trained lm_head's are) so that this rounding is visible: the
outputs' error of the default path is asserted to be there (~1e-3 relative) and that of the fp32
path to be at fp32 rounding (< 1e-5). The hidden and weight gradients' GEMMs take the logits'
gradient rounded to bf16 (as the default path makes it), so both paths' are at bf16 rounding; the
bias gradient sums the fp32 one. Each case runs on bf16 tensors and on fp32 master weights under
``torch.autocast`` (bf16 matmuls, gradients returned in fp32, where the bias gradient's precision
shows). TP 1, 2 and 3 (uneven shards of V=37), token and vocab schedules, every backward mode
(gradients in forward, from kept logits, recomputed), chunks 1 and 3, reductions.
"""

from __future__ import annotations

import math

import pytest
import torch

import vparallel_ce
from vparallel_ce import policy as _policy
from tests.dist import errors_of, run_ranks
from tests.reference import reference_loss, rel_err, shard

N, H, V = 24, 64, 37
IGNORE = -100

# op, reduction, schedule, chunks, recompute: each backward mode of linear.py
CASES = [
    ("loss", "mean", "token", 1, None),  # logits kept (one rank: turned into their gradient by the statistics)
    ("loss", "sum", "token", 3, None),  # gradients made in forward, dW summed over chunks
    ("loss", "none", "token", 3, None),  # recomputed in backward
    ("loss", "mean", "vocab", 3, None),  # vocab blocks, recomputed
    ("loss", "mean", "token", 1, True),
    ("logprobs", "none", "token", 1, None),  # logits kept for the backward
    ("logprobs", "none", "token", 3, None),
    ("logprobs", "none", "vocab", 3, None),
]

MODES = ("bf16", "autocast")  # bf16 inputs; fp32 master weights under a bf16 torch.autocast

# relative to the largest reference value
FP32_OUT, DEFAULT_OUT_MIN = 1e-5, 5e-5  # fp32 path at most / default path at least (bf16 logits)
BF16_GRAD = 1e-2  # gradients made by GEMMs of a bf16 logits' gradient: within its rounding


def _data(seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, H, generator=g).bfloat16()
    w = (torch.randn(V, H, generator=g) * (8 / math.sqrt(H))).bfloat16()
    b = torch.randn(V, generator=g).bfloat16()
    t = torch.randint(0, V, (N,), generator=g)
    t[::5] = IGNORE
    u = torch.randn(N, generator=g)  # upstream gradients of per-token outputs
    v = torch.randn(N, generator=g)
    return h, w, b, t, u, v


def _objective(op, reduction, out, u, v):
    """A scalar of the op's outputs whose gradient reaches every output."""
    if op == "logprobs":
        logp, ent = out
        return (logp * u).sum() + (ent * v).sum()
    return (out * u).sum() if reduction == "none" else out


def _reference(op, reduction, h, w, b, t, u, v):
    """Outputs and (dh, dW, db) in float64 from the bf16 inputs as they are."""
    h, w, b = (x.double().requires_grad_() for x in (h, w, b))
    x = h @ w.t() + b
    if op == "logprobs":
        logp_all = torch.log_softmax(x, -1)
        valid = t != IGNORE
        logp = torch.where(valid, logp_all.gather(1, t.clamp(min=0)[:, None])[:, 0], 0)
        ent = torch.where(valid, -(logp_all.exp() * logp_all).sum(-1), 0)
        out = (logp, ent)
    else:
        out = reference_loss(x, t, ignore_index=IGNORE, reduction=reduction)
    _objective(op, reduction, out, u, v).backward()
    return out, (h.grad, w.grad, b.grad)


def _run(op, reduction, schedule, chunks, recompute, logits_dtype, mode, h, w, b, t, u, v, group):
    h, w, b = ((x.float() if mode == "autocast" else x.clone()).requires_grad_() for x in (h, w, b))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "autocast"):
        out = _op(op, reduction, schedule, chunks, recompute, logits_dtype, h, w, b, t, group)
    _objective(op, reduction, out, u, v).backward()
    return out, (h.grad, w.grad, b.grad)


def _op(op, reduction, schedule, chunks, recompute, logits_dtype, h, w, b, t, group):
    if op == "logprobs":
        return vparallel_ce.linear_token_logprobs(h, w, t, b, group=group, with_entropy=True, chunks=chunks,
                                                  policy=_schedule_policy(schedule), logits_dtype=logits_dtype)
    return vparallel_ce.linear_cross_entropy(h, w, t, b, group=group, reduction=reduction, chunks=chunks,
                                             schedule=schedule, recompute=recompute, logits_dtype=logits_dtype)


def _schedule_policy(schedule):
    # the log-prob ops take no schedule: a budget below one token's row makes the policy walk vocab blocks
    return vparallel_ce.ChunkPolicy(budget_bytes=1) if schedule == "vocab" else None


def _errors(rank, world, group, case, mode, data):
    """{(case, quantity): (error of fp32 logits, error of the default)} on this rank."""
    op, reduction, schedule, chunks, recompute = case
    h, w, b, t, u, v = data
    ref_out, ref_grads = _reference(op, reduction, h, w, b, t, u, v)
    mine = [shard(x, world, rank, 0).contiguous() for x in (w, b)]
    got = {dt: _run(op, reduction, schedule, chunks, recompute, dt, mode, h, mine[0], mine[1], t, u, v, group)
           for dt in (torch.float32, None)}
    ref_outs = ref_out if op == "logprobs" else (ref_out,)
    names = ("logp", "entropy") if op == "logprobs" else (f"loss {reduction}",)
    errors = {}
    for i, name in enumerate(names):
        errors[name] = tuple(rel_err((o if op == "logprobs" else (o,))[i], ref_outs[i]) for o, _ in
                             (got[torch.float32], got[None]))
    for i, name in enumerate(("d hidden", "d weight", "d bias")):
        full = ref_grads[i]
        expect = full if i == 0 else shard(full, world, rank, 0)
        errors[name] = tuple(rel_err(g[i], expect, full) for _, g in (got[torch.float32], got[None]))
    return {(f"{mode} {op} {reduction} {schedule} chunks={chunks} recompute={recompute} tp={world}", k): e
            for k, e in errors.items()}


def _disagreement_errors(rank, world, group, data):
    h, w, b, t, _, _ = data
    w = shard(w, world, rank, 0).contiguous()
    odd = rank == world - 1
    return errors_of({
        "logits_dtype differs": lambda: vparallel_ce.linear_token_logprobs(
            h, w, t, group=group, logits_dtype=torch.float32 if odd else None),
        "logits_dtype invalid on one rank": lambda: vparallel_ce.linear_cross_entropy(
            h, w, t, group=group, logits_dtype=torch.bfloat16 if odd else torch.float32),
    })


def grid_rank(rank, world):
    import torch.distributed as dist

    group = dist.group.WORLD if world > 1 else None
    data = _data()
    errors = {}
    for case in CASES:
        for mode in MODES:
            errors.update(_errors(rank, world, group, case, mode, data))
    return errors, (_disagreement_errors(rank, world, group, data) if world > 1 else {})


def _failures(errors: dict) -> list[str]:
    bad = []
    for (case, what), (fp32, default) in errors.items():
        if what in ("d hidden", "d weight") or (what == "d bias" and case.startswith("bf16")):
            # bf16 rounding of the logits' gradient (or of the returned gradient) bounds both paths
            if not (fp32 <= BF16_GRAD and fp32 <= 1.25 * default):
                bad.append(f"{case}: {what}: fp32 logits {fp32:.2e} (want <= {BF16_GRAD:g} and not above the "
                           f"default's), default {default:.2e}")
        elif not (fp32 <= FP32_OUT and default >= DEFAULT_OUT_MIN):
            bad.append(f"{case}: {what}: fp32 logits {fp32:.2e} (want <= {FP32_OUT:g}), default {default:.2e} "
                       f"(want >= {DEFAULT_OUT_MIN:g}: the bf16 rounding this test must see)")
    return bad


@pytest.mark.parametrize("world", [1, 2, 3])
def test_fp32_logits_match_float64_of_the_bf16_inputs(world):
    results = run_ranks(grid_rank, world, timeout=120) if world > 1 else [grid_rank(0, 1)]
    bad = [f"rank {r}: {line}" for r, (errors, _) in enumerate(results) for line in _failures(errors)]
    assert not bad, "\n".join(bad)
    for rank, (_, disagreements) in enumerate(results):
        for name, error in disagreements.items():
            assert error is not None, f"{name}: rank {rank} did not raise"
            assert "logits_dtype" in error or "logits dtype" in error, f"{name}: rank {rank}: {error}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fp32_logits_of_fp32_and_fp64_inputs_change_nothing(dtype):
    h, w, b, t, _, _ = _data(2)
    h, w, b = h.to(dtype), w.to(dtype), b.to(dtype)
    for chunks in (1, 3):
        base = vparallel_ce.linear_cross_entropy(h, w, t, b, chunks=chunks)
        assert torch.equal(vparallel_ce.linear_cross_entropy(h, w, t, b, chunks=chunks, logits_dtype=torch.float32),
                           base), f"{dtype} chunks={chunks}"


@pytest.mark.parametrize("bad", [torch.bfloat16, torch.float64, "float32", 32])
def test_an_invalid_logits_dtype_raises_naming_it(bad):
    """Alone (no group) the check's ValueError; on a group every rank raises InvalidInputError
    (:func:`grid_rank`)."""
    h, w, b, t, _, _ = _data(3)
    for op in (vparallel_ce.linear_cross_entropy, vparallel_ce.linear_token_logprobs):
        with pytest.raises(ValueError, match="logits_dtype must be None or torch.float32"):
            op(h, w, t, b, logits_dtype=bad)


def test_the_registry_module_forwards_logits_dtype():
    h, w, b, t, _, _ = _data(4)
    loss = vparallel_ce.build_loss_fn("linear_cross_entropy", logits_dtype=torch.float32)
    assert torch.equal(loss(h, w, t, b), vparallel_ce.linear_cross_entropy(h, w, t, b, logits_dtype=torch.float32))


def test_the_memory_model_counts_fp32_logits():
    """fp32 logits of bf16 operands: 4 bytes a logit, plus their gradient's bf16 copy for the GEMMs;
    a memory target that one token chunk of bf16 logits fits then needs vocab blocks."""
    n, vocab, hid = 8192, 151936, 4096
    one = _policy.Plan("token", 1, _policy.GradMode.RECOMPUTE)
    base = _policy.peak_bytes(one, n, vocab, hidden_size=hid)
    wide = _policy.peak_bytes(one, n, vocab, hidden_size=hid, logits_dtype=torch.float32)
    assert wide - base == n * vocab * 4
    target = _policy.ChunkPolicy(memory_bytes=6 << 30)
    narrow = target.plan(n, vocab, 1, hidden_size=hid)
    fp32 = target.plan(n, vocab, 1, hidden_size=hid, logits_dtype=torch.float32)
    assert (narrow.schedule, narrow.chunks, fp32.schedule) == ("token", 1, "vocab"), (narrow, fp32)
    assert _policy.peak_bytes(fp32, n, vocab, hidden_size=hid, logits_dtype=torch.float32) <= target.memory_bytes
    shown = _policy.explain(n, vocab, hidden_size=hid, policy=target, logits_dtype=torch.float32)
    assert f"{fp32.chunks} vocab blocks" in shown, shown


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fp32_logit_log_probs_on_cuda_are_within_2e_6_of_float64_at_a_model_hidden_size():
    """cuBLAS's fp32-output GEMM over a long K (H = 4096) truncates its running sum; the fp32 path
    splits K in two halves added with round-to-nearest, which keeps the log-probs within 2e-6
    (relative to the largest) of float64 of the same bf16 inputs -- one GEMM was 2.5e-6 off."""
    n, hidden, vocab = 1024, 4096, 32768
    g = torch.Generator().manual_seed(0)
    h = torch.randn(n, hidden, generator=g).bfloat16().cuda()
    w = (torch.randn(vocab, hidden, generator=g) * (2 / math.sqrt(hidden))).bfloat16().cuda()
    t = torch.randint(0, vocab, (n,), generator=g).cuda()
    x = h.double() @ w.double().t()
    want = x.gather(1, t[:, None])[:, 0] - torch.logsumexp(x, -1)
    got = vparallel_ce.linear_token_logprobs(h, w, t, logits_dtype=torch.float32)
    err = ((got.double() - want).abs().max() / want.abs().max()).item()
    assert err <= 2e-6, f"fp32-logit log-probs {err:.2e} off float64"


def test_fp32_logits_turn_the_fused_gemm_kernels_off():
    """The fused kernels sum all of H in one tensor-core accumulator; fp32 logits take the cuBLAS
    path in two halves of H instead (so the call's kernel settings say fused=False)."""
    from vparallel_ce.call import linear_call
    from vparallel_ce.options import Options

    h, w, _, t, _, _ = _data(5)
    for asked, fused in ((None, True), (torch.float32, False)):
        call, _ = linear_call(h, w, t, None, op="linear_cross_entropy", group=None,
                              options=Options(logits_dtype=asked))
        assert call.kernels.fused is fused, (asked, call.kernels)
    fp32_call, _ = linear_call(h.float(), w.float(), t, None, op="linear_cross_entropy", group=None,
                               options=Options(logits_dtype=torch.float32))
    assert fp32_call.kernels.fused, "fp32 matmuls already make fp32 logits: nothing to turn off"


@pytest.mark.parametrize("bias", [False, True])
def test_the_fp32_logits_gradient_is_made_once_in_the_matmul_dtype_unless_a_bias_sums_it(bias, monkeypatch):
    # recomputed blocks of fp32 logits: without a bias nothing sums their gradient in fp32, so the
    # gradient pass writes it in bf16 for the two GEMMs (no fp32 copy written and read back); with a
    # bias it stays fp32 for db. Same values either way (one rounding), checked against float64
    # by the tests above.
    import dataclasses

    from vparallel_ce import kernels, stats

    asked = []

    def spy(x, *args, **kwargs):
        asked.append((x.dtype, args[-1] if len(args) == 6 else None))
        return stats.grad_logits(x, *args, **kwargs)

    monkeypatch.setattr(kernels, "TORCH_OPS", dataclasses.replace(kernels.TORCH_OPS, grad_logits=spy))
    g = torch.Generator().manual_seed(3)
    h = torch.randn(12, 8, generator=g).bfloat16().requires_grad_()
    w = torch.randn(40, 8, generator=g).bfloat16().requires_grad_()
    b = torch.randn(40, generator=g).bfloat16().requires_grad_() if bias else None
    t = torch.randint(0, 40, (12,), generator=g)
    with vparallel_ce.kernels.use("torch"):
        loss = vparallel_ce.linear_cross_entropy(h, w, t, bias=b, logits_dtype=torch.float32, schedule="vocab",
                                                 chunks=2)
        loss.backward()
    backward = [a for a in asked if a[0] == torch.float32]
    assert backward, asked
    want = torch.float32 if bias else torch.bfloat16
    assert all((out or torch.float32) == want for _, out in backward), asked
