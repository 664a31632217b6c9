"""``distillation_loss`` against float64 references on the gathered logits, at TP 1-4 (uneven and
empty shards), in bf16, with the identities its JSD definition implies, and with bad input raising
on every rank."""

from __future__ import annotations

import math

import pytest
import torch

import vparallel_ce
from tests.dist import errors_of, one_thread, run_ranks
from tests.reference import TOL, reference_distillation as reference, rel_err, shard

# (kind, beta): beta only matters for the JSD
KINDS = [("forward_kl", 0.5), ("reverse_kl", 0.5), ("jsd", 0.1), ("jsd", 0.5)]
IGNORES = ("none ignored", "some ignored", "all ignored", "no target")
N = 6


def grid():
    """Every kind x temperature x hard weight x reduction x ignore pattern (the hard term needs a
    target)."""
    for kind, beta in KINDS:
        for temperature in (1.0, 2.0):
            for hard_weight in (0.0, 0.3):
                for reduction in ("mean", "sum", "none"):
                    for ignore in IGNORES:
                        if ignore == "no target" and hard_weight:
                            continue
                        yield dict(kind=kind, beta=beta, temperature=temperature, hard_weight=hard_weight,
                                   reduction=reduction), ignore


def make(seed: int, vocab: int, ignore: str, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    s = (torch.randn(2, N // 2, vocab, generator=g) * 2).to(dtype)
    t = (torch.randn(2, N // 2, vocab, generator=g) * 2).to(dtype)
    target = torch.randint(0, vocab, (2, N // 2), generator=g)
    if ignore == "some ignored":
        target[0, 1] = target[1, 2] = -100
    elif ignore == "all ignored":
        target[:] = -100
    return s, t, None if ignore == "no target" else target


def _upstream(out, seed):
    # a scalar output gets 2.0 (the loss is not the last layer); per-token outputs random weights
    return torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype) if out.dim() else 2.0


def check_case(rank, world, group, seed, vocab, opts, ignore, *, chunks=2, tol=1e-10):
    """Failures (strings naming the case) of one case, on this rank's shard."""
    name = f"TP {world} rank {rank} V={vocab} {opts} {ignore} chunks={chunks}"
    s_full, t_full, target = make(seed, vocab, ignore)
    s = shard(s_full, world, rank).clone().requires_grad_()
    t = shard(t_full, world, rank).clone().requires_grad_()
    out = vparallel_ce.distillation_loss(s, t, target, group=group, chunks=chunks, **opts)
    s_ref = s_full.clone().requires_grad_()
    ref = reference(s_ref, t_full, target, **opts)
    return judge(name, out, ref, s, s_ref, t, world, rank, seed, tol)


def judge(name, out, ref, s, s_ref, teacher, world, rank, seed, tol):
    """Failures of a float64 loss ``out`` on student shard ``s`` against ``ref`` on the full
    ``s_ref``, both backpropagated from the same upstream gradient; ``teacher``: a tensor that must
    get no gradient."""
    g = _upstream(ref, seed)
    (out * g).sum().backward()
    (ref * g).sum().backward()
    failures = []
    if out.shape != ref.shape or out.dtype != torch.float64:
        return [f"{name}: output {tuple(out.shape)} {out.dtype}, expected {tuple(ref.shape)} float64"]
    if not torch.equal(out.isnan(), ref.isnan()):
        failures.append(f"{name}: loss {out} vs reference {ref} (nan pattern)")
    elif rel_err(torch.nan_to_num(out.detach()), torch.nan_to_num(ref.detach())) > tol:
        failures.append(f"{name}: loss {out} vs reference {ref}")
    err = rel_err(s.grad, shard(s_ref.grad, world, rank), s_ref.grad)
    if not err <= tol:
        failures.append(f"{name}: student gradient error {err}")
    if teacher.grad is not None:
        failures.append(f"{name}: the teacher got a gradient")
    return failures


def grid_rank(rank, world, vocab):
    """The whole grid at world 1; on a group each (kind, beta, T, hard weight, reduction) with one
    ignore pattern, the pattern turning from case to case and from TP degree to TP degree (the
    suite's time budget)."""
    import torch.distributed as dist

    group = dist.group.WORLD if world > 1 else None
    failures = []
    for i, (opts, ignore) in enumerate(grid()):
        if world == 1 or (i + world) % len(IGNORES) == 0:
            failures += check_case(rank, world, group, i, vocab, opts, ignore)
    return failures


def _assert_clean(results):
    lines = [f for res in results for f in res]
    assert not lines, f"{len(lines)} failed checks:\n" + "\n".join(lines[:15])


@pytest.fixture(autouse=True)
def _single_threaded():
    with one_thread():
        yield


def test_every_kind_temperature_beta_hard_weight_reduction_and_ignore_pattern_at_tp1():
    _assert_clean([grid_rank(0, 1, 13)])


def tp_rank(rank, world, vocab):
    """One spawned run per TP degree (process pools cost seconds): the grid, and the checks that
    need a group at one degree each."""
    failures = grid_rank(rank, world, vocab)
    extra = {2: (nonfinite_rank, dtensor_rank), 3: (chunks_rank, bad_input_rank)}.get(world, ())
    for fn in extra:
        failures += fn(rank, world)
    return failures


# V=11 over 2 and 3 ranks: uneven shards (6/5, 4/4/3); V=5 over 4 ranks: 2/2/1/0, an empty shard.
# At TP 2 also non-finite logits and DTensor inputs; at TP 3 chunks 1 vs 3 and bad input.
@pytest.mark.parametrize("world, vocab", [(2, 11), (3, 11), (4, 5)])
def test_every_case_at_tp_2_3_4_with_uneven_and_empty_shards(world, vocab):
    _assert_clean(run_ranks(tp_rank, world, vocab, timeout=150))


def chunks_rank(rank, world):
    import torch.distributed as dist

    failures = []
    for kind, beta in KINDS:
        s_full, t_full, target = make(7, 11, "some ignored")
        grads, losses = [], []
        for chunks in (1, 3):
            s = shard(s_full, world, rank).clone().requires_grad_()
            out = vparallel_ce.distillation_loss(s, shard(t_full, world, rank), target, group=dist.group.WORLD,
                                                 kind=kind, beta=beta, temperature=2.0, hard_weight=0.3,
                                                 reduction="none", chunks=chunks)
            out.sum().backward()
            losses.append(out.detach())
            grads.append(s.grad)
        # per-token math, so equal up to the last bits: SIMD kernels (log, logaddexp) may round a row
        # differently depending on where it falls in a chunk
        errs = rel_err(losses[1], losses[0]), rel_err(grads[1], grads[0])
        if max(errs) > 1e-14:
            failures.append(f"TP {world} rank {rank} {kind} beta={beta}: chunks=1 and chunks=3 differ by {errs}")
    return failures


def test_bf16_inputs_are_within_the_plain_bf16_paths_error():
    failures = []
    for kind, beta in KINDS:
        s16, t16, target = make(3, 50, "some ignored", dtype=torch.bfloat16)
        opts = dict(kind=kind, beta=beta, temperature=2.0, hard_weight=0.3)
        ref_s = s16.double().requires_grad_()
        ref = reference(ref_s, t16.double(), target, **opts)
        ref.backward()
        s = s16.clone().requires_grad_()
        out = vparallel_ce.distillation_loss(s, t16, target, chunks=2, **opts)
        out.backward()
        # the plain path: the same formula run by autograd on the bf16 tensors themselves
        plain_s = s16.clone().requires_grad_()
        plain = reference(plain_s, t16, target, dtype=torch.bfloat16, **opts)
        plain.backward()
        name = f"bf16 {kind} beta={beta}"
        if out.dtype != torch.float32 or s.grad.dtype != torch.bfloat16:
            failures.append(f"{name}: loss {out.dtype}, gradient {s.grad.dtype}")
        loss_err, plain_loss_err = rel_err(out, ref), rel_err(plain.float(), ref)
        if loss_err > max(plain_loss_err, TOL[torch.float32]):
            failures.append(f"{name}: loss error {loss_err} > the plain bf16 path's {plain_loss_err}")
        grad_err, plain_grad_err = rel_err(s.grad, ref_s.grad), rel_err(plain_s.grad, ref_s.grad)
        if grad_err > max(plain_grad_err, TOL[torch.bfloat16]):
            failures.append(f"{name}: gradient error {grad_err} > the plain bf16 path's {plain_grad_err}")
    _assert_clean([failures])


def _loss_and_grad(s, t, target=None, **opts):
    s = s.clone().requires_grad_()
    out = vparallel_ce.distillation_loss(s, t, target, **opts)
    out.sum().backward()
    return out.detach(), s.grad


def test_identities_of_the_jsd_definition():
    """``m = beta p + (1 - beta) q``: at beta 0 (m = q) and 1 (m = p) the JSD would be 0 for every
    input, so those betas raise; near them it is beta KL(p||q) and (1 - beta) KL(q||p); swapping
    student and teacher swaps beta (Liger's symmetry check at 0.5); and the JSD at 0.5 is at most
    log 2, reached by disjoint distributions."""
    s, t, target = make(11, 17, "none ignored")
    checks = []
    for beta, kl in ((0.0, "forward_kl"), (1.0, "reverse_kl"), (0, "forward_kl"), (1, "reverse_kl")):
        # identically 0 there, where TRL and Liger mean a KL by these betas: refused, naming the kind
        with pytest.raises(ValueError, match=f"kind='jsd' with beta={beta} is 0 for every input.*kind='{kl}'"):
            vparallel_ce.distillation_loss(s, t, kind="jsd", beta=beta)
        with pytest.raises(ValueError, match=f"beta={beta}"):
            vparallel_ce.linear_distillation_loss(s, torch.eye(s.shape[-1], dtype=s.dtype), t, torch.eye(
                t.shape[-1], dtype=t.dtype), kind="jsd", beta=beta)
    eps = 1e-8  # the next order is eps * a chi-square divergence, which can be large; rounding stays ~1e-7
    for beta, kind, scale in ((eps, "forward_kl", eps), (1 - eps, "reverse_kl", eps)):
        jsd, jsd_grad = _loss_and_grad(s, t, kind="jsd", beta=beta, reduction="none")
        kl, kl_grad = _loss_and_grad(s, t, kind=kind, reduction="none")
        checks.append((f"jsd beta={beta} ~ {scale} {kind}", rel_err(jsd / scale, kl) < 1e-4))
        checks.append((f"jsd beta={beta} gradient ~ {scale} {kind}'s", rel_err(jsd_grad / scale, kl_grad) < 1e-4))
    for beta in (0.1, 0.5, 0.9):
        a = vparallel_ce.distillation_loss(s, t, kind="jsd", beta=beta, reduction="none")
        b = vparallel_ce.distillation_loss(t, s, kind="jsd", beta=1 - beta, reduction="none")
        checks.append((f"jsd beta={beta} with student and teacher swapped is beta={1 - beta}", rel_err(a, b) < 1e-12))
    hot = torch.full((2, 8), -1e4, dtype=torch.float64)
    one, other = hot.clone(), hot.clone()
    one[:, 0], other[:, 5] = 0.0, 0.0
    bound = vparallel_ce.distillation_loss(one, other, kind="jsd", beta=0.5, reduction="none")
    log2 = torch.full_like(bound, math.log(2))
    checks.append(("jsd of disjoint distributions is log 2", rel_err(bound, log2) < 1e-12))
    random = vparallel_ce.distillation_loss(s, t, kind="jsd", beta=0.5, reduction="none")
    checks.append(("jsd at 0.5 is at most log 2", bool((random <= math.log(2)).all())))
    failed = [name for name, ok in checks if not ok]
    assert not failed, f"identities that do not hold: {failed}"


def test_the_hard_term_is_the_librarys_cross_entropy_and_a_same_teacher_costs_nothing():
    s, _, target = make(5, 19, "some ignored")
    for kind, beta in KINDS:
        for temperature in (1.0, 2.0):
            loss = vparallel_ce.distillation_loss(s, s.clone(), target, kind=kind, beta=beta, temperature=temperature,
                                                  hard_weight=0.3)
            ce = vparallel_ce.cross_entropy(s, target)
            assert rel_err(loss, 0.3 * ce) < 1e-12, f"{kind} beta={beta} T={temperature}: {loss} vs 0.3 * {ce}"


def nonfinite_rank(rank, world):
    """NaN logits give nan exactly where the gathered fp32 computation does (an ignored token's
    nan stays out); a teacher entry at -inf (a masked vocab entry) is a probability of 0."""
    import torch.distributed as dist

    failures = []
    for kind, beta in KINDS:
        s_full, t_full, target = make(9, 11, "some ignored", dtype=torch.float32)
        t_full[1, 0, 10] = float("nan")  # a valid token, on the last rank's shard
        s_full[1, 1, 0] = float("nan")  # a valid token, on rank 0's shard
        s_full[1, 2, 3] = float("nan")  # an ignored token
        if kind != "reverse_kl":  # KL(q||p) is +inf where p = 0 < q, as on the gathered logits
            t_full[0, 0, 4] = float("-inf")
        name = f"TP {world} rank {rank} {kind} beta={beta} non-finite"
        s = shard(s_full, world, rank).clone().requires_grad_()
        out = vparallel_ce.distillation_loss(s, shard(t_full, world, rank), target, group=dist.group.WORLD,
                                             kind=kind, beta=beta, reduction="none")
        out.sum().backward()
        want_nan = torch.zeros(target.shape, dtype=torch.bool)
        want_nan[1, 0] = want_nan[1, 1] = True
        if not torch.equal(out.isnan(), want_nan):
            failures.append(f"{name}: nan loss at {out.isnan().nonzero().tolist()}")
        rows_nan = s.grad.isnan().any(-1) if s.shape[-1] else want_nan
        if not torch.equal(rows_nan, want_nan):
            failures.append(f"{name}: nan gradient rows at {rows_nan.nonzero().tolist()}")
        if s.grad[1, 2].abs().sum() != 0:
            failures.append(f"{name}: the ignored token's gradient is not 0")
        clean = ~want_nan
        ref_s = s_full.double().requires_grad_()
        t_ref = t_full.double()
        ref = reference(ref_s, torch.where(t_ref.isinf(), -1e30, t_ref), target, kind=kind, beta=beta,
                        reduction="none")
        ref.sum().backward()
        if rel_err(out[clean], ref[clean]) > 1e-5:
            failures.append(f"{name}: finite losses {out[clean]} vs {ref[clean]}")
        g = torch.nan_to_num(shard(ref_s.grad, world, rank))
        if rel_err(torch.nan_to_num(s.grad)[clean], g[clean], torch.nan_to_num(ref_s.grad)) > 1e-5:
            failures.append(f"{name}: finite gradient rows differ")
    return failures


def bad_input_rank(rank, world):
    import torch.distributed as dist

    group = dist.group.WORLD
    odd = rank == world - 1
    s_full, t_full, target = make(1, 11, "some ignored", dtype=torch.float32)
    s, t = shard(s_full, world, rank), shard(t_full, world, rank)

    def call(student=s, teacher=t, tgt=target, **kw):
        return lambda: vparallel_ce.distillation_loss(student, teacher, tgt, group=group, **kw)

    cases = {
        "teacher shape differs on one rank": (call(teacher=t[:, :, :-1] if odd else t),
                                              ["teacher_logits shape", "does not match"]),
        "teacher shape differs everywhere": (call(teacher=t[:, :1]), ["teacher_logits shape"]),
        "teacher holds integers": (call(teacher=t.long()), ["teacher_logits must be a floating-point"]),
        "kind differs": (call(kind="jsd" if odd else "forward_kl"), ["divergence", "'jsd'", "'forward_kl'"]),
        "unknown kind": (call(kind="kl"), ["divergence must be one of"]),
        "beta differs": (call(kind="jsd", beta=0.4 if odd else 0.5), ["beta", "0.4", "0.5"]),
        "beta out of range": (call(kind="jsd", beta=1.5), ["beta must be in [0, 1]"]),
        "temperature differs": (call(temperature=2.0 if odd else 1.0), ["temperature", "2.0", "1.0"]),
        "hard_weight differs": (call(hard_weight=0.3 if odd else 0.0), ["hard weight", "0.3", "0.0"]),
        "hard_weight without a target": (call(tgt=None, hard_weight=0.3), ["needs a target"]),
        "target on some ranks only": (call(tgt=None if odd else target), ["target given"]),
    }
    errors = errors_of({name: c for name, (c, _) in cases.items()})
    failures = []
    for name, (_, words) in cases.items():
        error = errors[name]
        if error is None or not all(w in error for w in words):
            failures.append(f"TP {world} rank {rank} {name}: {error!r} lacks {words}")
    # the group still works
    vparallel_ce.distillation_loss(s, t, target, group=group)
    return failures


def test_bad_input_at_world_1():
    s, t, target = make(1, 11, "some ignored")
    with pytest.raises(vparallel_ce.InvalidInputError, match="teacher_logits shape"):
        vparallel_ce.distillation_loss(s, t[..., :-1], target)
    with pytest.raises(ValueError, match="needs a target"):
        vparallel_ce.distillation_loss(s, t, hard_weight=0.5)
    with pytest.raises(vparallel_ce.InvalidInputError, match=r"outside \[0, 11\)"):
        vparallel_ce.distillation_loss(s, t, torch.full_like(target, 11))


def dtensor_rank(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    s_full, t_full, target = make(2, 11, "some ignored")
    s = distribute_tensor(s_full.clone(), mesh, [Shard(-1)]).requires_grad_()
    t = distribute_tensor(t_full.clone(), mesh, [Shard(-1)])
    out = vparallel_ce.distillation_loss(s, t, target, kind="reverse_kl", temperature=2.0, hard_weight=0.3)
    out.backward()
    ref_s = s_full.clone().requires_grad_()
    ref = reference(ref_s, t_full, target, kind="reverse_kl", temperature=2.0, hard_weight=0.3)
    ref.backward()
    from tests.reference import local_grad

    failures = []
    if rel_err(out.detach(), ref.detach()) > 1e-10:
        failures.append(f"DTensor TP {world} rank {rank}: loss {out} vs {ref}")
    if rel_err(local_grad(s), shard(ref_s.grad, world, rank), ref_s.grad) > 1e-10:
        failures.append(f"DTensor TP {world} rank {rank}: gradient")
    return failures


def test_large_magnitude_fp32_logits_lose_nothing_to_cancellation():
    # every sum is relative to the global maxima: logits near +-1e4 in fp32 stay at fp32 accuracy
    g = torch.Generator().manual_seed(4)
    s = torch.randn(4, 30, generator=g) * 3 + 1e4
    t = torch.randn(4, 30, generator=g) * 3 - 1e4
    target = torch.randint(0, 30, (4,), generator=g)
    for kind, beta in KINDS:
        opts = dict(kind=kind, beta=beta, hard_weight=0.3, temperature=2.0, reduction="none")
        x = s.clone().requires_grad_()
        out = vparallel_ce.distillation_loss(x, t, target, **opts)
        out.sum().backward()
        ref_x = s.double().requires_grad_()
        ref = reference(ref_x, t.double(), target, **opts)
        ref.sum().backward()
        errs = rel_err(out.detach(), ref.detach()), rel_err(x.grad, ref_x.grad)
        assert max(errs) < TOL[torch.float32], f"{kind} beta={beta}: errors {errs}"
