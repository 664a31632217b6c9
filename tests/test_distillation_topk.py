"""``distillation_loss`` with a sparse teacher (``TopKTeacher``) against float64 references written
with plain torch on the gathered student logits, in both tail modes, at TP 1-4 (uneven and empty
shards); ``k = V`` against the dense op; the teacher's dtype; bad input raising on every rank."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import vparallel_ce
from vparallel_ce import TailMode, TopKTeacher
from tests.dist import errors_of, one_thread, run_ranks, unmet
from tests.reference import TOL, local_grad, rel_err, shard, token_reference
from tests.test_distillation import IGNORES, KINDS, judge

TAILS = ("bucket", "renormalize")


def _xlog(w, diff):
    """``w * diff`` with the term of a zero weight 0 (``0 * -inf``), differentiable."""
    return torch.where(w == 0, torch.zeros_like(w), w * diff)


def reference(s, ids, logprobs, target, *, tail, kind, beta=0.5, temperature=1.0, hard_weight=0.0,
              ignore_index=-100, reduction="mean"):
    """The loss over the ``k`` (+ tail) classes, from the full float64 student logits."""
    s2 = s.double().reshape(-1, s.shape[-1])
    ids2, lp = ids.reshape(-1, ids.shape[-1]), logprobs.double().reshape(-1, ids.shape[-1])
    V, k = s2.shape[-1], ids2.shape[-1]
    if target is not None:  # an ignored token's ids may be garbage: stand-ins (its loss is 0 anyway)
        ids2 = torch.where((target.reshape(-1) != ignore_index).unsqueeze(-1), ids2, torch.arange(k))
    b = s2 / temperature
    if tail == "renormalize":
        log_q = F.log_softmax(b.gather(-1, ids2), -1)
        log_p = F.log_softmax(lp, -1)
    else:
        q = F.softmax(b, -1)
        log_q, log_p = q.gather(-1, ids2).log(), lp
        if k < V:  # the tail: the student's mass off the ids, the teacher's rest
            off = torch.ones_like(q, dtype=torch.bool).scatter(-1, ids2, False)
            q_tail = torch.where(off, q, torch.zeros_like(q)).sum(-1, keepdim=True)
            p_tail = (1 - lp.exp().sum(-1, keepdim=True)).clamp_min(0)
            log_q, log_p = torch.cat([log_q, q_tail.log()], -1), torch.cat([log_p, p_tail.log()], -1)
    p, q = log_p.exp(), log_q.exp()
    if kind == "forward_kl":
        d = _xlog(p, log_p - log_q).sum(-1)
    elif kind == "reverse_kl":
        d = _xlog(q, log_q - log_p).sum(-1)
    else:
        log_m = (beta * p + (1 - beta) * q).log()
        d = beta * _xlog(p, log_p - log_m).sum(-1) + (1 - beta) * _xlog(q, log_q - log_m).sum(-1)
    return token_reference(d, s2, target, temperature=temperature, hard_weight=hard_weight,
                           ignore_index=ignore_index, reduction=reduction).reshape(
        s.shape[:-1] if reduction == "none" else ())


def make(seed: int, vocab: int, k: int, ignore: str, temperature: float = 1.0, dtype=torch.float64):
    """Student logits, a target, and the teacher's top-k ids (in a shuffled order) with its
    log-probs at ``temperature``; an ignored token's ids are garbage (repeated, out of range)."""
    g = torch.Generator().manual_seed(seed)
    s = (torch.randn(2, 3, vocab, generator=g) * 2).to(dtype)
    t = torch.randn(2, 3, vocab, generator=g, dtype=torch.float64) * 2
    target = torch.randint(0, vocab, (2, 3), generator=g)
    top = t.topk(k, -1).indices
    ids = top.gather(-1, torch.argsort(torch.rand(top.shape, generator=g), -1))
    logprobs = F.log_softmax(t / temperature, -1).gather(-1, ids)
    if ignore in ("some ignored", "all ignored"):
        rows = [(0, 1), (1, 2)] if ignore == "some ignored" else [(i, j) for i in range(2) for j in range(3)]
        for i, j in rows:
            target[i, j] = -100
        ids[0, 1] = vocab + 5  # never read
    if ignore == "all ignored":
        ids[:] = 0
    return s, t, ids, logprobs, None if ignore == "no target" else target


def grid(world: int, vocab: int):
    """kind x T x hard weight x reduction x tail x k; the ignore pattern turns from case to case
    (and from TP degree to TP degree), every pattern meeting every kind."""
    i = 0
    for kind, beta in KINDS:
        for temperature in (1.0, 2.0):
            for hard_weight in (0.0, 0.5):
                for reduction in ("mean", "sum", "none"):
                    for tail in TAILS:
                        for k in sorted({1, 3, vocab}):
                            i += 1
                            ignore = IGNORES[(i + world) % len(IGNORES)]
                            if ignore == "no target" and hard_weight:
                                ignore = "some ignored"
                            yield dict(kind=kind, beta=beta, temperature=temperature, hard_weight=hard_weight,
                                       reduction=reduction), tail, k, ignore, i


def check_case(rank, world, group, vocab, opts, tail, k, ignore, seed, *, tol=1e-10):
    name = f"TP {world} rank {rank} V={vocab} k={k} {tail} {opts} {ignore}"
    s_full, _, ids, logprobs, target = make(seed, vocab, k, ignore, opts["temperature"])
    s = shard(s_full, world, rank).clone().requires_grad_()
    lp = logprobs.clone().requires_grad_()
    out = vparallel_ce.distillation_loss(s, TopKTeacher(ids, lp, tail=tail), target, group=group, chunks=2, **opts)
    s_ref = s_full.clone().requires_grad_()
    ref = reference(s_ref, ids, logprobs, target, tail=tail, **opts)
    return judge(name, out, ref, s, s_ref, lp, world, rank, seed, tol)


def dense_rank(rank, world, group, vocab):
    """k = V, logprobs = log_softmax(t / T) at every id (shuffled): the dense op's loss and gradient
    in both modes (the tail class is empty), for every kind."""
    failures = []
    for j, (kind, beta) in enumerate(KINDS):
        for tail in TAILS:
            opts = dict(kind=kind, beta=beta, temperature=2.0, hard_weight=0.5, reduction="none")
            s_full, t_full, ids, logprobs, target = make(40 + j, vocab, vocab, "some ignored", 2.0)
            a = shard(s_full, world, rank).clone().requires_grad_()
            b = a.detach().clone().requires_grad_()
            dense = vparallel_ce.distillation_loss(a, shard(t_full, world, rank), target, group=group, **opts)
            sparse = vparallel_ce.distillation_loss(b, TopKTeacher(ids, logprobs, tail=tail), target, group=group,
                                                    **opts)
            dense.sum().backward()
            sparse.sum().backward()
            errs = rel_err(sparse.detach(), dense.detach()), rel_err(b.grad, a.grad)
            if not (sparse.isfinite().all() and max(errs) < 1e-12):
                failures.append(f"TP {world} rank {rank} k=V {tail} {kind} beta={beta}: differs from dense by {errs}")
    return failures


def nonfinite_rank(rank, world, group, vocab):
    """A nan student logit off the ids makes the token's loss nan in both modes, as in the dense
    op; a teacher log-prob of -inf is a probability of 0 (finite forward KL)."""
    failures = []
    for tail in TAILS:
        s_full, _, ids, logprobs, target = make(5, vocab, 3, "none ignored", dtype=torch.float32)
        off = next(j for j in range(vocab) if j not in ids[1, 0].tolist())
        s_full[1, 0, off] = float("nan")
        logprobs[0, 2, 1] = float("-inf")
        out = vparallel_ce.distillation_loss(shard(s_full, world, rank), TopKTeacher(ids, logprobs, tail=tail),
                                             target, group=group, reduction="none")
        want = torch.zeros(2, 3, dtype=torch.bool)
        want[1, 0] = True
        if not torch.equal(out.isnan(), want):
            failures.append(f"TP {world} rank {rank} {tail}: nan losses at {out.isnan().nonzero().tolist()}")
        ref = reference(s_full, ids, logprobs, target, tail=tail, kind="forward_kl", reduction="none")
        if rel_err(out[~want], ref[~want].float()) > 1e-5:
            failures.append(f"TP {world} rank {rank} {tail}: finite losses {out} vs {ref}")
    return failures


def dtensor_rank(rank, world, group, vocab):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = DeviceMesh.from_group(group, "cpu")
    failures = []
    for tail in TAILS:
        s_full, _, ids, logprobs, target = make(8, vocab, 4, "some ignored", 2.0)
        s = distribute_tensor(s_full.clone(), mesh, [Shard(-1)]).requires_grad_()
        # ids as a replicated DTensor, log-probs as a plain tensor: both are accepted
        teacher = TopKTeacher(distribute_tensor(ids, mesh, [Replicate()]), logprobs, tail=tail)
        opts = dict(kind="jsd", beta=0.3, temperature=2.0, hard_weight=0.5)
        out = vparallel_ce.distillation_loss(s, teacher, target, **opts)
        out.backward()
        ref_s = s_full.clone().requires_grad_()
        ref = reference(ref_s, ids, logprobs, target, tail=tail, **opts)
        ref.backward()
        if rel_err(out.detach(), ref.detach()) > 1e-10:
            failures.append(f"DTensor TP {world} rank {rank} {tail}: loss {out} vs {ref}")
        if rel_err(local_grad(s), shard(ref_s.grad, world, rank), ref_s.grad) > 1e-10:
            failures.append(f"DTensor TP {world} rank {rank} {tail}: gradient")
    return failures


def bad_input_rank(rank, world, group, vocab):
    """Every bad input raises on EVERY rank (no hang), naming the problem; check=False skips the
    value checks."""
    odd = rank == world - 1
    s_full, t_full, ids, logprobs, target = make(1, vocab, 3, "some ignored", dtype=torch.float32)
    logprobs = logprobs.float()
    s, t = shard(s_full, world, rank), shard(t_full.float(), world, rank)

    def call(i=ids, lp=logprobs, tail="bucket", tgt=target, teacher=None, **kw):
        teacher = TopKTeacher(i, lp, tail=tail) if teacher is None else teacher
        return lambda: vparallel_ce.distillation_loss(s, teacher, tgt, group=group, **kw)

    def at(x, where, value):
        x = x.clone()
        x[where] = value
        return x

    big = logprobs.clone()
    big[1, 0] = torch.log(torch.tensor([0.6, 0.3, 0.2]))
    cases = {
        "id out of range": (call(i=at(ids, (0, 0, 1), vocab)), [f"outside [0, {vocab})", str(vocab)]),
        "negative id": (call(i=at(ids, (1, 0, 0), -1)), [f"outside [0, {vocab})", "-1"]),
        "repeated id": (call(i=at(ids, (1, 1, 2), ids[1, 1, 0].item())), ["repeat an id", "token 4"]),
        "logprob above 0": (call(lp=at(logprobs, (0, 2, 0), 0.5)), ["<= 0", "0.5"]),
        "nan logprob": (call(lp=at(logprobs, (0, 2, 0), float("nan"))), ["<= 0", "nan"]),
        "mass above 1 with a tail": (call(lp=big), ["sum to 1.1", "token 3", "tail='bucket'"]),
        "no mass to renormalise": (call(lp=at(logprobs, (1, 0), float("-inf")), tail="renormalize"),
                                   ["all -inf", "token 3"]),
        "ids shape": (call(i=ids[:, :1]), ["TopKTeacher.ids shape", "token dims"]),
        # the other ranks name the rank: "invalid input on rank(s) ...: TopKTeacher.ids shape ..."
        "ids shape on one rank": (call(i=ids[:, :1] if odd else ids),
                                  ["TopKTeacher.ids shape"] if odd else [f"rank(s) {world - 1}", "TopKTeacher.ids shape"]),
        "logprobs shape": (call(lp=logprobs[..., :2]), ["TopKTeacher.logprobs shape", "does not match"]),
        "float ids": (call(i=ids.float()), ["TopKTeacher.ids must be"]),
        "unknown tail": (call(tail="drop"), ["TopKTeacher.tail must be one of"]),
        "k differs": (call(i=ids[..., :2] if odd else ids, lp=logprobs[..., :2] if odd else logprobs),
                      ["teacher k", "rank 0: 3", f"rank {world - 1}: 2"]),
        "ids differ": (call(i=at(ids, (0, 0, 0), (ids[0, 0, 0] + 1) % vocab) if odd else ids),
                       ["teacher ids checksum", "same TopKTeacher ids"]),
        "logprobs differ": (call(lp=logprobs - 0.01 if odd else logprobs), ["teacher logprobs checksum"]),
        "tail differs": (call(tail="renormalize" if odd else "bucket"),
                         ["teacher tail", "'bucket'", "'renormalize'"]),
        "logprobs dtype differs": (call(lp=logprobs.double() if odd else logprobs),
                                   ["teacher dtype", "torch.float32", "torch.float64"]),
        "dense teacher dtype differs": (call(teacher=t.bfloat16() if odd else t), [
            "teacher dtype", "rank 0: torch.float32", f"rank {world - 1}: torch.bfloat16"]),
        "sparse on some ranks only": (call(teacher=t if odd else None), ["teacher"]),
        "hard weight without a target": (call(tgt=None, hard_weight=0.5), ["needs a target"]),
    }
    failures = unmet(cases, f"TP {world} rank {rank}", group)
    # check=False (with the vocab size known: no exchange) skips the value checks
    skipped = errors_of({"unchecked": call(i=at(ids, (0, 0, 1), vocab), check=False, vocab_size=vocab)}, group)
    if skipped["unchecked"] is not None:
        failures.append(f"TP {world} rank {rank}: check=False still raised {skipped['unchecked']}")
    vparallel_ce.distillation_loss(s, TopKTeacher(ids, logprobs), target, group=group)  # the group still works
    return failures


def tp_rank(rank, world, group, vocab):
    """On a group of ``world`` ranks: the grid (a third of it on a group: the time budget), k = V
    against dense, and the checks that need a group at one degree each."""
    failures = []
    with one_thread():
        for opts, tail, k, ignore, seed in grid(world, vocab):
            if world == 1 or seed % 3 == world % 3:
                failures += check_case(rank, world, group, vocab, opts, tail, k, ignore, seed)
        extra = {1: (dense_rank,), 2: (dense_rank, nonfinite_rank, dtensor_rank), 3: (bad_input_rank,),
                 4: (dense_rank,)}[world]
        for fn in extra:
            failures += fn(rank, world, group, vocab)
    return failures


# V=11 over 2 and 3 ranks: uneven shards (6/5, 4/4/3); V=5 over 4 ranks: 2/2/1/0, an empty shard
SIZES = ((2, 11), (3, 11), (4, 5))


def sizes_rank(rank, world):
    """Every TP degree of :data:`SIZES` on a group of the first ranks of one 4-rank world (one
    process pool: spawning one costs seconds on a 2-core machine)."""
    import torch.distributed as dist

    failures = []
    for tp, vocab in SIZES:
        group = dist.new_group(list(range(tp)))  # every rank takes part in making it
        if rank < tp:
            failures += tp_rank(rank, tp, group, vocab)
        dist.barrier()
    return failures


def _assert_clean(results):
    lines = [f for res in results for f in res]
    assert not lines, f"{len(lines)} failed checks:\n" + "\n".join(lines[:15])


def test_every_kind_mode_k_and_option_at_tp1():
    _assert_clean([tp_rank(0, 1, None, 9)])


def test_every_case_at_tp_2_3_4_with_uneven_and_empty_shards():
    _assert_clean(run_ranks(sizes_rank, 4, timeout=150))


def test_bad_input_at_world_1():
    s, t, ids, logprobs, target = make(1, 11, 3, "some ignored")
    with pytest.raises(vparallel_ce.InvalidInputError, match=r"outside \[0, 11\)"):
        vparallel_ce.distillation_loss(s, TopKTeacher(torch.where(ids == ids[0, 0, 0], 11, ids), logprobs), target)
    with pytest.raises(vparallel_ce.InvalidInputError, match="sum to"):
        vparallel_ce.distillation_loss(s, TopKTeacher(ids, logprobs * 0), target)
    with pytest.raises(vparallel_ce.InvalidInputError, match="logprobs shape"):
        vparallel_ce.distillation_loss(s, TopKTeacher(ids, logprobs[..., :1]), target)
    # the same values renormalised are fine; an ignored token's ids are never read
    vparallel_ce.distillation_loss(s, TopKTeacher(ids, logprobs * 0, tail=TailMode.RENORMALIZE), target)


def test_a_teacher_in_another_dtype_is_read_in_the_statistics_dtype():
    """A bf16 teacher for an fp32 student (and a bf16 top-k log-prob record): the same loss and
    gradient as the teacher widened to fp32 first, since the statistics are fp32 either way."""
    s, t, ids, logprobs, target = make(3, 13, 4, "some ignored", dtype=torch.float32)
    for teacher, wide in ((t.bfloat16(), t.bfloat16().float()),
                          (TopKTeacher(ids, logprobs.bfloat16()), TopKTeacher(ids, logprobs.bfloat16().float()))):
        results = []
        for given in (teacher, wide):
            x = s.clone().requires_grad_()
            out = vparallel_ce.distillation_loss(x, given, target, kind="jsd", temperature=2.0, hard_weight=0.5)
            out.backward()
            results.append((out, x.grad))
        (a, ga), (b, gb) = results
        assert a.dtype == torch.float32 and ga.dtype == torch.float32
        assert torch.equal(a, b) and torch.equal(ga, gb), f"{type(teacher).__name__}: {a} vs {b}"
    # a bf16 student: statistics in fp32, the gradient in bf16
    for tail in TAILS:
        x = s.bfloat16().requires_grad_()
        out = vparallel_ce.distillation_loss(x, TopKTeacher(ids, logprobs, tail=tail), target, kind="reverse_kl",
                                             temperature=2.0, hard_weight=0.5)
        out.backward()
        ref_x = s.bfloat16().double().requires_grad_()
        ref = reference(ref_x, ids, logprobs, target, tail=tail, kind="reverse_kl", temperature=2.0, hard_weight=0.5)
        ref.backward()
        assert out.dtype == torch.float32 and x.grad.dtype == torch.bfloat16
        assert rel_err(out, ref) < TOL[torch.float32] and rel_err(x.grad, ref_x.grad) < TOL[torch.bfloat16], tail


def test_renormalize_reads_only_the_differences_of_the_logprobs():
    """With RENORMALIZE a T = 1 record divided by T is the tempered teacher renormalised over its
    ids (what docs/distillation.md tells a user holding a T = 1 cache); no tokens is a loss of 0."""
    s, t, ids, _, target = make(6, 13, 4, "none ignored")
    at_t = F.log_softmax(t / 2.0, -1).gather(-1, ids)
    record = F.log_softmax(t, -1).gather(-1, ids) / 2.0
    a, b = (vparallel_ce.distillation_loss(s, TopKTeacher(ids, lp, tail="renormalize"), target, temperature=2.0,
                                           kind="reverse_kl", reduction="none") for lp in (at_t, record))
    assert rel_err(a, b) < 1e-13 and a.abs().sum() > 0
    empty = vparallel_ce.distillation_loss(s[:0].requires_grad_(), TopKTeacher(ids[:0], at_t[:0]), target[:0],
                                           reduction="sum")
    assert empty.item() == 0.0
