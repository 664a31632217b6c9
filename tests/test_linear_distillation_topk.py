"""``linear_distillation_loss`` with a sparse teacher (``TopKTeacher`` in place of the teacher's
hidden states and lm_head): an offline top-k cache against a fused student. Loss and the student's
hidden, weight and bias gradients against float64 references on the materialised student logits,
in both tail modes, at TP 1-4 (uneven and empty shards), token chunks 1, 3 and "auto", sequence
parallelism; the same numbers as ``distillation_loss`` on this rank's materialised logits; ``k = V``
equal to the dense fused op; bad input raising on every rank."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import vparallel_ce
from vparallel_ce import TopKTeacher
from tests.dist import one_thread, run_ranks, unmet
from tests.reference import TOL, rel_err, shard
from tests.test_distillation import KINDS
from tests.test_distillation_topk import TAILS
from tests.test_distillation_topk import reference as topk_reference
from tests import test_linear_distillation as linear
from tests.test_linear_distillation import H_S, TOKENS, _assert_clean, _leaf, _single_threaded, _upstream, compare  # noqa: F401


@dataclass(frozen=True)
class Case(linear.Case):
    """The dense fused op's case, with the record's tail mode and ``k``."""

    tail: str = "bucket"
    k: int = 3


@dataclass
class Full(linear.Full):
    """The dense fused op's whole problem in float64 (the student's hidden states and full lm_head,
    the teacher's, the target) and the teacher's top-k record at the temperature, from its logits
    ``ht @ wt.T``."""

    ids: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None

    @classmethod
    def of(cls, case: Case) -> "Full":
        base = linear.Full.of(case)
        t = base.ht @ base.wt.T
        top = t.topk(case.k, -1).indices
        order = torch.argsort(torch.rand(top.shape, generator=torch.Generator().manual_seed(case.seed)), -1)
        ids = top.gather(-1, order)  # not in rank order
        logprobs = F.log_softmax(t / case.temperature, -1).gather(-1, ids)
        # an ignored token's record is never read; without a target every token counts
        ids[0, 1] = case.vocab + 3 if base.target is not None else ids[0, 0]
        return cls(**vars(base), ids=ids, logprobs=logprobs)

    def teacher(self, case: Case, rows: slice | None = None) -> TopKTeacher:
        """The record over the token dims, or its flat ``rows`` (a rank's own tokens)."""
        if rows is None:
            return TopKTeacher(self.ids, self.logprobs, tail=case.tail)
        flat = lambda x: x.reshape(-1, x.shape[-1])[rows]  # noqa: E731
        return TopKTeacher(flat(self.ids), flat(self.logprobs), tail=case.tail)


def reference(full: Full, case: Case, rows: slice | None = None):
    """Loss, upstream gradient (this rank's ``rows`` of them with sequence parallelism) and the FULL
    student gradients ``(dh, dW, db)``, in float64 on materialised logits."""
    hs, ws, bs = _leaf(full.hs), _leaf(full.ws), _leaf(full.bs)
    s = hs @ ws.T + (0 if bs is None else bs)
    ref = topk_reference(s, full.ids, full.logprobs, full.target, tail=case.tail, **case.options)
    g = _upstream(ref, case.seed)
    (ref * g).sum().backward()
    ref = ref.detach()
    if case.reduction == "none" and rows is not None:
        ref, g = ref.reshape(-1)[rows], g.reshape(-1)[rows]
    return ref, g, (hs.grad, ws.grad, None if bs is None else bs.grad)


def grid(vocab: int):
    """kind x T x hard weight x reduction x tail x k (1, 3, V); the target pattern, the chunk count
    and the bias turning from case to case."""
    cases = []
    combos = itertools.product(KINDS, (1.0, 2.0), (0.0, 0.5), ("mean", "sum", "none"), TAILS, (1, 3, vocab))
    for (kind, beta), temperature, hard, reduction, tail, k in combos:
        i = len(cases)
        target = "no target" if i % 4 == 1 and not hard else "some ignored"
        cases.append(Case(kind, beta, temperature, hard, reduction, target, (1, 3, "auto")[i % 3], vocab,
                          bias=i % 2 == 0, seed=i, tail=tail, k=k))
    return cases


def check_case(rank: int, world: int, group, case: Case) -> list[str]:
    """One case on this rank's vocab shard (replicated tokens): against the float64 reference and
    against ``distillation_loss`` on this rank's materialised logits with the same record."""
    name = f"TP {world} rank {rank} {case}"
    full = Full.of(case)
    ref, g, ref_grads = reference(full, case)
    hs = _leaf(full.hs)
    ws, bs = _leaf(shard(full.ws, world, rank, 0)), _leaf(None if full.bs is None else shard(full.bs, world, rank))
    lp = full.logprobs.clone().requires_grad_()  # the teacher is a constant
    teacher = TopKTeacher(full.ids, lp, tail=case.tail)
    out = vparallel_ce.linear_distillation_loss(hs, ws, teacher, target=full.target, student_bias=bs, group=group,
                                                chunks=case.chunks, **case.options)
    (out * g).sum().backward()
    failures = compare(name, out.detach(), (hs.grad, ws.grad, None if bs is None else bs.grad), ref, ref_grads,
                       world=world, rank=rank)
    if lp.grad is not None:
        failures.append(f"{name}: the teacher's log-probs got a gradient")
    ws2, bs2 = _leaf(ws), _leaf(bs)
    s = full.hs @ ws2.T + (0 if bs2 is None else bs2)
    logits_out = vparallel_ce.distillation_loss(s, TopKTeacher(full.ids, full.logprobs, tail=case.tail), full.target,
                                                group=group, chunks=case.chunks, **case.options)
    (logits_out * g).sum().backward()
    if rel_err(out.detach(), logits_out.detach()) > 1e-12:
        failures.append(f"{name}: loss {out.tolist()} vs distillation_loss {logits_out.tolist()}")
    pairs = [("weight", ws, ws2, ref_grads[1])] + ([("bias", bs, bs2, ref_grads[2])] if bs is not None else [])
    for what, a, b, scale in pairs:
        if rel_err(a.grad, b.grad, scale) > 1e-12:
            failures.append(f"{name}: {what} gradient differs from distillation_loss's")
    return failures


def dense_rank(rank: int, world: int, group) -> list[str]:
    """``k = V`` with the teacher's log-probs at every id: the dense fused op's loss and student
    gradients, in both modes, for every kind."""
    failures = []
    for j, ((kind, beta), tail) in enumerate(itertools.product(KINDS, TAILS)):
        case = Case(kind, beta, 2.0, 0.5, "none", chunks=(1, 3)[j % 2], seed=90 + j, tail=tail, k=7)
        full = Full.of(case)
        wt = shard(full.wt, world, rank, 0)
        sparse_in = [_leaf(full.hs), _leaf(shard(full.ws, world, rank, 0)), _leaf(shard(full.bs, world, rank))]
        dense_in = [_leaf(x) for x in sparse_in]
        opts = dict(group=group, chunks=case.chunks, **case.options)
        target = full.target
        sparse = vparallel_ce.linear_distillation_loss(sparse_in[0], sparse_in[1], full.teacher(case), target=target,
                                                       student_bias=sparse_in[2], **opts).reshape(TOKENS)
        dense = vparallel_ce.linear_distillation_loss(dense_in[0], dense_in[1], full.ht, wt, target,
                                                      student_bias=dense_in[2], **opts)
        g = _upstream(dense, case.seed)
        (sparse * g).sum().backward()
        (dense * g).sum().backward()
        errs = [rel_err(sparse.detach(), dense.detach())] + [rel_err(a.grad, b.grad) for a, b in zip(sparse_in, dense_in)]
        if not (sparse.isfinite().all() and max(errs) < 1e-11):
            failures.append(f"TP {world} rank {rank} k=V {tail} {kind} beta={beta}: differs from dense by {errs}")
    return failures


def sequence_parallel_rank(rank: int, world: int, group) -> list[str]:
    """Each rank holds its own tokens and their rows of the record -- 5 and 3 of 8, and for a few
    cases all 8 on one rank and none on the other, with int32 ids: the group's loss, this rank's
    rows of the full hidden gradient."""
    failures = []
    combos = itertools.product(KINDS[::2], ("mean", "none"), TAILS, ((0.5, "some ignored"), (0.0, "no target")))
    cases = [(Case(kind, beta, 2.0, hard, reduction, target, chunks=(1, 3, "auto")[i % 3], seed=60 + i, tail=tail),
              [5, 3]) for i, ((kind, beta), reduction, tail, (hard, target)) in enumerate(combos)]
    cases += [(Case("jsd", 0.3, 2.0, 0.5, reduction, chunks=3, seed=85 + i), split)
              for i, (reduction, split) in enumerate(itertools.product(("mean", "none"), ([8, 0], [0, 8])))]
    for case, split in cases:
        mine = slice(sum(split[:rank]), sum(split[: rank + 1]))
        full = Full.of(case)
        ref, g, ref_grads = reference(full, case, rows=mine)
        hs = _leaf(full.hs.reshape(-1, H_S)[mine])
        ws, bs = _leaf(shard(full.ws, world, rank, 0)), _leaf(shard(full.bs, world, rank))
        target = None if full.target is None else full.target.reshape(-1)[mine]
        teacher = full.teacher(case, mine)
        if split != [5, 3]:
            teacher = TopKTeacher(teacher.ids.to(torch.int32), teacher.logprobs, tail=teacher.tail)
        out = vparallel_ce.linear_distillation_loss(hs, ws, teacher, target=target, student_bias=bs, group=group,
                                                    sequence_parallel=True, chunks=case.chunks, **case.options)
        (out * g).sum().backward()
        failures += compare(f"TP {world} rank {rank} sequence parallel {split} {case}", out.detach(),
                            (hs.grad, ws.grad, bs.grad), ref, ref_grads, world=world, rank=rank, rows=mine)
    return failures


def accumulation_rank(rank: int, world: int, group) -> list[str]:
    """Two microbatches, each divided by the step's valid-token count (``num_valid_tokens``): their
    summed losses and gradients are the whole batch's mean."""
    case = Case(seed=3, tail="renormalize", k=4)
    full = Full.of(case)
    ref, _, (_, dw, _) = reference(full, case)
    ws = _leaf(shard(full.ws, world, rank, 0))
    n = int((full.target != -100).sum())
    total = 0.0
    for half in (slice(0, 1), slice(1, 2)):
        record = TopKTeacher(full.ids[half], full.logprobs[half], tail=case.tail)
        out = vparallel_ce.linear_distillation_loss(full.hs[half], ws, record, target=full.target[half],
                                                    student_bias=shard(full.bs, world, rank), group=group,
                                                    num_valid_tokens=n, **case.options)
        (2.0 * out).backward()  # the reference's upstream gradient of a scalar loss
        total = total + out.detach()
    failures = []
    if rel_err(total, ref) > 1e-10 or rel_err(ws.grad, shard(dw, world, rank, 0), dw) > 1e-10:
        failures.append(f"TP {world} rank {rank} num_valid_tokens: {total} vs {ref}, weight gradient error "
                        f"{rel_err(ws.grad, shard(dw, world, rank, 0), dw):.3g}")
    return failures


def bad_input_rank(rank: int, world: int, group) -> list[str]:
    """Bad input raises on every rank, naming the problem: a teacher lm_head next to a record;
    records that differ between ranks of replicated tokens; with sequence parallelism, a bad id in
    one rank's own rows (the others name that rank)."""
    case = Case(vocab=7)
    full = Full.of(case)
    ws = shard(full.ws, world, rank, 0)
    last = rank == world - 1
    ids = full.ids.clone()
    ids[1, 2, 0] = 7  # out of range, on a token that counts
    moved = full.ids.clone()
    moved[1, 2] = moved[1, 2].roll(1)

    def call(teacher, target=full.target, hs=full.hs, **kw):
        return lambda: vparallel_ce.linear_distillation_loss(hs, ws, teacher, target=target, group=group, **kw)

    record = full.teacher(case)
    mine = slice(2 * rank, 2 * rank + 2)  # 8 tokens over 4 ranks; the bad id is in row 6, rank 3's
    sp_ids = (ids if last else full.ids).reshape(-1, case.k)[mine]
    cases = {
        "teacher weight with a record": (call(record, teacher_weight=shard(full.wt, world, rank, 0)),
                                         ["pass no teacher_weight or teacher_bias"]),
        "record differs": (call(TopKTeacher(moved if last else full.ids, full.logprobs)),
                           ["teacher ids checksum"]),
        "id out of range": (call(TopKTeacher(ids, full.logprobs)), ["outside [0, 7)", "7"]),
        "record of other tokens": (call(TopKTeacher(full.ids[:, :3], full.logprobs[:, :3])),
                                   ["TopKTeacher.ids shape", "student_hidden"]),
        "sequence parallel id out of range": (
            call(TopKTeacher(sp_ids, full.logprobs.reshape(-1, case.k)[mine]), full.target.reshape(-1)[mine],
                 full.hs.reshape(-1, H_S)[mine], sequence_parallel=True),
            [f"rank {world - 1}: TopKTeacher.ids hold id(s) outside [0, 7)"]),
    }
    failures = unmet(cases, f"TP {world} rank {rank}", group)
    vparallel_ce.linear_distillation_loss(full.hs, ws, record, target=full.target, group=group)  # still works
    return failures


# V=7 over 2 and 3 ranks: 4/3, 3/3/1; V=3 over 4 ranks: 1/1/1/0, an empty shard
SIZES = ((2, 7), (3, 7), (4, 3))


def sizes_rank(rank: int, world: int) -> list[str]:
    """Every TP degree of :data:`SIZES` on the first ranks of one 4-rank world: a share of the grid
    (the suite's time budget), ``k = V`` against dense, sequence parallelism at TP 2, bad input at
    TP 4."""
    import torch.distributed as dist

    failures = []
    with one_thread():
        for tp, vocab in SIZES:
            group = dist.new_group(list(range(tp)))  # every rank takes part in making it
            if rank < tp:
                failures += [f for c in grid(vocab)[tp::7] for f in check_case(rank, tp, group, c)]
                if vocab == 7:
                    failures += dense_rank(rank, tp, group)
                if tp == 2:
                    failures += sequence_parallel_rank(rank, tp, group) + accumulation_rank(rank, tp, group)
            dist.barrier()
        failures += bad_input_rank(rank, world, dist.group.WORLD)
    return failures


def test_every_kind_mode_k_option_and_chunk_count_at_tp1():
    _assert_clean([check_case(0, 1, None, case) for case in grid(7)] + [dense_rank(0, 1, None),
                                                                       accumulation_rank(0, 1, None)])


def test_tp_2_3_4_uneven_and_empty_shards_sequence_parallel_and_bad_input_on_every_rank():
    _assert_clean(run_ranks(sizes_rank, 4, timeout=200))


def test_bf16_autocast_is_within_the_plain_bf16_paths_error():
    """fp32 inputs under CPU autocast: the student's GEMMs in bf16, statistics fp32, gradients fp32
    (the inputs' dtype). The plain path: F.linear under the same autocast, then the float64 math."""
    failures = []
    for (kind, beta), tail in zip(KINDS[::2], TAILS * 2):
        case = Case(kind, beta, 2.0, 0.5, "mean", chunks=3, vocab=50, seed=95, tail=tail, k=5)
        full = Full.of(case)
        ref, g, ref_grads = reference(full, case)
        leaves, plain = ([_leaf(x, torch.float32) for x in (full.hs, full.ws, full.bs)] for _ in range(2))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = vparallel_ce.linear_distillation_loss(leaves[0], leaves[1], full.teacher(case), target=full.target,
                                                        student_bias=leaves[2], chunks=case.chunks, **case.options)
            s = F.linear(*plain)
        (out * g).backward()
        plain_out = topk_reference(s, full.ids, full.logprobs, full.target, tail=tail, **case.options)
        (plain_out * g).backward()
        name = f"bf16 autocast {case}"
        if out.dtype != torch.float32 or any(x.grad.dtype != torch.float32 for x in leaves):
            failures.append(f"{name}: dtypes {out.dtype}, {[x.grad.dtype for x in leaves]}")
        for what, got, plain_x, want in zip(("loss", "hidden", "weight", "bias"), (out, *(x.grad for x in leaves)),
                                            (plain_out, *(x.grad for x in plain)), (ref, *ref_grads)):
            err, bound = rel_err(got.detach(), want), rel_err(plain_x.detach(), want)
            if not err <= max(2 * bound, TOL[torch.float32]):
                failures.append(f"{name}: {what} error {err:.3g}, the plain bf16 path's {bound:.3g}")
            if not err > TOL[torch.float64]:  # bf16 GEMMs must show: else the matmuls did not run in bf16
                failures.append(f"{name}: {what} error {err:.3g} is float64-exact under bf16 autocast")
    _assert_clean([failures])


def test_a_sparse_teacher_with_dw_by_one_gemm_equals_one_chunk():
    # a wide student (8 fp64 tokens, H_s = 16): three chunks write their logits' gradients into the
    # kept buffer for one dW GEMM; loss and gradients equal one chunk's, each tail mode
    from vparallel_ce import TopKTeacher
    from vparallel_ce.policy import WeightGrad

    g = torch.Generator().manual_seed(5)
    n, h, v, k = 8, 16, 11, 3
    hs, ws = torch.randn(n, h, generator=g, dtype=torch.float64), torch.randn(v, h, generator=g, dtype=torch.float64)
    target = torch.randint(0, v, (n,), generator=g)
    target[2] = -100
    ids = torch.stack([torch.randperm(v, generator=g)[:k] for _ in range(n)])
    logprobs = torch.log_softmax(torch.randn(n, v, generator=g, dtype=torch.float64), -1).gather(-1, ids)
    for tail in ("bucket", "renormalize"):
        teacher = TopKTeacher(ids, logprobs, tail=tail)
        got = []
        for chunks in (1, 3):
            a, b = hs.clone().requires_grad_(), ws.clone().requires_grad_()
            out = vparallel_ce.linear_distillation_loss(a, b, teacher, None, target, chunks=chunks, temperature=2.0,
                                                        hard_weight=0.5)
            (out * 3.0).backward()
            got.append((out.detach(), a.grad, b.grad))
        plan = vparallel_ce.policy.DEFAULT_POLICY.plan(
            n, v, chunks=3, distillation=vparallel_ce.policy.DistillShape("forward_kl", (h, 0), False, 8))
        assert plan.weight_grad is WeightGrad.ONE_GEMM, plan
        for what, x, y in zip(("loss", "dh", "dW"), *got):
            assert torch.allclose(x, y, rtol=1e-12, atol=1e-14), (tail, what)
