"""Specification of ``batch_invariant=True`` (``vparallel_ce.invariant``, docs/rl.md "Batch invariance").

With the option on, a token's per-token outputs -- log-prob, entropy, loss with ``reduction="none"``
-- and its row of the logits' / hidden's gradient are BITWISE equal (``torch.equal``) whatever the
other tokens of the call: the token alone (N=1), at position 137 of N=300, at position 5 of N=130
(other random rows each time), each with ``chunks`` 1, 3 and "auto". Checked for the four ops, fp32
and bf16 inputs, at TP 1, 2 and 3 (uneven shards: V=521) on gloo, and at TP 1 and 2 on CUDA where
there is a GPU. The mode is also checked to be right (against a float64 reference of the gathered
logits) and agreed across ranks (a rank that disagrees raises on every rank). With
``sequence_parallel`` (the linear ops, TP 3) a row is the replicated row's, whichever rank holds it,
at any position, whatever the other ranks hold. Token sums (dW, a mean loss) are not batch invariant and
are not asserted to be.
"""

from __future__ import annotations

import importlib.util
import textwrap

import pytest
import torch

import vparallel_ce
from tests.dist import errors_of, run_ranks
from tests.reference import shard

V, H, ROW = 521, 32, 137
TILE = 128
# (tokens in the call, the row's position in it): alone, then inside two other batches
CONTEXTS = ((1, 0), (300, ROW), (130, 5))
CHUNKS = (1, 3, "auto")
# every context with every chunks value would be 9 calls per op; the chunk counts are varied where
# they change the chunking most (N=300: 1, 2 or 3 chunks of whole tiles)
RUNS = [((1, 0), 1), ((1, 0), "auto"), ((300, ROW), 1), ((300, ROW), 3), ((300, ROW), "auto"), ((130, 5), 3)]
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _batch(n: int, pos: int, row_h, row_t, seed: int, vocab: int = V):
    """``n`` random hidden rows and targets with the studied row at ``pos`` (some targets ignored)."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, row_h.shape[0], generator=g, dtype=torch.float64)
    t = torch.randint(0, vocab, (n,), generator=g)
    t[torch.rand(n, generator=g) < 0.2] = -100
    h[pos], t[pos] = row_h, row_t
    return h, t


def support_of(t: torch.Tensor, vocab: int) -> torch.Tensor:
    """Each token's sampling set (``support=``): its target and the next three ids, padded with -1;
    the whole vocabulary (a row of -1) for an ignored token and for a target divisible by 5."""
    ids = torch.cat([(t.clamp(min=0).unsqueeze(-1) + torch.arange(4)) % vocab, torch.full((t.numel(), 2), -1)], -1)
    ids[(t == -100) | (t % 5 == 0)] = -1
    return ids


def _ops(rank, world, group, dtype, weight, device):
    """Each op as ``fn(h_full [n, H] float64, t) -> (outputs, gradient rows)`` on this rank, with a
    fixed upstream gradient per token (the row's is the same in every context); the inputs are
    made on the CPU and moved to ``device``."""
    w = shard(weight, world, rank, 0).to(device, dtype)

    def upstream(t):  # the same weight for every token: the studied row's is the same in every batch
        return torch.full((t.numel(),), 0.75, device=device)

    def logits_op(name):
        def run(h, t, chunks, invariant=True):
            # the logits themselves made row by row in float64 (a GEMM of N rows is what this mode
            # avoids inside the ops: the test's input must not depend on N either)
            x = shard(torch.stack([r @ weight.t() for r in h]), world, rank).to(device, dtype).requires_grad_()
            t = t.to(device)
            u = upstream(t)
            if name == "token_logprobs":
                lp, ent = vparallel_ce.token_logprobs(x, t, group=group, with_entropy=True, chunks=chunks,
                                                      temperature=0.8, batch_invariant=invariant)
                (lp * u + 0.3 * ent * u).sum().backward()
                outs = (lp, ent)
            else:
                loss = vparallel_ce.cross_entropy(x, t, group=group, reduction="none", chunks=chunks,
                                                  label_smoothing=0.1, batch_invariant=invariant)
                (loss * u).sum().backward()
                outs = (loss,)
            return outs, x.grad
        return run

    def linear_op(name):
        def run(h, t, chunks, invariant=True):
            hh = h.to(device, dtype).requires_grad_()
            t = t.to(device)
            ww = w.detach().clone().requires_grad_()
            u = upstream(t)
            if name.startswith("linear_token_logprobs"):
                sets = support_of(t.cpu(), weight.shape[0]).to(device) if name.endswith("support") else None
                lp, ent = vparallel_ce.linear_token_logprobs(hh, ww, t, group=group, with_entropy=True, support=sets,
                                                             chunks=chunks, batch_invariant=invariant)
                (lp * u - 0.2 * ent * u).sum().backward()
                outs = (lp, ent)
            else:
                loss = vparallel_ce.linear_cross_entropy(hh, ww, t, group=group, reduction="none", chunks=chunks,
                                                         z_loss=1e-3, batch_invariant=invariant)
                (loss * u).sum().backward()
                outs = (loss,)
            return outs, hh.grad
        return run

    return {name: logits_op(name) for name in ("token_logprobs", "cross_entropy")} | {
        name: linear_op(name) for name in LINEAR_OPS}


# the linear ops as the tests name them: the sampling-set path of linear_token_logprobs is the third
LINEAR_OPS = ("linear_token_logprobs", "linear_cross_entropy", "linear_token_logprobs support")


def _reference(name, h, weight, t, pos, round_to=None):
    """float64 outputs and gradient row of token ``pos`` (full vocab, plain torch); ``round_to``:
    the logits ops' input dtype, which the given logits were rounded to."""
    hh = h.clone().requires_grad_()
    x = hh @ weight.t()
    xx = (x if round_to is None else x.to(round_to).double()).detach().requires_grad_()
    tok = t[pos]
    if name == "token_logprobs":
        logp = torch.log_softmax(xx[pos] / 0.8, -1)
        outs = (logp[tok], -(logp.exp() * logp).sum())
        (0.75 * outs[0] + 0.3 * 0.75 * outs[1]).backward()
        return outs, xx.grad[pos]
    if name == "cross_entropy":
        loss = torch.nn.functional.cross_entropy(xx[pos : pos + 1], t[pos : pos + 1], label_smoothing=0.1)
        (0.75 * loss).backward()
        return (loss,), xx.grad[pos]
    if name.endswith("support"):
        ids = support_of(t[pos : pos + 1], weight.shape[0])[0]
        logp = torch.log_softmax(x[pos][ids[ids >= 0]], -1)  # the target is the set's first id
        outs = (logp[0], -(logp.exp() * logp).sum())
        (0.75 * outs[0] - 0.2 * 0.75 * outs[1]).backward()
        return outs, hh.grad[pos]
    logp = torch.log_softmax(x[pos], -1)
    if name == "linear_token_logprobs":
        outs = (logp[tok], -(logp.exp() * logp).sum())
        (0.75 * outs[0] - 0.2 * 0.75 * outs[1]).backward()
    else:
        lse = torch.logsumexp(x[pos], -1)
        outs = (-logp[tok] + 1e-3 * lse**2,)
        (0.75 * outs[0]).backward()
    return outs, hh.grad[pos]


def invariance_rank(rank, world, dtype_name, device="cpu"):
    """TP ``world`` and, on the first two ranks, TP 2 (one pool of processes: spawning is the cost)."""
    import torch.distributed as dist

    if world == 1:
        return _invariance(0, 1, None, dtype_name, device)
    pair = dist.new_group([0, 1])  # every rank takes part in making it
    failures = _invariance(rank, 2, pair, dtype_name, device) if rank < 2 else []
    return failures + _invariance(rank, world, dist.group.WORLD, dtype_name, device)


def _invariance(rank, world, group, dtype_name, device="cpu", *, names=None, runs=RUNS, vocab=V, hidden=H,
                compare_default=True):
    """The failures of the ops (``names``: all) in ``runs`` at ``vocab x hidden``: the studied row's
    outputs and gradient row bitwise equal in every run, right against float64 in the first (and,
    ``compare_default``, every row close to the default mode's at N=300, chunks=3)."""
    dtype = getattr(torch, dtype_name)
    g = torch.Generator().manual_seed(11)
    weight = torch.randn(vocab, hidden, generator=g, dtype=torch.float64) * (0.4 if hidden <= 64 else 2.0 / hidden**0.5)
    row_h = torch.randn(hidden, generator=g, dtype=torch.float64)
    row_t = torch.tensor(321)  # owned by rank 0 at TP 2, rank 0 at TP 3 (at V=521)
    failures = []
    for name, op in _ops(rank, world, group, dtype, weight, device).items():
        if names is not None and name not in names:
            continue
        seen = None
        for (n, pos), chunks in runs:
            h, t = _batch(n, pos, row_h, row_t, seed=n, vocab=vocab)
            outs, grad = op(h, t, chunks)
            mine = tuple(o[pos].cpu() for o in outs) + (grad[pos].cpu(),)
            where = f"{name} {dtype_name} TP{world} N={n} pos={pos} chunks={chunks}"
            if compare_default and n > 2 * TILE and chunks == 3:  # every row of every tile, padded last one included
                default_outs, default_grad = op(h, t, chunks, invariant=False)
                for i, (got, want) in enumerate(zip((*outs, grad), (*default_outs, default_grad))):
                    err = (got.double() - want.double()).abs().max().item() / want.double().abs().max().item()
                    if not err <= TOL[dtype] * 4:
                        failures.append(f"{where}: output {i} off the default mode's by {err:.2e}")
            if seen is None:
                seen, first = mine, where
                # right, not only invariant: the float64 reference of the same (rounded) inputs
                logits_op = name in ("token_logprobs", "cross_entropy")
                hr, wr = (h, weight) if logits_op else (h.to(dtype).double(), weight.to(dtype).double())
                ref_outs, ref_grad = _reference(name, hr, wr, t, pos, round_to=dtype if logits_op else None)
                ref_grad = shard(ref_grad, world, rank) if name in ("token_logprobs", "cross_entropy") else ref_grad
                for got, want in zip(mine, (*ref_outs, ref_grad)):
                    err = (got.double() - want).abs().max().item() / max(want.abs().max().item(), 1e-30)
                    if not err <= TOL[dtype] * 4:
                        failures.append(f"{where}: relative error {err:.2e} against float64")
                continue
            for i, (a, b) in enumerate(zip(seen, mine)):
                if not torch.equal(a, b):
                    failures.append(f"{where}: output {i} differs bitwise from {first} "
                                    f"(max |diff| {(a.double() - b.double()).abs().max().item():.3e})")
    return failures


def _assert_invariant(world, dtype, device):
    results = (run_ranks(invariance_rank, world, dtype, device) if world > 1
               else [invariance_rank(0, 1, dtype, device)])
    failures = [f for per_rank in results for f in per_rank]
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("world", [1, 3])  # world 3 runs TP 2 on two of its ranks too
def test_rows_are_bitwise_identical_whatever_the_batch(world, dtype):
    _assert_invariant(world, dtype, "cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("world", [1, 2])
def test_rows_are_bitwise_identical_on_cuda(world, dtype):
    """The same on CUDA tensors (ranks of one GPU, gloo carrying CUDA tensors): cuBLAS picks its
    kernels by shape, so this is where a shape-dependent GEMM would show."""
    _assert_invariant(world, dtype, "cuda")


# The kernel path under Triton's interpreter (fp32: the interpreter's bf16 dot is not exact). Its
# tl.dot is numpy's matmul, whose BLAS sums a product row in an order that depends on the row's
# position in the block -- a GPU's MMA instruction does not -- so the script gives the interpreter a
# dot that sums every element's products in K order, and what is checked is that the kernels and
# their host code let no other row, no row position and no chunking into a row's sums.
KERNEL_RUNS = [((1, 0), 1), ((40, 37), 3), ((20, 5), "auto")]  # (with token chunks of whole 16-row tiles)
_KERNEL_PATH = textwrap.dedent(
    r"""
    import os
    assert os.environ["TRITON_INTERPRET"] == "1"
    import numpy as np
    from triton.runtime import interpreter

    def dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        prod = a.data.astype(np.float32)[:, :, None] * b.data.astype(np.float32)[None, :, :]
        return interpreter.TensorHandle((prod.sum(axis=1) + d.data).astype(d.data.dtype), d.dtype.scalar)

    interpreter.InterpreterBuilder.create_dot = dot
    from vparallel_ce.kernels import row_gemm
    ran = dict.fromkeys(["logits", "add_rows_mm_"], 0)
    for name in ran:  # counted: the mode must run these (its backend is made on first use, after this)
        def counted(*a, _name=name, _fn=getattr(row_gemm, name), **k):
            ran[_name] += 1
            return _fn(*a, **k)
        setattr(row_gemm, name, counted)
    from tests import test_batch_invariance as spec
    from vparallel_ce import invariant
    invariant.TILE_ROWS = 16  # token chunks of whole 16-row tiles: several chunks at few rows (the interpreter's cost)
    # linear_cross_entropy and the set op over one block (dh written by one GEMM), the log-probs over
    # three (V=521 in blocks of 256: a row's statistics merged and dh summed over them in order)
    failures = spec._invariance(0, 1, None, "float32", names=spec.LINEAR_OPS[1:], runs=spec.KERNEL_RUNS,
                                compare_default=False)
    invariant.VOCAB_BLOCK_COLUMNS = 256
    failures += spec._invariance(0, 1, None, "float32", names=spec.LINEAR_OPS[:1], runs=spec.KERNEL_RUNS,
                                 compare_default=False)
    assert not failures, "\n".join(failures)
    assert all(ran.values()), ran
    print("FUSED_CHECKS_OK", ran)
    """
)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_kernel_path_rows_are_bitwise_identical_in_interpreter():
    """The mode's Triton path (fixed-config GEMMs for the logits and dh, the row passes) under the
    interpreter: the three linear ops at TP 1 over one or three vocab blocks, a row alone and at two
    positions of other batches, chunked differently, bitwise equal and right against float64."""
    from tests.test_fused_linear import _interpreted

    _interpreted(_KERNEL_PATH, kernels="triton")


def sized_invariance_rank(rank, world, vocab, hidden):
    """The linear ops in bf16 on CUDA at ``vocab x hidden`` (ranks of one GPU, gloo)."""
    import torch.distributed as dist

    from vparallel_ce import invariant, kernels

    bf16 = torch.zeros(1, device="cuda", dtype=torch.bfloat16)
    assert invariant.ops_for(bf16, kernels.settings()).name == "invariant:triton"
    group = dist.group.WORLD if world > 1 else None
    return _invariance(rank, world, group, "bfloat16", "cuda", names=LINEAR_OPS, vocab=vocab, hidden=hidden,
                       compare_default=False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("vocab,hidden", [(5003, 512), (18992, 4096)])
def test_kernel_path_rows_are_bitwise_identical_on_cuda_at_larger_sizes(world, vocab, hidden):
    """bf16 on a GPU, where the mode runs its Triton path (fixed-config GEMMs for the logits and dh,
    the row passes): the three linear ops at an odd vocab and at a Qwen3-8B TP=8 shard's size, TP 1
    and 2."""
    results = (run_ranks(sized_invariance_rank, world, vocab, hidden) if world > 1
               else [sized_invariance_rank(0, 1, vocab, hidden)])
    failures = [f for per_rank in results for f in per_rank]
    assert not failures, "\n".join(failures)


def test_tiles_and_chunks_of_whole_tiles():
    from vparallel_ce import invariant
    from vparallel_ce.stats import token_slices

    assert invariant.tiles(300) == [slice(0, 128), slice(128, 256), slice(256, 300)]
    assert token_slices(300, 2, tile=128) == [slice(0, 256), slice(256, 300)]
    assert token_slices(300, 5, tile=128) == [slice(0, 128), slice(128, 256), slice(256, 300)]
    a = torch.randn(128, 700)
    torch.testing.assert_close(invariant.block_row_sum(a), a.double().sum(-1).float(), rtol=1e-5, atol=1e-4)


def test_the_option_survives_the_compiled_key():
    from vparallel_ce.graph_key import decode, key_of
    from vparallel_ce.options import Options

    options = Options(reduction="none", batch_invariant=True)
    assert decode(key_of(options, None))[0] == options


def test_plan_makes_gradients_in_backward_over_the_same_vocab_blocks_whatever_the_arguments():
    """Gradients never made in forward for 1 and scaled after (another rounding of a row); token
    chunks or one chunk of vocab blocks as the policy chooses by N, the blocks a function of the
    shard's width alone; logits kept from forward where the policy keeps them (one chunk)."""
    from vparallel_ce import invariant
    from vparallel_ce.policy import GradMode

    policy = vparallel_ce.policy.DEFAULT_POLICY
    seen = set()
    for n in (1, 300, 8192, 100_000):
        p = invariant.plan(policy, n, 151_936, 1, hidden_size=4096, reduction="mean", chunks="auto",
                           logits_dtype=None)
        assert p.grad_mode is not GradMode.IN_FORWARD, (n, p)
        seen.add(p.schedule)
    assert seen == {"token", "vocab"}  # both walks, over the same blocks:
    assert [(b.start, b.stop) for b in invariant.blocks(151_936)] == [(i * 30464, min((i + 1) * 30464, 151_936))
                                                                     for i in range(5)]
    assert invariant.plan(policy, 1, 50_000, 2, hidden_size=64, reduction="mean", chunks="auto",
                          logits_dtype=None).grad_mode is GradMode.FROM_KEPT_LOGITS


# sequence parallelism at TP 3: (tokens on each rank, the rank holding the studied row, its
# position there); alone first, then inside other batches, on each rank
SP_CONTEXTS = (((1, 0, 0), 0, 0), ((300, 130, 5), 0, ROW), ((130, 300, 0), 1, ROW), ((7, 1, 260), 2, 0),
               ((0, 200, 3), 1, 150))


def sequence_parallel_rank(rank, world, dtype_name, device="cpu"):
    """The linear ops with ``sequence_parallel=True``: the studied row's outputs and
    ``hidden.grad`` row from the rank holding it, in each of :data:`SP_CONTEXTS` (chunks 3), and
    the same row replicated on every rank without sequence parallelism (``"replicated"``)."""
    import torch.distributed as dist

    dtype = getattr(torch, dtype_name)
    g = torch.Generator().manual_seed(11)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64) * 0.4
    row_h = torch.randn(H, generator=g, dtype=torch.float64)
    w = shard(weight, world, rank, 0).to(device, dtype)
    seen = {}
    for name in ("linear_token_logprobs", "linear_cross_entropy"):
        for k, (counts, owner, pos) in [("replicated", ((1,) * world, rank, 0)), *enumerate(SP_CONTEXTS)]:
            n, sp = counts[rank], k != "replicated"
            h, t = _batch(max(n, 1), pos if rank == owner else 0, row_h, torch.tensor(321), seed=10 * (k if sp else 9) + rank)
            hh = h[:n].to(device, dtype).requires_grad_()
            t = t[:n].to(device)
            ww = w.detach().clone().requires_grad_()
            u = torch.full((n,), 0.75, device=device)
            if name == "linear_token_logprobs":
                lp, ent = vparallel_ce.linear_token_logprobs(hh, ww, t, group=dist.group.WORLD, with_entropy=True,
                                                             chunks=3, sequence_parallel=sp, batch_invariant=True)
                (lp * u - 0.2 * ent * u).sum().backward()
                outs = (lp, ent)
            else:
                loss = vparallel_ce.linear_cross_entropy(hh, ww, t, group=dist.group.WORLD, reduction="none", chunks=3,
                                                         sequence_parallel=sp, batch_invariant=True)
                (loss * u).sum().backward()
                outs = (loss,)
            if rank == owner:
                seen[(name, k, rank)] = tuple(o[pos].detach().cpu() for o in outs) + (hh.grad[pos].cpu(),)
    return seen


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rows_are_bitwise_identical_with_sequence_parallelism(dtype):
    """With each rank holding its own tokens the row's outputs and hidden-gradient row are those of
    the row replicated without sequence parallelism (which the tests above check against float64),
    whichever rank holds it, at what position, whatever the other ranks hold."""
    results = run_ranks(sequence_parallel_rank, 3, dtype)
    seen = {key: value for per_rank in results for key, value in per_rank.items()}
    failures = []
    for name in ("linear_token_logprobs", "linear_cross_entropy"):
        want = seen[(name, "replicated", 0)]
        for k, (counts, owner, pos) in enumerate(SP_CONTEXTS):
            for i, (a, b) in enumerate(zip(want, seen[(name, k, owner)])):
                if not torch.equal(a, b):
                    failures.append(f"{name} {dtype} sequence parallel {counts} on rank {owner}: output {i} differs "
                                    f"bitwise from the replicated row (max |diff| "
                                    f"{(a.double() - b.double()).abs().max().item():.3e})")
    assert not failures, "\n".join(failures)


def bad_rank(rank, world):
    import torch.distributed as dist

    group = dist.group.WORLD
    x = torch.randn(4, 2)
    t = torch.tensor([0, 3, 7, 11])
    h, w = torch.randn(4, 5), torch.randn(2, 5)
    return errors_of({
        "disagree": lambda: vparallel_ce.token_logprobs(x, t, group=group, batch_invariant=rank == 1),
        "not a bool": lambda: vparallel_ce.cross_entropy(x, t, group=group, batch_invariant=1),
    })


def test_bad_input_raises_on_every_rank():
    expected = {"disagree": "disagree on batch invariant", "not a bool": "batch_invariant must be True or False"}
    for errs in run_ranks(bad_rank, 3):
        for name, text in expected.items():
            assert errs[name] is not None and text in errs[name], (name, errs[name])


def test_on_cpu_the_mode_runs_the_torch_tiles_and_never_the_default_kernels(monkeypatch):
    # the default mode's kernel choice is never asked for, even where Triton is chosen: on a CPU
    # (no interpreter) the mode runs torch one tile at a time; its own Triton path is for GPUs
    # (test_kernel_path_rows_are_bitwise_identical_in_interpreter, docs/rl.md)
    from vparallel_ce import invariant, kernels

    with kernels.use("triton"):
        assert invariant.ops_for(torch.zeros(1), kernels.settings()) is invariant.OPS

    def refuse(*args, **kwargs):
        raise AssertionError("kernels.ops_for called in batch-invariant mode")

    monkeypatch.setattr(kernels, "ops_for", refuse)
    x = torch.randn(5, 40, requires_grad=True)
    h, w = torch.randn(5, 8, requires_grad=True), torch.randn(40, 8, requires_grad=True)
    t = torch.tensor([1, 7, -100, 39, 0])
    with kernels.use("triton"):
        lp = vparallel_ce.token_logprobs(x, t, batch_invariant=True)
        ce = vparallel_ce.cross_entropy(x, t, reduction="none", batch_invariant=True)
        llp = vparallel_ce.linear_token_logprobs(h, w, t, batch_invariant=True)
        lce = vparallel_ce.linear_cross_entropy(h, w, t, batch_invariant=True)
        (lp.sum() + ce.sum() + llp.sum() + lce).backward()
    assert x.grad is not None and h.grad is not None and w.grad is not None


def empty_shard_rank(rank, world):
    """V=4 over 3 ranks: shards of 2, 2 and 0 columns; the mode against the default one."""
    import torch.distributed as dist

    group = dist.group.WORLD
    g = torch.Generator().manual_seed(5)
    hidden, weight = torch.randn(150, 6, generator=g), torch.randn(4, 6, generator=g)
    t = torch.randint(0, 4, (150,), generator=g)
    w = shard(weight, world, rank, 0)
    x = hidden @ w.t()
    failures = []
    for name, f in {
        "token_logprobs": lambda inv: vparallel_ce.token_logprobs(x, t, group=group, with_entropy=True,
                                                                  batch_invariant=inv)[1],
        "cross_entropy": lambda inv: vparallel_ce.cross_entropy(x, t, group=group, reduction="none",
                                                                batch_invariant=inv),
        "linear_token_logprobs": lambda inv: vparallel_ce.linear_token_logprobs(hidden, w, t, group=group,
                                                                                batch_invariant=inv),
        "linear_cross_entropy": lambda inv: vparallel_ce.linear_cross_entropy(hidden, w, t, group=group,
                                                                              batch_invariant=inv),
    }.items():
        if not torch.allclose(f(True), f(False), rtol=1e-5, atol=1e-6):
            failures.append(f"{name} rank {rank} (local vocab {w.shape[0]})")
    return failures


def test_empty_shards():
    failures = [f for per_rank in run_ranks(empty_shard_rank, 3) for f in per_rank]
    assert not failures, failures
