"""``linear_distillation_loss`` against float64 references on materialised full logits (the
divergences written out with log_softmax, ``tests/reference.py``) and against
``distillation_loss`` on this rank's materialised logits: loss and the student's hidden, weight and
bias gradients, at TP 1-4 with uneven and empty vocab shards, ``H_s != H_t``, token chunks 1, 3 and
"auto", sequence parallelism, DTensor inputs, bf16 autocast, torch.compile, and bad input raising
on every rank."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

import pytest
import torch

import vparallel_ce
from tests.dist import errors_of, one_thread, run_ranks
from tests.reference import TOL, local_grad, reference_distillation, rel_err, shard

H_S, H_T = 5, 6  # the student's and the teacher's hidden sizes differ
TOKENS = (2, 4)  # token dims of hidden and target
KINDS = [("forward_kl", 0.5), ("reverse_kl", 0.5), ("jsd", 0.1), ("jsd", 0.5), ("jsd", 0.9)]
CHUNKS = (1, 3, "auto")


@dataclass(frozen=True)
class Case:
    kind: str = "forward_kl"
    beta: float = 0.5
    temperature: float = 1.0
    hard_weight: float = 0.0
    reduction: str = "mean"
    target: str = "some ignored"  # or "no target"
    chunks: int | str = 1
    vocab: int = 7
    bias: bool = True
    seed: int = 0
    h_s: int = H_S

    @property
    def options(self) -> dict:
        return dict(kind=self.kind, beta=self.beta, temperature=self.temperature, hard_weight=self.hard_weight,
                    reduction=self.reduction)


def grid(vocab: int):
    """Every kind x temperature x hard weight x reduction x target pattern (the hard term needs a
    target), the chunk count and the bias turning from case to case."""
    combos = itertools.product(KINDS, (1.0, 2.0), (0.0, 0.5), ("mean", "sum", "none"), ("some ignored", "no target"))
    cases = []
    for (kind, beta), temperature, hard, reduction, target in combos:
        if target == "no target" and hard:
            continue
        i = len(cases)
        cases.append(Case(kind, beta, temperature, hard, reduction, target, CHUNKS[i % 3], vocab, bias=i % 2 == 0,
                          seed=i))
    return cases


@dataclass
class Full:
    """The whole problem in float64: both models' hidden states and full lm_heads, the target."""

    hs: torch.Tensor
    ws: torch.Tensor
    bs: torch.Tensor | None
    ht: torch.Tensor
    wt: torch.Tensor
    bt: torch.Tensor | None
    target: torch.Tensor | None

    @classmethod
    def of(cls, case: Case) -> "Full":
        g = torch.Generator().manual_seed(case.seed)

        def rand(*shape, scale=1.0):
            return torch.randn(*shape, generator=g, dtype=torch.float64) * scale

        target = torch.randint(0, case.vocab, TOKENS, generator=g)
        target[0, 1] = target[1, 3] = -100
        return cls(rand(*TOKENS, case.h_s), rand(case.vocab, case.h_s, scale=0.8), rand(case.vocab) if case.bias else None,
                   rand(*TOKENS, H_T), rand(case.vocab, H_T, scale=0.8), rand(case.vocab) if case.bias else None,
                   None if case.target == "no target" else target)


def _leaf(x, dtype=torch.float64):
    return None if x is None else x.detach().to(dtype).clone().requires_grad_()


def _upstream(out, seed):
    # a scalar output gets 2.0 (the loss is not the last layer); per-token outputs random weights
    if out.dim() == 0:
        return 2.0
    return torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 1000), dtype=out.dtype)


def reference(full: Full, case: Case, rows: slice | None = None):
    """Loss, upstream gradient (this rank's ``rows`` of them, per token with sequence parallelism)
    and the FULL gradients ``(dh_s, dW_s, db_s)`` of all tokens, from materialised logits in float64."""
    hs, ws, bs = _leaf(full.hs), _leaf(full.ws), _leaf(full.bs)
    s = hs @ ws.T + (0 if bs is None else bs)
    t = full.ht @ full.wt.T + (0 if full.bt is None else full.bt)
    ref = reference_distillation(s, t, full.target, **case.options)
    g = _upstream(ref, case.seed)
    (ref * g).sum().backward()
    ref = ref.detach()
    if case.reduction == "none" and rows is not None:  # sequence parallel: this rank's tokens (every
        ref, g = ref.reshape(-1)[rows], g.reshape(-1)[rows]  # rank's upstream gradient reaches dW)
    return ref, g, (hs.grad, ws.grad, None if bs is None else bs.grad)


def compare(name: str, out, grads, ref, ref_grads, *, world: int, rank: int, rows=slice(None), tol=1e-10) -> list[str]:
    """Failures naming the case: the loss, and each gradient against this rank's part of the full
    reference gradient (hidden: all of it, or ``rows`` of it with sequence parallelism; weight and
    bias: this rank's vocab shard), each judged on the scale of the whole reference gradient."""
    failures = []
    if out.shape != ref.shape:
        return [f"{name}: output shape {tuple(out.shape)}, expected {tuple(ref.shape)}"]
    if not torch.equal(out.isnan(), ref.isnan()) or rel_err(out.nan_to_num(), ref.nan_to_num()) > tol:
        failures.append(f"{name}: loss {out.tolist()} vs reference {ref.tolist()}")
    dh, dw, db = ref_grads
    mine = (dh.reshape(-1, dh.shape[-1])[rows], shard(dw, world, rank, 0),
            None if db is None else shard(db, world, rank))
    for what, got, want, whole in zip(("hidden", "weight", "bias"), grads, mine, ref_grads):
        if want is None:
            continue
        if got is None:
            failures.append(f"{name}: no {what} gradient")
            continue
        err = rel_err(got.reshape(want.shape), want, whole)
        if not err <= tol:
            failures.append(f"{name}: {what} gradient error {err:.3g}")
    return failures


def check_case(rank: int, world: int, group, case: Case) -> list[str]:
    """One case on this rank's vocab shard (replicated tokens): against the float64 reference and
    against ``distillation_loss`` on this rank's materialised logits; the teacher gets no gradient."""
    name = f"TP {world} rank {rank} {case}"
    full = Full.of(case)
    ref, g, ref_grads = reference(full, case)
    hs = _leaf(full.hs)
    ws, bs = _leaf(shard(full.ws, world, rank, 0)), _leaf(None if full.bs is None else shard(full.bs, world, rank))
    ht, wt = _leaf(full.ht), _leaf(shard(full.wt, world, rank, 0))
    bt = _leaf(None if full.bt is None else shard(full.bt, world, rank))
    out = vparallel_ce.linear_distillation_loss(hs, ws, ht, wt, full.target, student_bias=bs, teacher_bias=bt,
                                                group=group, chunks=case.chunks, **case.options)
    (out * g).sum().backward()
    failures = compare(name, out.detach(), (hs.grad, ws.grad, None if bs is None else bs.grad), ref, ref_grads,
                       world=world, rank=rank)
    if out.dtype != torch.float64:
        failures.append(f"{name}: loss dtype {out.dtype}")
    if any(x is not None and x.grad is not None for x in (ht, wt, bt)):
        failures.append(f"{name}: the teacher got a gradient")
    # the same op on materialised logits: same loss, same weight and bias gradients
    ws2, bs2 = _leaf(ws), _leaf(bs)
    s = full.hs @ ws2.T + (0 if bs2 is None else bs2)
    t = full.ht @ wt.detach().T + (0 if bt is None else bt.detach())
    logits_out = vparallel_ce.distillation_loss(s, t, full.target, group=group, chunks=case.chunks, **case.options)
    (logits_out * g).sum().backward()
    if rel_err(out.detach(), logits_out.detach()) > 1e-12:
        failures.append(f"{name}: loss {out.tolist()} vs distillation_loss {logits_out.tolist()}")
    pairs = [("weight", ws, ws2, ref_grads[1])] + ([("bias", bs, bs2, ref_grads[2])] if bs is not None else [])
    for what, a, b, scale in pairs:
        if rel_err(a.grad, b.grad, scale) > 1e-12:
            failures.append(f"{name}: {what} gradient differs from distillation_loss's")
    return failures


@pytest.fixture(autouse=True)
def _single_threaded():
    with one_thread():
        yield


def _assert_clean(results):
    lines = [f for res in results for f in res]
    assert not lines, f"{len(lines)} failed checks:\n" + "\n".join(lines[:15])


def test_the_comparison_catches_a_wrong_gradient():
    # the checks themselves: a gradient off by 1e-6, a missing all-reduce of dh (one rank's partial
    # sum) or a bias gradient of the wrong shard must each be reported
    case = Case(kind="jsd", temperature=2.0, hard_weight=0.5, vocab=7)
    full = Full.of(case)
    ref, _, (dh, dw, db) = reference(full, case)
    ok = compare("exact", ref, (dh, shard(dw, 2, 0, 0), shard(db, 2, 0)), ref, (dh, dw, db), world=2, rank=0)
    assert ok == []
    wrong = {
        "off by 1e-6": (dh * (1 + 1e-6), shard(dw, 2, 0, 0), shard(db, 2, 0)),
        "dh not summed over the group": (0.5 * dh, shard(dw, 2, 0, 0), shard(db, 2, 0)),
        "weight of the other shard": (dh, shard(dw, 2, 1, 0)[:3].repeat(2, 1)[:4], shard(db, 2, 0)),
        "bias zero": (dh, shard(dw, 2, 0, 0), torch.zeros(4, dtype=torch.float64)),
    }
    for what, grads in wrong.items():
        assert compare(what, ref, grads, ref, (dh, dw, db), world=2, rank=0), what
    assert compare("loss", ref * (1 + 1e-8), (dh, shard(dw, 2, 0, 0), shard(db, 2, 0)), ref, (dh, dw, db),
                   world=2, rank=0)


def test_every_kind_temperature_hard_weight_reduction_target_and_chunks_at_tp1():
    _assert_clean([check_case(0, 1, None, case) for case in grid(7)])


def grid_rank(rank, world, group, vocabs, every):
    """Every ``every``-th case of the grid (the suite's time budget), the vocab size turning."""
    failures = []
    for j, case in enumerate(grid(0)[::every]):
        failures += check_case(rank, world, group, replace(case, vocab=vocabs[j % len(vocabs)]))
    return failures


def sequence_parallel_rank(rank, world, group):
    """Each rank holds its own tokens (5 and 3 of 8): loss over the group's tokens, this rank's
    rows of the full hidden gradient."""
    failures = []
    split = [5, 3]
    mine = slice(sum(split[:rank]), sum(split[: rank + 1]))
    cases = [Case(kind, beta, 2.0, hard, reduction, target, chunks, vocab=7, seed=50 + i)
             for i, ((kind, beta), reduction, (hard, target), chunks) in enumerate(itertools.product(
                 KINDS[::2], ("mean", "none"), ((0.5, "some ignored"), (0.0, "no target")), (1, 3)))]
    cases.append(Case("reverse_kl", reduction="sum", chunks="auto", seed=70))
    for case in cases:
        full = Full.of(case)
        ref, g, ref_grads = reference(full, case, rows=mine)
        flat = lambda x: x.reshape(-1, x.shape[-1])[mine]  # noqa: E731
        hs, ht = _leaf(flat(full.hs)), flat(full.ht)
        ws, bs = _leaf(shard(full.ws, world, rank, 0)), _leaf(shard(full.bs, world, rank))
        target = None if full.target is None else full.target.reshape(-1)[mine]
        out = vparallel_ce.linear_distillation_loss(hs, ws, ht, shard(full.wt, world, rank, 0), target,
                                                    student_bias=bs, teacher_bias=shard(full.bt, world, rank),
                                                    group=group, sequence_parallel=True,
                                                    chunks=case.chunks, **case.options)
        (out * g).sum().backward()
        failures += compare(f"TP {world} rank {rank} sequence parallel {case}", out.detach(),
                            (hs.grad, ws.grad, bs.grad), ref, ref_grads, world=world, rank=rank, rows=mine)
    return failures


def dtensor_rank(rank, world, group):
    """Both lm_heads as DTensor ``Shard(0)`` and both hidden states replicated DTensors (the mesh
    gives the group)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = DeviceMesh.from_group(group, "cpu")
    failures = []
    for case in (Case("jsd", 0.3, 2.0, 0.5, "mean", chunks=3, bias=False, seed=80),
                 Case("forward_kl", reduction="none", target="no target", bias=False, seed=81)):
        full = Full.of(case)
        ref, g, ref_grads = reference(full, case)
        hs = distribute_tensor(full.hs.clone(), mesh, [Replicate()]).requires_grad_()
        ws = distribute_tensor(full.ws.clone(), mesh, [Shard(0)]).requires_grad_()
        ht = distribute_tensor(full.ht.clone(), mesh, [Replicate()])
        wt = distribute_tensor(full.wt.clone(), mesh, [Shard(0)])
        out = vparallel_ce.linear_distillation_loss(hs, ws, ht, wt, full.target, chunks=case.chunks, **case.options)
        (out * g).sum().backward()
        failures += compare(f"TP {world} rank {rank} DTensor {case}", out.detach(),
                            (local_grad(hs), local_grad(ws), None), ref, ref_grads, world=world, rank=rank)
    return failures


def bad_input_rank(rank, world, group):
    """Bad input on one rank (or all) raises on every rank, naming the problem."""
    full = Full.of(Case(vocab=7))
    hs, ht = full.hs, full.ht
    ws, wt = shard(full.ws, world, rank, 0), shard(full.wt, world, rank, 0)
    wide = torch.cat([wt, wt[:1]]) if rank == 1 else wt  # one vocab row too many on rank 1

    def call(teacher_hidden=ht, teacher_weight=wt, target=full.target, hard_weight=0.0):
        return lambda: vparallel_ce.linear_distillation_loss(hs, ws, teacher_hidden, teacher_weight, target,
                                                             group=group, hard_weight=hard_weight)

    return errors_of({
        "teacher vocab rows": call(teacher_weight=wide),
        "teacher tokens": call(teacher_hidden=ht[:, :3] if rank == 0 else ht),
        "teacher dtype": call(teacher_weight=wt.float() if rank == 0 else wt),
        "teacher hidden size": call(teacher_hidden=ht[..., :4]),
        "teacher hidden not replicated": call(teacher_hidden=ht + rank),
        "hard term without target": call(target=None, hard_weight=0.5),
    })


BAD_INPUT = {  # case -> what every rank's message must say
    "teacher vocab rows": ("rank(s) 1", "teacher_weight has 3 vocab rows on this rank but student_weight 2"),
    "teacher tokens": ("rank(s) 0", "teacher_hidden's token dims (2, 3) do not match student_hidden's (2, 4)"),
    "teacher dtype": ("rank(s) 0", "teacher_weight torch.float32"),
    "teacher hidden size": ("teacher_hidden's last dim (4) does not match teacher_weight's hidden size (6)",),
    "teacher hidden not replicated": ("disagree on hidden checksum",),
    "hard term without target": ("hard_weight=0.5 mixes in the student's cross-entropy, which needs a target",),
}


def check_bad_input(errors_per_rank) -> list[str]:
    failures = []
    for what, needles in BAD_INPUT.items():
        for rank, errors in enumerate(errors_per_rank):
            message = errors[what]
            if message is None:
                failures.append(f"bad input '{what}' did not raise on rank {rank}")
                continue
            # the rank whose input is bad raises its own problem; the others name that rank
            if not any(n in message for n in needles):
                failures.append(f"bad input '{what}' on rank {rank}: {message}")
    return failures


_GROUPS: dict = {}  # on a spawned rank: TP degree -> its group (ranks 0 .. degree - 1)


def one_gemm_rank(rank, world, group, vocabs) -> list[str]:
    """Cases whose plan makes dW by ONE GEMM over every chunk's kept logits' gradient (a student
    wide enough that the [N, V_loc] buffer is no larger than the fp32 sum over the chunks: 8 fp64
    tokens, H_s = 16), in forward (mean) and recomputed in backward (none), against the float64
    reference; with a student bias the plan keeps the fp32 sum. A spy on the gradient buffers
    says which way each call went."""
    from vparallel_ce.chunk_walk import Grads

    kept_calls = []
    original = Grads.kept_rows

    def spy(self, rows, c):
        out = original(self, rows, c)
        kept_calls.append(out is not None)
        return out

    Grads.kept_rows = spy
    failures = []
    try:
        combos = itertools.product(vocabs, (("forward_kl", 0.5), ("jsd", 0.3)), ("mean", "none"), (0.0, 0.5))
        for i, (vocab, (kind, beta), reduction, hard) in enumerate(combos):
            for bias in (False, True) if i == 0 else (False,):
                case = Case(kind, beta, 2.0, hard, reduction, chunks=3, vocab=vocab, bias=bias, seed=200 + i, h_s=16)
                kept_calls.clear()
                failures += check_case(rank, world, group, case)
                if vocab // world and (not kept_calls or any(kept_calls) != (not bias)):
                    failures.append(f"TP {world} rank {rank} {case}: dW {'summed in fp32' if any(kept_calls) else 'by one GEMM'}")
    finally:
        Grads.kept_rows = original
    return failures


def tp_rank(rank, world, degree, vocabs, every):
    """TP ``degree`` on the first ranks of one spawned group of four (process pools cost seconds
    each; the others wait): the grid's cases, at TP 2 sequence parallelism and DTensor inputs, at
    TP 4 bad input. Returns ``(failures, bad input errors or None)``."""
    import torch.distributed as dist

    if degree not in _GROUPS:  # every rank of the pool takes part in making a group
        _GROUPS[degree] = dist.group.WORLD if degree == world else dist.new_group(list(range(degree)))
    group = _GROUPS[degree]
    if degree == world:
        return grid_rank(rank, degree, group, vocabs, every), bad_input_rank(rank, degree, group)
    if rank >= degree:
        return [], None
    failures = grid_rank(rank, degree, group, vocabs, every)
    if degree == 2:
        failures += sequence_parallel_rank(rank, degree, group) + dtensor_rank(rank, degree, group)
    if degree == 3:
        failures += one_gemm_rank(rank, degree, group, vocabs)
    return failures, None


@pytest.mark.slow
def test_tp2_grid_sequence_parallel_and_dtensor():
    # V=7 over 2 ranks: 4/3 rows; V=3: 2/1
    _assert_clean([failures for failures, _ in run_ranks(tp_rank, 4, 2, (7, 3), 3, timeout=150)])


def test_dw_by_one_gemm_over_the_kept_logits_gradients_at_tp1():
    _assert_clean([one_gemm_rank(0, 1, None, (7,))])


def test_tp3_with_uneven_and_empty_shards():
    # V=7 over 3 ranks: 3/3/1; V=2: 1/1/0, an empty shard; also the one-GEMM dW cases
    _assert_clean([failures for failures, _ in run_ranks(tp_rank, 4, 3, (7, 2), 4, timeout=150)])


def test_tp4_with_an_empty_shard_and_bad_input_raising_on_every_rank():
    # V=5 over 4 ranks: 2/2/1/0 (V=7, bad input's: 2/2/2/1)
    results = run_ranks(tp_rank, 4, 4, (5,), 12, timeout=150)
    _assert_clean([failures for failures, _ in results] + [check_bad_input([errors for _, errors in results])])


def test_bf16_autocast_is_within_the_plain_bf16_paths_error():
    # fp32 inputs under CPU autocast: the four GEMMs in bf16, statistics fp32, gradients fp32 (the
    # inputs' dtype). The plain path: F.linear under the same autocast, then the float64 math.
    failures = []
    for kind, beta in KINDS[::2]:
        case = Case(kind, beta, 2.0, 0.5, "mean", chunks=3, vocab=50, seed=90)
        full = Full.of(case)
        ref, g, ref_grads = reference(full, case)
        leaves = [_leaf(x, torch.float32) for x in (full.hs, full.ws, full.bs)]
        teacher = [x.float() for x in (full.ht, full.wt, full.bt)]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = vparallel_ce.linear_distillation_loss(leaves[0], leaves[1], teacher[0], teacher[1], full.target,
                                                        student_bias=leaves[2], teacher_bias=teacher[2],
                                                        chunks=case.chunks, **case.options)
        (out * g).backward()
        plain = [_leaf(x, torch.float32) for x in (full.hs, full.ws, full.bs)]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            s = torch.nn.functional.linear(plain[0], plain[1], plain[2])
            t = torch.nn.functional.linear(*teacher)
        plain_out = reference_distillation(s, t, full.target, **case.options)
        (plain_out * g).backward()
        name = f"bf16 autocast {case}"
        if out.dtype != torch.float32 or any(x.grad.dtype != torch.float32 for x in leaves):
            failures.append(f"{name}: dtypes {out.dtype}, {[x.grad.dtype for x in leaves]}")
        for what, got, plain_x, want in zip(("loss", "hidden", "weight", "bias"),
                                            (out, *(x.grad for x in leaves)),
                                            (plain_out, *(x.grad for x in plain)), (ref, *ref_grads)):
            err, bound = rel_err(got.detach(), want), rel_err(plain_x.detach(), want)
            if not err <= max(2 * bound, TOL[torch.float32]):
                failures.append(f"{name}: {what} error {err:.3g}, the plain bf16 path's {bound:.3g}")
            if not err > TOL[torch.float64]:  # bf16 GEMMs must show: else the matmuls did not run in bf16
                failures.append(f"{name}: {what} error {err:.3g} is float64-exact under bf16 autocast")
    _assert_clean([failures])


def test_compiled_function_runs_the_op_eagerly_with_the_same_results():
    case = Case("jsd", 0.3, 2.0, 0.5, "none", chunks=3, seed=95)
    full = Full.of(case)

    def fn(hs, ws, ht, wt):
        return vparallel_ce.linear_distillation_loss(torch.tanh(hs), ws, ht, wt, full.target, chunks=3,
                                                     **case.options)

    def run(f):
        leaves = [_leaf(x, torch.float32) for x in (full.hs, full.ws)]
        out = f(*leaves, full.ht.float(), full.wt.float())
        out.sum().backward()
        return [out.detach(), *(x.grad for x in leaves)]

    torch._dynamo.reset()
    for got, want in zip(run(torch.compile(fn, backend="aot_eager")), run(fn)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_the_chunk_policy_counts_both_models_working_set():
    # "auto" plans the distillation's working set (both logits chunks and the divergence's
    # temporaries), more chunks than the cross-entropy's one logits chunk for the same budget
    from vparallel_ce.policy import ChunkPolicy, DistillShape, distillation_chunk_bytes, explain

    policy = ChunkPolicy(budget_bytes=64 * 2**20)
    n, v, tp = 4096, 32000, 2
    ce = policy.plan(n, v, tp, hidden_size=1024)
    for kind in ("forward_kl", "jsd"):
        shape = DistillShape(kind, (1024, 2048))
        plan = policy.plan(n, v, tp, distillation=shape)
        per = -(-n // plan.chunks)
        assert distillation_chunk_bytes(per, v, tp, shape=shape) <= policy.budget, (kind, plan)
        assert plan.chunks > ce.chunks, (kind, plan, ce)
        text = explain(n, v, tp, policy=policy, distillation=shape)
        assert text.startswith("linear_distillation_loss") and "working set" in text and "4 matmuls" in text, text
    logits_plan = policy.plan(n, v, tp, distillation=DistillShape("forward_kl"))
    assert logits_plan.chunks > policy.plan(n, v, tp).chunks
    assert policy.plan(n, v, tp, reduction="none", distillation=DistillShape("jsd", (8, 8))).grad_mode.value == \
        "recomputed in backward"


def test_triton_row_passes_count_only_the_logits_gradient_as_a_temporary():
    # a dense teacher's local passes as Triton kernels make no fp32 copies: D = 1, so fewer chunks
    from vparallel_ce.plan import DistillShape, distillation_chunk_bytes, local_vocab
    from vparallel_ce.policy import ChunkPolicy

    policy = ChunkPolicy(budget_bytes=64 * 2**20)
    n, v, tp, c = 4096, 32000, 2, 100
    v_loc = local_vocab(v, tp)
    for kind in ("forward_kl", "jsd"):
        torch_passes, kernels = DistillShape(kind, (1024, 2048)), DistillShape(kind, (1024, 2048), row_kernels=True)
        assert distillation_chunk_bytes(c, v, tp, shape=kernels) == c * (4 * v_loc * 3 + 4 * (1024 + 2048))
        assert distillation_chunk_bytes(c, v, tp, shape=DistillShape(kind, row_kernels=True)) == c * 4 * v_loc
        assert policy.plan(n, v, tp, distillation=kernels).chunks < policy.plan(n, v, tp, distillation=torch_passes).chunks


def test_both_distillation_ops_plan_auto_chunks_by_the_distillation_model():
    # what the front doors hand the autograd Functions: the distillation plan, not the CE's
    from vparallel_ce.distillation_call import distillation_call, linear_distillation_call
    from vparallel_ce.options import Options
    from vparallel_ce.policy import ChunkPolicy, DistillShape

    n, v = 64, 1000
    policy = ChunkPolicy(budget_bytes=16 * v * 4)  # 16 tokens of fp32 CE logits: 4 chunks for the CE
    options = Options(divergence="jsd", policy=policy)
    s, t = torch.randn(n, v), torch.randn(n, v)
    call, _, _ = distillation_call(s, t, None, group=None, options=options)
    assert call.plan == policy.plan(n, v, distillation=DistillShape("jsd")), call.plan
    assert call.plan.chunks > policy.plan(n, v).chunks == 4, call.plan
    hs, ws, ht, wt = torch.randn(n, H_S), torch.randn(v, H_S), torch.randn(n, H_T), torch.randn(v, H_T)
    call, _, _ = linear_distillation_call(hs, ws, ht, wt, None, None, None, group=None, options=options)
    assert call.plan == policy.plan(n, v, distillation=DistillShape("jsd", (H_S, H_T))), call.plan
    assert call.plan.chunks > 4, call.plan


def test_dw_is_one_gemm_where_the_kept_gradients_are_no_larger_than_the_fp32_sum():
    # several chunks: the [N, V_loc] logits' gradients in the matmul dtype replace the fp32 [V_loc, H_s]
    # sum over the chunks when N * bytes <= 4 * H_s; one chunk, sequence parallelism or a bias
    # (grad_bytes 0) keep the plain path
    from vparallel_ce.policy import ChunkPolicy, DistillShape, WeightGrad, explain

    policy = ChunkPolicy(budget_bytes=256 * 2**20)
    v = 128256
    for n, grad_bytes, chunks, want in [(8192, 2, "auto", WeightGrad.ONE_GEMM), (8193, 2, "auto", WeightGrad.CHUNK_SUM),
                                        (4096, 4, 4, WeightGrad.ONE_GEMM), (4097, 4, 4, WeightGrad.CHUNK_SUM),
                                        (8192, 0, 4, WeightGrad.CHUNK_SUM), (2048, 2, 1, WeightGrad.CHUNK_SUM)]:
        shape = DistillShape("forward_kl", (4096, 8192), True, grad_bytes)
        plan = policy.plan(n, v, 1, chunks=chunks, distillation=shape)
        assert plan.weight_grad is want, (n, grad_bytes, chunks, plan)
        if plan.chunks > 1:
            text = explain(n, v, 1, policy=policy, chunks=chunks, distillation=shape)
            assert ("dW by one GEMM" in text) == (want is WeightGrad.ONE_GEMM), text
            assert ("dW summed over the chunks in fp32" in text) == (want is WeightGrad.CHUNK_SUM), text
    # recomputing plans make dW the same way
    shape = DistillShape("jsd", (4096, 8192), True, 2)
    assert policy.plan(8192, v, 8, reduction="none", distillation=shape).weight_grad is WeightGrad.ONE_GEMM


def test_the_eager_op_launches_chunk_0s_gemms_before_autograd_runs_its_forward(monkeypatch):
    # from an idle GPU, host time before the first GEMM is GPU idle time: the Function's apply and
    # the forward's own set-up come after the first chunk's student and teacher GEMMs are queued
    from vparallel_ce import linear_distillation as ld

    order = []
    gemm, forward = ld.logits, ld._LinearDistillation.forward

    def spy_gemm(*args, **kwargs):
        order.append("gemm")
        return gemm(*args, **kwargs)

    def spy_forward(*args, **kwargs):
        order.append("forward")
        return forward(*args, **kwargs)

    monkeypatch.setattr(ld, "logits", spy_gemm)
    monkeypatch.setattr(ld._LinearDistillation, "forward", staticmethod(spy_forward))
    g = torch.Generator().manual_seed(0)
    hs = torch.randn(12, H_S, generator=g, requires_grad=True)
    ws = torch.randn(7, H_S, generator=g, requires_grad=True)
    ht, wt = torch.randn(12, H_T, generator=g), torch.randn(7, H_T, generator=g)
    target = torch.randint(0, 7, (12,), generator=g)
    for chunks in (1, 3):
        order.clear()
        vparallel_ce.linear_distillation_loss(hs, ws, ht, wt, target, chunks=chunks).backward()
        # chunk 0's student and teacher GEMMs, then the forward; then the other chunks' two GEMMs
        assert order == ["gemm", "gemm", "forward"] + ["gemm", "gemm"] * (chunks - 1), (chunks, order)


def test_the_walk_hands_chunk_0s_logits_over_once_and_keeps_no_reference_to_them():
    # the eager op holds the walk while the forward runs: chunk 0's logits must not stay alive
    # through the other chunks (one more chunk of both models' logits at the peak)
    import weakref

    from vparallel_ce import linear_distillation as ld
    from vparallel_ce.distillation_call import linear_distillation_call
    from vparallel_ce.options import Options

    g = torch.Generator().manual_seed(0)
    hs, ws = torch.randn(12, H_S, generator=g), torch.randn(7, H_S, generator=g)
    ht, wt = torch.randn(12, H_T, generator=g), torch.randn(7, H_T, generator=g)
    target = torch.randint(0, 7, (12,), generator=g)
    call, inp, rows = linear_distillation_call(hs, ws, ht, wt, target, None, None, group=None,
                                               options=Options(chunks=3))
    walk = ld._Walk(call, inp.h, inp.w, inp.b, inp.target, ld._LogitsSource(rows.h, rows.w, rows.b), True)
    h0, s0, (t0,) = walk.logits(0)
    torch.testing.assert_close(s0, hs[: len(h0)] @ ws.T)
    torch.testing.assert_close(t0, ht[: len(h0)] @ wt.T)
    alive = [weakref.ref(s0), weakref.ref(t0)]
    del h0, s0, t0
    assert [ref() for ref in alive] == [None, None]
    again = walk.logits(0)  # made anew, equal
    torch.testing.assert_close(again[1], hs[: len(again[0])] @ ws.T)
