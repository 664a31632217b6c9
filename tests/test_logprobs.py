"""Specification of ``vparallel_ce.token_logprobs`` and ``vparallel_ce.linear_token_logprobs``.

Per token, with ``z`` the full (gathered) logits and ``T`` the temperature::

    logprobs = log_softmax(z / T)[target]          entropy = -sum_j p_j log p_j,   p = softmax(z / T)

both 0 at ignored tokens, fp32 (fp64 for fp64 input), of ``target``'s shape. Both are compared with
a float64 reference computed by plain torch on the gathered logits (:func:`_gathered_logprobs`),
values and the gradients of every input (logits; hidden, weight, bias) for random upstream weights
on both outputs together and on each alone, on 1-4 gloo ranks with uneven and empty vocab shards.

Layout of this file (each test is one multi-rank call that loops over a grid and reports every
failing case by name):

* ``test_token_logprobs_match_float64_reference`` -- logits op: vocab x temperature x dtype x
  backward mode x chunks x ignore_index (a covering subset, :func:`grid`), TP 1-4;
* ``test_linear_token_logprobs_match_float64_reference`` -- the same grid for hidden + lm_head
  shard, with and without bias, with and without sequence parallelism;
* ``test_large_magnitude_logits_are_finite_and_exact`` -- |z| ~ 1e4 (spread and offset);
* ``test_all_ignored_tokens_give_zeros`` -- outputs 0 and gradients 0, never NaN;
* ``test_negated_logprobs_equal_the_loss_ops_reduction_none`` -- against ``cross_entropy`` and
  ``linear_cross_entropy`` (of logits / T);
* ``test_dtensor_inputs`` -- logits ``Shard(-1)``, weight ``Shard(0)``, sequence-sharded hidden;
* ``test_entropy_costs_no_extra_collective`` -- collective calls and payload;
* ``test_bad_input_raises_a_clear_error_on_every_rank``, ``test_single_process_errors_and_check_false``;
* ``test_check_false_with_vocab_size_needs_no_size_exchange``;
* memory: no full fp32 logits copy, no ``[N, V_local]`` logits in the linear op, caller's logits
  untouched.

Tolerances: ``tests.reference.TOL`` (float64 1e-10, float32 1e-5, bfloat16 2e-2) relative to the
largest value of the full reference. bfloat16 is judged against the reference of the bf16-rounded
inputs; the linear op's gradients through the entropy get 6e-2 in bf16 (its logits are bf16 GEMM
outputs, see ``LINEAR_ENTROPY_GRAD_TOL_BF16``).
"""

from __future__ import annotations

import itertools
import math
from typing import NamedTuple

import pytest
import torch

import vparallel_ce
from tests.dist import errors_of, run_ranks
from tests.reference import TOL, local_grad, rel_err, shard

H = 8
TEMPERATURES = (1.0, 0.7, 1.9)
IGNORE_INDICES = (-100, 5)  # the default and a custom one that is also a valid class id
CHUNKS = (1, 3, "auto")
DTYPES = (torch.float64, torch.float32, torch.bfloat16)
# which outputs the backward goes through (upstream weights u for logprobs, v for entropy)
MODES = (
    "logprobs",                    # with_entropy=False:  sum(u * logp)
    "logprobs+entropy",            # with_entropy=True:   sum(u * logp) + sum(v * entropy)
    "logprobs, entropy unused",    # with_entropy=True:   sum(u * logp)
    "entropy, logprobs unused",    # with_entropy=True:   sum(v * entropy)
)


ENTROPY_MODES = ("logprobs+entropy", "entropy, logprobs unused")  # backward goes through the entropy
# bfloat16 cases are judged against the reference of the bf16-ROUNDED inputs (the op's own
# arithmetic), at TOL[bf16] = 2e-2 -- except the linear op's gradients through the entropy: its
# logits are bf16 GEMM outputs, rounded at |z| (up to ~10 here, ulp 0.06), and the entropy
# gradient -p (log p + H) responds more to that rounding than log p_t does (a float32-arithmetic
# implementation over bf16 logits measures up to 3.4e-2).
LINEAR_ENTROPY_GRAD_TOL_BF16 = 6e-2


def _tol(dtype, what: str, mode: str, linear: bool = False) -> float:
    if dtype == torch.bfloat16 and linear and what.startswith("d ") and mode in ENTROPY_MODES:
        return LINEAR_ENTROPY_GRAD_TOL_BF16
    return TOL[dtype]


def _err(mine, expect, full=None, floor=0.0) -> float:
    """max |mine - expect| / max(max |full|, floor): ``rel_err`` judged on the scale of the full
    reference, or on ``floor`` where that is ~0 (the entropy of a one-hot softmax and its gradient)."""
    assert mine.shape == expect.shape, (mine.shape, expect.shape)
    if expect.numel() == 0:
        return 0.0
    scale = max((expect if full is None else full).double().abs().max().item(), floor)
    diff = (mine.double() - expect.double()).abs().max().item()
    return diff / scale if scale > 0 else diff


def _name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def _out_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


# ---------------------------------------------------------------------------------------------
# The float64 reference and the test data


def _gathered_logprobs(full_logits: torch.Tensor, target: torch.Tensor, temperature: float = 1.0,
                       ignore_index: int = -100):
    """THE reference: ``(log softmax(z / T)[target], entropy of softmax(z / T))`` per token, in float64,
    by plain torch on the full (gathered) ``[..., V]`` logits; 0 at ignored tokens. Differentiable."""
    z = full_logits.double() / temperature
    logsm = torch.log_softmax(z, dim=-1)
    valid = target != ignore_index
    picked = logsm.gather(-1, torch.where(valid, target, 0).unsqueeze(-1)).squeeze(-1)
    entropy = -(logsm.exp() * logsm).sum(-1)
    zero = torch.zeros((), dtype=torch.float64)
    return torch.where(valid, picked, zero), torch.where(valid, entropy, zero)


def _objective(mode: str, logp, entropy, u, v):
    if mode in ("logprobs", "logprobs, entropy unused"):
        return (logp * u.to(logp.dtype)).sum()
    if mode == "entropy, logprobs unused":
        return (entropy * v.to(entropy.dtype)).sum()
    return (logp * u.to(logp.dtype)).sum() + (entropy * v.to(entropy.dtype)).sum()


def _targets(g, tokens, vocab, ignore_frac, ignore_index):
    target = torch.randint(0, vocab, tokens, generator=g)
    target[torch.rand(tokens, generator=g) < ignore_frac] = ignore_index
    target.view(-1)[0] = ignore_index  # at least one ignored token in every case
    return target


def _upstream(seed, shape):
    """Random upstream weights for logprobs (u) and entropy (v), nonzero at ignored tokens too."""
    g = torch.Generator().manual_seed(1000 + seed)
    return torch.randn(shape, generator=g, dtype=torch.float64), torch.randn(shape, generator=g, dtype=torch.float64)


OFFSETS = (-6.0, 0.0, 4.0)  # all-negative logits make a phantom zero logit (padding) visible


def make_logits(seed, tokens=(3, 5), vocab=29, ignore_index=-100, ignore_frac=0.3, scale=3.0, offset=None):
    g = torch.Generator().manual_seed(seed)
    offset = OFFSETS[seed % len(OFFSETS)] if offset is None else offset
    logits = torch.randn(*tokens, vocab, generator=g, dtype=torch.float64) * scale + offset
    return logits, _targets(g, tokens, vocab, ignore_frac, ignore_index)


def make_linear(seed, tokens=(3, 5), vocab=29, ignore_index=-100, ignore_frac=0.3, bias=True, bias_offset=None):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*tokens, H, generator=g, dtype=torch.float64)
    weight = torch.randn(vocab, H, generator=g, dtype=torch.float64) * 0.8
    b = None
    if bias:
        offset = OFFSETS[seed % len(OFFSETS)] if bias_offset is None else bias_offset
        b = torch.randn(vocab, generator=g, dtype=torch.float64) + offset
    return hidden, weight, b, _targets(g, tokens, vocab, ignore_frac, ignore_index)


class Case(NamedTuple):
    seed: int
    vocab: int
    temperature: float
    dtype: torch.dtype
    mode: str
    chunks: object
    ignore_index: int
    bias: bool = True
    label: str = ""

    def __str__(self):
        return (f"[{self.label + ': ' if self.label else ''}V={self.vocab} T={self.temperature} {_name(self.dtype)} "
                f"backward={self.mode!r} chunks={self.chunks} ignore_index={self.ignore_index}"
                f"{'' if self.bias else ' no bias'}]")


def grid(vocabs):
    """A covering subset of vocab x temperature x dtype x mode x chunks x ignore_index x bias x logit
    offset: every dtype x temperature x mode triple, and each dtype, temperature and mode meets every
    chunk option, both ignore_index values, bias and no bias, and every offset (36 cases per vocab
    size instead of 1296)."""
    seed = 0
    for vi, vocab in enumerate(vocabs):
        for (ti, temperature), (di, dtype), (mi, mode) in itertools.product(
            enumerate(TEMPERATURES), enumerate(DTYPES), enumerate(MODES)
        ):
            seed += 1
            yield Case(seed, vocab, temperature, dtype, mode, CHUNKS[(ti + mi + vi) % 3],
                       IGNORE_INDICES[(di + mi + ti) % 2], bias=(ti + 2 * di + mi + vi) % 3 != 0)


class Report:
    """Collects every failed check of a rank with the case's name, and the worst error per quantity."""

    def __init__(self):
        self.failures: list[str] = []
        self.worst: dict[str, tuple[float, str]] = {}

    def err(self, case, what: str, err: float, tol: float):
        key = f"{what} {_name(case.dtype)}"
        if key not in self.worst or not err <= self.worst[key][0]:
            self.worst[key] = (err, str(case))
        if not err <= tol:  # NaN fails
            self.failures.append(f"{case}: {what} error {err:.3g} > {tol:.0e}")

    def fact(self, case, what: str, ok: bool):
        if not ok:
            self.failures.append(f"{case}: {what}")

    def result(self):
        return {"failures": self.failures, "worst": self.worst}


def assert_clean(results, limit=15):
    """Fail naming every failing case (first ``limit``) and its rank."""
    lines = [f"rank {rank}: {f}" for rank, res in enumerate(results) for f in res["failures"]]
    assert not lines, f"{len(lines)} failed checks:\n" + "\n".join(lines[:limit])


def _run_guarded(case, fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except Exception as exc:  # name the case; the pool is torn down, so no rank hangs
        raise AssertionError(f"{case}: {type(exc).__name__}: {exc}") from exc


def _check_outputs(report, case, out, with_entropy, shape, dtype):
    """The return convention: a tensor, or the pair (logprobs, entropy); fp32/fp64; target's shape."""
    if with_entropy:
        ok = isinstance(out, tuple) and len(out) == 2
        report.fact(case, f"with_entropy=True must return a pair (logprobs, entropy), got {type(out).__name__}", ok)
        logp, ent = out if ok else (out, None)
    else:
        ok = isinstance(out, torch.Tensor)
        report.fact(case, f"with_entropy=False must return one tensor, got {type(out).__name__}", ok)
        logp, ent = (out if ok else out[0]), None
    for name, t in (("logprobs", logp), ("entropy", ent)):
        if t is None:
            continue
        report.fact(case, f"{name} dtype {t.dtype} != {_out_dtype(dtype)}", t.dtype == _out_dtype(dtype))
        report.fact(case, f"{name} shape {tuple(t.shape)} != target shape {tuple(shape)}", tuple(t.shape) == tuple(shape))
    return logp, ent


def _check_ignored_are_zero(report, case, logp, ent, valid):
    report.fact(case, "logprobs not exactly 0 at ignored tokens", bool((logp.detach()[~valid] == 0).all()))
    if ent is not None:
        report.fact(case, "entropy not exactly 0 at ignored tokens", bool((ent.detach()[~valid] == 0).all()))


# ---------------------------------------------------------------------------------------------
# token_logprobs over vocab-sharded logits


def _reference_logits(logits, target, temperature, ignore_index, mode, u, v):
    full = logits.clone().requires_grad_()
    ref_logp, ref_ent = _gathered_logprobs(full, target, temperature, ignore_index)
    _objective(mode, ref_logp, ref_ent, u, v).backward()
    return ref_logp.detach(), ref_ent.detach(), full.grad


def logits_case(report, rank, world, group, case: Case, *, logits=None, target=None, ref_from_input=None,
                floors=None):
    """Run ``token_logprobs`` on this rank's shard for one case; record its errors in ``report``.
    ``ref_from_input`` (default: for bf16): the reference is computed from the logits rounded to
    ``case.dtype``, to judge the op's own arithmetic, not the input rounding. ``floors``: minimum
    error scales per quantity (see :func:`_err`)."""
    if logits is None:
        logits, target = make_logits(case.seed, vocab=case.vocab, ignore_index=case.ignore_index)
    u, v = _upstream(case.seed, target.shape)
    if ref_from_input is None:
        ref_from_input = case.dtype == torch.bfloat16
    floors = floors or {}
    ref_in = logits.to(case.dtype).double() if ref_from_input else logits
    ref_logp, ref_ent, ref_grad = _reference_logits(ref_in, target, case.temperature, case.ignore_index, case.mode, u, v)
    with_entropy = case.mode != "logprobs"
    mine = shard(logits, world, rank).to(case.dtype).clone().requires_grad_()
    out = vparallel_ce.token_logprobs(
        mine, target, group=group, temperature=case.temperature, ignore_index=case.ignore_index,
        with_entropy=with_entropy, chunks=case.chunks,
    )
    logp, ent = _check_outputs(report, case, out, with_entropy, target.shape, case.dtype)
    tol = TOL[case.dtype]
    report.err(case, "logprobs", _err(logp.detach(), ref_logp, floor=floors.get("logprobs", 0.0)), tol)
    if ent is not None:
        report.err(case, "entropy", _err(ent.detach(), ref_ent, floor=floors.get("entropy", 0.0)), tol)
    _check_ignored_are_zero(report, case, logp, ent, target != case.ignore_index)
    _objective(case.mode, logp, ent, u, v).backward()
    report.fact(case, "logits.grad is None", mine.grad is not None)
    if mine.grad is not None:
        report.fact(case, f"logits.grad dtype {mine.grad.dtype} != {case.dtype}", mine.grad.dtype == case.dtype)
        report.err(case, "d logits", _err(mine.grad, shard(ref_grad, world, rank), ref_grad,
                                          floors.get("d logits", 0.0)), tol)


def logits_grid_rank(rank, world, vocabs):
    import torch.distributed as dist

    group = dist.group.WORLD if world > 1 else None
    report = Report()
    for case in grid(vocabs):
        _run_guarded(case, logits_case, report, rank, world, group, case)
    return report.result()


def _on_ranks(fn, world, *args, **kwargs):
    return run_ranks(fn, world, *args, **kwargs) if world > 1 else [fn(0, 1, *args)]


@pytest.mark.parametrize("world,vocabs", [(1, (29, 131)), (2, (29, 131)), (3, (29, 131, 4)), (4, (29, 131, 9))])
def test_token_logprobs_match_float64_reference(world, vocabs):
    # V=29 and 131 (not multiples of 128, nor of 8 on one rank) are uneven over 2-4 ranks
    # (131 over 4: 33, 33, 33, 32); V=4 over 3 ranks (2, 2, 0) and V=9 over 4 (3, 3, 3, 0) leave the
    # last rank an empty shard. T in {1, 0.7, 1.9}; float64 to 1e-10, float32 1e-5, bfloat16 2e-2.
    assert_clean(_on_ranks(logits_grid_rank, world, vocabs))


# ---------------------------------------------------------------------------------------------
# linear_token_logprobs over hidden states + the lm_head weight shard


def _reference_linear(hidden, weight, bias, target, temperature, ignore_index, mode, u, v):
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    b = None if bias is None else bias.clone().requires_grad_()
    logits = h @ w.T + (0 if b is None else b)
    ref_logp, ref_ent = _gathered_logprobs(logits, target, temperature, ignore_index)
    _objective(mode, ref_logp, ref_ent, u, v).backward()
    return ref_logp.detach(), ref_ent.detach(), h.grad, w.grad, None if b is None else b.grad


def linear_case(report, rank, world, group, case: Case, sequence_parallel=False, *, data=None,
                ref_from_input=None, tol=None):
    """Run ``linear_token_logprobs`` for one case. With ``sequence_parallel`` each rank passes its
    torch.chunk shard of the flattened tokens: the outputs are its tokens, ``hidden.grad`` its rows,
    ``weight.grad`` the gradient of the shard over the WHOLE group's tokens."""
    hidden, weight, bias, target = data or make_linear(case.seed, vocab=case.vocab, ignore_index=case.ignore_index,
                                                       bias=case.bias)
    u, v = _upstream(case.seed, target.shape)
    if ref_from_input is None:
        ref_from_input = case.dtype == torch.bfloat16
    rnd = (lambda t: None if t is None else t.to(case.dtype).double()) if ref_from_input else (lambda t: t)
    ref_logp, ref_ent, dh_ref, dw_ref, db_ref = _reference_linear(
        rnd(hidden), rnd(weight), rnd(bias), target, case.temperature, case.ignore_index, case.mode, u, v)
    if sequence_parallel:
        flat = lambda t: shard(t.reshape(-1, *t.shape[target.dim():]), world, rank, dim=0)  # noqa: E731
        h_in, t_in, u_in, v_in = flat(hidden), flat(target), flat(u), flat(v)
        ref_logp_in, ref_ent_in, dh_expect = flat(ref_logp), flat(ref_ent), flat(dh_ref)
    else:
        h_in, t_in, u_in, v_in, ref_logp_in, ref_ent_in, dh_expect = hidden, target, u, v, ref_logp, ref_ent, dh_ref
    with_entropy = case.mode != "logprobs"
    h = h_in.to(case.dtype).clone().requires_grad_()
    w = shard(weight, world, rank, dim=0).to(case.dtype).clone().requires_grad_()
    b = None if bias is None else shard(bias, world, rank, dim=0).to(case.dtype).clone().requires_grad_()
    out = vparallel_ce.linear_token_logprobs(
        h, w, t_in, b, group=group, sequence_parallel=sequence_parallel, temperature=case.temperature,
        ignore_index=case.ignore_index, with_entropy=with_entropy, chunks=case.chunks,
    )
    logp, ent = _check_outputs(report, case, out, with_entropy, t_in.shape, case.dtype)
    fixed_tol = tol
    tol = lambda what: _tol(case.dtype, what, case.mode, linear=True) if fixed_tol is None else fixed_tol  # noqa: E731
    report.err(case, "logprobs", rel_err(logp.detach(), ref_logp_in, ref_logp), tol("logprobs"))
    if ent is not None:
        report.err(case, "entropy", rel_err(ent.detach(), ref_ent_in, ref_ent), tol("entropy"))
    _check_ignored_are_zero(report, case, logp, ent, t_in != case.ignore_index)
    _objective(case.mode, logp, ent, u_in, v_in).backward()
    for name, param in (("d hidden", h), ("d weight", w), ("d bias", b)):
        if param is None:
            continue
        report.fact(case, f"{name} is None", param.grad is not None)
        if param.grad is not None:
            report.fact(case, f"{name} dtype {param.grad.dtype} != {case.dtype}", param.grad.dtype == case.dtype)
    if h.grad is not None:
        report.err(case, "d hidden", rel_err(h.grad, dh_expect, dh_ref), tol("d hidden"))
    if w.grad is not None:
        report.err(case, "d weight", rel_err(w.grad, shard(dw_ref, world, rank, 0), dw_ref), tol("d weight"))
    if b is not None and b.grad is not None:
        report.err(case, "d bias", rel_err(b.grad, shard(db_ref, world, rank, 0), db_ref), tol("d bias"))


def linear_grid_rank(rank, world, vocabs, sequence_parallel):
    import torch.distributed as dist

    group = dist.group.WORLD if world > 1 else None
    report = Report()
    for case in grid(vocabs):
        _run_guarded(case, linear_case, report, rank, world, group, case, sequence_parallel)
    if sequence_parallel and world == 4:
        # 3 tokens over 4 ranks: the last rank holds no tokens (and, with V=9, no vocab either)
        for case in itertools.islice(grid((9,)), 0, 36, 5):
            case = case._replace(label="3 tokens over 4 ranks")
            data = make_linear(case.seed, tokens=(3,), vocab=9, ignore_index=case.ignore_index, ignore_frac=0.0)
            _run_guarded(case, linear_case, report, rank, world, group, case, True, data=data)
    return report.result()


@pytest.mark.parametrize("world,vocabs,sp", [
    (1, (29, 131), False), (2, (29, 131), False), (3, (29, 4), False), (4, (131, 9), False),
    (2, (131,), True), (3, (29,), True), (4, (131, 9), True),
])
def test_linear_token_logprobs_match_float64_reference(world, vocabs, sp):
    # 15 tokens; with sequence parallelism they are split 8/7, 5/5/5 and 4/4/4/3 over the ranks,
    # and at TP 4 a 3-token batch leaves the last rank without tokens
    assert_clean(_on_ranks(linear_grid_rank, world, vocabs, sp))


# ---------------------------------------------------------------------------------------------
# Large logits: finite and exact (no overflow, max started at -inf, no phantom padded columns)


def large_rank(rank, world):
    import torch.distributed as dist

    group = dist.group.WORLD if world > 1 else None
    report = Report()
    vocab, seed = 131, 500
    # (name, logits scale, offset, dtype, temperatures). The reference is computed from the logits
    # rounded to the dtype, and errors are judged relative to the largest reference value as
    # everywhere else: the op must subtract the max before anything else (before the division by
    # T too), so log-probs, entropies and gradients keep the precision of their own size, not that
    # of |z| ~ 1e4. In float32, T in {0.5, 2} (exact divisions) keeps the reference's z / T the op's.
    setups = [
        ("spread 1e4", 1e4, 0.0, torch.float64, TEMPERATURES),
        ("spread 1e4", 1e4, 0.0, torch.float32, TEMPERATURES),
        ("offset -1e4", 3.0, -1e4, torch.float64, TEMPERATURES),
        ("offset +1e4", 3.0, 1e4, torch.float64, TEMPERATURES),
        ("offset -1e4", 3.0, -1e4, torch.float32, (1.0, 0.5, 2.0)),
        ("offset +1e4", 3.0, 1e4, torch.float32, (1.0, 0.5, 2.0)),
        ("offset -3e4", 3.0, -3e4, torch.bfloat16, (1.0, 0.7, 1.9)),
    ]
    for name, scale, offset, dtype, temps in setups:
        for temperature, mode, chunks in zip(temps, ("logprobs+entropy", "entropy, logprobs unused", "logprobs"),
                                             CHUNKS):
            seed += 1
            logits, target = make_logits(seed, tokens=(4, 6), vocab=vocab, scale=scale, offset=offset)
            case = Case(seed, vocab, temperature, dtype, mode, chunks, -100, label=name)
            # a one-hot softmax has entropy ~0 and entropy gradients ~0: judge those on their range
            floors = {"entropy": math.log(vocab), "d logits": 1.0 / temperature}
            _run_guarded(case, logits_case, report, rank, world, group, case, logits=logits, target=target,
                         ref_from_input=True, floors=floors)
    # the linear op, with the bias carrying the offset. Its float32 logits are rounded at their own
    # magnitude (ulp(1e4) ~ 1e-3) before any softmax, so in float32 only finite values within 1e-2
    # are asked; float64 must be exact.
    for offset, dtype in itertools.product((-1e4, 1e4), (torch.float64, torch.float32)):
        seed += 1
        data = make_linear(seed, vocab=vocab, bias_offset=offset)
        case = Case(seed, vocab, 0.7, dtype, "logprobs+entropy", 3, -100, label=f"linear, bias offset {offset:+.0e}")
        _run_guarded(case, linear_case, report, rank, world, group, case, False, data=data, ref_from_input=True,
                     tol=TOL[dtype] if dtype == torch.float64 else 1e-2)
    return report.result()


@pytest.mark.parametrize("world", [1, 4])
def test_large_magnitude_logits_are_finite_and_exact(world):
    # randn * 1e4 (one-hot softmax: exp underflows everywhere but at the max), and +-1e4 offsets
    # (all logits far below or above 0: a running max started at 0, or a zero-padded column, breaks)
    assert_clean(_on_ranks(large_rank, world))


# ---------------------------------------------------------------------------------------------
# Ignored tokens


def all_ignored_rank(rank, world):
    import torch.distributed as dist

    group = dist.group.WORLD
    report = Report()
    for mode, dtype, sp in itertools.product(MODES, (torch.float64, torch.bfloat16), (False, True)):
        case = Case(900, 29, 0.7, dtype, mode, 3, -100, label="every token ignored")
        with_entropy = mode != "logprobs"
        logits, target = make_logits(900, vocab=29, ignore_frac=1.0)
        u, v = _upstream(900, target.shape)
        if not sp:
            x = shard(logits, world, rank).to(dtype).requires_grad_()
            out = vparallel_ce.token_logprobs(x, target, group=group, temperature=0.7, with_entropy=with_entropy,
                                              chunks=3)
            logp, ent = _check_outputs(report, case, out, with_entropy, target.shape, dtype)
            _check_ignored_are_zero(report, case, logp, ent, target != -100)
            _objective(mode, logp, ent, u, v).backward()
            report.fact(case, "logits.grad is not all zeros", x.grad is not None and bool((x.grad == 0).all()))
        hidden, weight, bias, target = make_linear(901, vocab=29, ignore_frac=1.0)
        if sp:
            hidden, target = shard(hidden.reshape(-1, H), world, rank, 0), shard(target.reshape(-1), world, rank, 0)
            u, v = _upstream(901, target.shape)
        h = hidden.to(dtype).requires_grad_()
        w = shard(weight, world, rank, 0).to(dtype).requires_grad_()
        b = shard(bias, world, rank, 0).to(dtype).requires_grad_()
        out = vparallel_ce.linear_token_logprobs(h, w, target, b, group=group, sequence_parallel=sp, temperature=0.7,
                                                 with_entropy=with_entropy, chunks=3)
        lcase = case._replace(label=f"every token ignored, linear, sequence_parallel={sp}")
        logp, ent = _check_outputs(report, lcase, out, with_entropy, target.shape, dtype)
        _check_ignored_are_zero(report, lcase, logp, ent, target != -100)
        _objective(mode, logp, ent, u, v).backward()
        for name, p in (("hidden", h), ("weight", w), ("bias", b)):
            report.fact(lcase, f"{name}.grad is not all zeros", p.grad is not None and bool((p.grad == 0).all()))
    # sequence parallel where only rank 0's token shard is entirely ignored: the others' tokens
    # still give rank 0 its full weight gradient
    for mode in MODES:
        case = Case(902, 29, 1.9, torch.float64, mode, "auto", -100, label="rank 0's tokens all ignored")
        hidden, weight, bias, target = make_linear(902, vocab=29)
        target.view(-1)[: math.ceil(target.numel() / world)] = -100
        linear_case(report, rank, world, group, case, True, data=(hidden, weight, bias, target))
    return report.result()


def test_all_ignored_tokens_give_zeros():
    # never NaN: an all-ignored microbatch (padding only) returns zeros and zero gradients
    assert_clean(run_ranks(all_ignored_rank, 2))


# ---------------------------------------------------------------------------------------------
# -token_logprobs is the loss op's reduction="none" (of logits / T)

EQ_TOL = {torch.float64: 1e-12, torch.float32: 1e-6, torch.bfloat16: 1e-6}


def equality_rank(rank, world):
    import torch.distributed as dist

    group = dist.group.WORLD if world > 1 else None
    report = Report()
    seed = 700
    for dtype, temperature, ignore_index, chunks in itertools.product(DTYPES, TEMPERATURES, IGNORE_INDICES, (1, "auto")):
        seed += 1
        case = Case(seed, 29, temperature, dtype, "logprobs", chunks, ignore_index, label="vs cross_entropy")
        logits, target = make_logits(seed, vocab=29, ignore_index=ignore_index)
        u, _ = _upstream(seed, target.shape)
        x = shard(logits, world, rank).to(dtype)
        a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
        ours = vparallel_ce.token_logprobs(a, target, group=group, temperature=temperature, ignore_index=ignore_index,
                                           chunks=chunks)
        # the loss op sees logits / T, divided in the statistics' precision (fp32, fp64 for fp64)
        z = b if temperature == 1.0 else b.to(_out_dtype(dtype)) / temperature
        theirs = vparallel_ce.cross_entropy(z, target, group=group, reduction="none", ignore_index=ignore_index,
                                            chunks=chunks)
        report.err(case, "-logprobs vs loss", rel_err(-ours.detach(), theirs.detach()), EQ_TOL[dtype])
        (ours * u.to(ours.dtype)).sum().backward()
        (theirs * -u.to(theirs.dtype)).sum().backward()
        report.err(case, "d logits vs loss", rel_err(a.grad, b.grad), TOL[dtype] if dtype == torch.bfloat16 else
                   10 * EQ_TOL[dtype])
    # the linear ops in float64 and float32 (in bf16 two schedules may round their bf16 logits
    # differently; both are held to the float64 reference above)
    for dtype, temperature, sp in itertools.product(DTYPES[:2], TEMPERATURES, (False, True) if world > 1 else (False,)):
        seed += 1
        case = Case(seed, 29, temperature, dtype, "logprobs", 3, -100, label=f"vs linear_cross_entropy sp={sp}")
        hidden, weight, bias, target = make_linear(seed, vocab=29)
        if sp:
            hidden, target = shard(hidden.reshape(-1, H), world, rank, 0), shard(target.reshape(-1), world, rank, 0)
        u, _ = _upstream(seed, target.shape)
        tensors = [hidden.to(dtype), shard(weight, world, rank, 0).to(dtype), shard(bias, world, rank, 0).to(dtype)]
        mine = [t.clone().requires_grad_() for t in tensors]
        other = [t.clone().requires_grad_() for t in tensors]
        ours = vparallel_ce.linear_token_logprobs(mine[0], mine[1], target, mine[2], group=group, sequence_parallel=sp,
                                                  temperature=temperature, chunks=3)
        # logits / T = h @ (W / T)^T + b / T
        w_t = other[1] if temperature == 1.0 else other[1] / temperature
        b_t = other[2] if temperature == 1.0 else other[2] / temperature
        theirs = vparallel_ce.linear_cross_entropy(other[0], w_t, target, b_t, group=group, sequence_parallel=sp,
                                                   reduction="none", chunks=3)
        tol = {torch.float64: 1e-12, torch.float32: 1e-5}[dtype]
        report.err(case, "-logprobs vs loss", rel_err(-ours.detach(), theirs.detach()), tol)
        (ours * u.to(ours.dtype)).sum().backward()
        (theirs * -u.to(theirs.dtype)).sum().backward()
        for name, p, q in zip(("d hidden", "d weight", "d bias"), mine, other):
            report.err(case, f"{name} vs loss", rel_err(p.grad, q.grad), 1e-11 if dtype == torch.float64 else 1e-5)
    return report.result()


@pytest.mark.parametrize("world", [1, 3])
def test_negated_logprobs_equal_the_loss_ops_reduction_none(world):
    assert_clean(_on_ranks(equality_rank, world))


# ---------------------------------------------------------------------------------------------
# DTensor inputs (as in the loss ops) and a DeviceMesh as the group


def dtensor_rank(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    report = Report()
    T, mode = 0.7, "logprobs+entropy"
    case = Case(800, 23, T, torch.float64, mode, 2, -100, label="DTensor logits Shard(-1)")
    logits, target = make_logits(800, vocab=23)
    u, v = _upstream(800, target.shape)
    ref_logp, ref_ent, ref_grad = _reference_logits(logits, target, T, -100, mode, u, v)
    dt = distribute_tensor(logits.clone(), mesh, [Shard(-1)]).requires_grad_()
    logp, ent = vparallel_ce.token_logprobs(dt, target, temperature=T, with_entropy=True, chunks=2)
    report.fact(case, "outputs must be plain tensors", not isinstance(logp, DTensor) and not isinstance(ent, DTensor))
    report.err(case, "logprobs", rel_err(logp.detach(), ref_logp), 1e-12)
    report.err(case, "entropy", rel_err(ent.detach(), ref_ent), 1e-12)
    _objective(mode, logp, ent, u, v).backward()
    report.err(case, "d logits", rel_err(local_grad(dt), shard(ref_grad, world, rank), ref_grad), 1e-12)
    # a plain shard with group=<1-D DeviceMesh>
    case = case._replace(label="plain shard, group=DeviceMesh")
    logits_case(report, rank, world, mesh, case, logits=logits, target=target)

    # linear: weight Shard(0) with plain / Replicate hidden, and a sequence-sharded hidden
    hidden, weight, bias, target = make_linear(801, vocab=23, bias=False)
    u, v = _upstream(801, target.shape)
    ref_logp, ref_ent, dh_ref, dw_ref, _ = _reference_linear(hidden, weight, None, target, T, -100, mode, u, v)
    for hidden_kind in ("plain", "Replicate"):
        case = Case(801, 23, T, torch.float64, mode, 2, -100, label=f"DTensor weight Shard(0), {hidden_kind} hidden")
        w = distribute_tensor(weight.clone(), mesh, [Shard(0)]).requires_grad_()
        h = hidden.clone() if hidden_kind == "plain" else distribute_tensor(hidden.clone(), mesh, [Replicate()])
        h.requires_grad_()
        logp, ent = vparallel_ce.linear_token_logprobs(h, w, target, temperature=T, with_entropy=True, chunks=2)
        report.fact(case, "outputs must be plain tensors", not isinstance(logp, DTensor) and not isinstance(ent, DTensor))
        report.err(case, "logprobs", rel_err(logp.detach(), ref_logp), 1e-12)
        report.err(case, "entropy", rel_err(ent.detach(), ref_ent), 1e-12)
        _objective(mode, logp, ent, u, v).backward()
        dh = local_grad(h) if isinstance(h.grad, DTensor) else h.grad
        report.err(case, "d hidden", rel_err(dh, dh_ref), 1e-12)
        report.err(case, "d weight", rel_err(local_grad(w), shard(dw_ref, world, rank, 0), dw_ref), 1e-12)
    case = Case(801, 23, T, torch.float64, mode, 2, -100, label="sequence parallel, hidden DTensor Shard(1)")
    hs = distribute_tensor(hidden.clone(), mesh, [Shard(1)]).requires_grad_()
    w = distribute_tensor(weight.clone(), mesh, [Shard(0)]).requires_grad_()
    mine = lambda t: torch.chunk(t, world, dim=1)[rank]  # noqa: E731
    logp, ent = vparallel_ce.linear_token_logprobs(hs, w, mine(target), sequence_parallel=True, temperature=T,
                                                   with_entropy=True, chunks=2)
    report.fact(case, f"outputs are this rank's tokens {tuple(mine(target).shape)}, got {tuple(logp.shape)}",
                logp.shape == mine(target).shape and ent.shape == mine(target).shape)
    if logp.shape == mine(target).shape:
        report.err(case, "logprobs", rel_err(logp.detach(), mine(ref_logp), ref_logp), 1e-12)
        report.err(case, "entropy", rel_err(ent.detach(), mine(ref_ent), ref_ent), 1e-12)
        _objective(mode, logp, ent, mine(u), mine(v)).backward()
        report.err(case, "d hidden", rel_err(local_grad(hs), mine(dh_ref), dh_ref), 1e-12)
        report.err(case, "d weight", rel_err(local_grad(w), shard(dw_ref, world, rank, 0), dw_ref), 1e-12)
    # DTensors with the wrong placement are named
    errors = {}
    for name, call in {
        "weight Shard(1)": lambda: vparallel_ce.linear_token_logprobs(
            hidden, distribute_tensor(weight, mesh, [Shard(1)]), target),
        "logits Replicate": lambda: vparallel_ce.token_logprobs(
            distribute_tensor(logits, mesh, [Replicate()]), make_logits(800, vocab=23)[1]),
    }.items():
        try:
            call()
            errors[name] = None
        except ValueError as exc:
            errors[name] = str(exc)
    report.fact("DTensor weight Shard(1)", f"must name the placement, got {errors['weight Shard(1)']!r}",
                "must be Shard(0)" in (errors["weight Shard(1)"] or ""))
    report.fact("DTensor logits Replicate", f"must name the placement, got {errors['logits Replicate']!r}",
                "sharded on its last" in (errors["logits Replicate"] or ""))
    return report.result()


@pytest.mark.parametrize("world", [2, 3])
def test_dtensor_inputs(world):
    assert_clean(run_ranks(dtensor_rank, world))


# ---------------------------------------------------------------------------------------------
# Communication: the entropy rides in the same SUM all-reduce


def count_collectives_rank(rank, world):
    import torch.distributed as dist

    import vparallel_ce.comm as comm

    calls = {"all_reduce": 0, "all_gather": 0, "all_reduce elements": 0}
    real = {name: getattr(comm.dist, name) for name in ("all_reduce", "all_gather")}

    def counting(name):
        def call(*args, **kwargs):
            calls[name] += 1
            if name == "all_reduce":
                calls["all_reduce elements"] += args[0].numel()
            return real[name](*args, **kwargs)

        return call

    n = 10
    logits, target = make_logits(5, tokens=(n,), vocab=11)
    hidden, weight, bias, _ = make_linear(5, tokens=(n,), vocab=11)
    runs = {
        "cross_entropy": lambda x, e: vparallel_ce.cross_entropy(x, target, group=dist.group.WORLD, chunks=3,
                                                                 reduction="none"),
        "token_logprobs": lambda x, e: vparallel_ce.token_logprobs(x, target, group=dist.group.WORLD, chunks=3,
                                                                   temperature=0.7, with_entropy=e),
        "linear_token_logprobs": lambda x, e: vparallel_ce.linear_token_logprobs(
            hidden.float().requires_grad_(), x, target, group=dist.group.WORLD, chunks=3, temperature=0.7,
            with_entropy=e),
    }
    counts = {}
    for name, with_entropy in (("cross_entropy", False), ("token_logprobs", False), ("token_logprobs", True),
                               ("linear_token_logprobs", False), ("linear_token_logprobs", True)):
        x = shard(logits if name != "linear_token_logprobs" else weight, world, rank, 0 if "linear" in name else -1)
        x = x.float().requires_grad_()
        for k in calls:
            calls[k] = 0
        for k in real:
            setattr(comm.dist, k, counting(k))
        try:
            out = runs[name](x, with_entropy)
            forward = dict(calls)
            outs = out if isinstance(out, tuple) else (out,)
            sum(o.sum() for o in outs).backward()
            backward = {k: calls[k] - forward[k] for k in calls}
        finally:
            for k in real:
                setattr(comm.dist, k, real[k])
        counts[(name, with_entropy)] = (forward, backward)
    return counts, n


def test_entropy_costs_no_extra_collective():
    for counts, n in run_ranks(count_collectives_rank, 2):
        loss_fwd, loss_bwd = counts[("cross_entropy", False)]
        for op in ("token_logprobs", "linear_token_logprobs"):
            (f0, b0), (f1, b1) = counts[(op, False)], counts[(op, True)]
            for k in ("all_reduce", "all_gather"):
                assert f1[k] == f0[k] and b1[k] == b0[k], (op, "with_entropy adds a collective", f0, f1, b0, b1)
            # one more float per token, at most, in the SUM all-reduce
            assert f1["all_reduce elements"] - f0["all_reduce elements"] <= n, (op, f0, f1)
        # the logits op: exactly the loss op's pattern, MAX + SUM per chunk, one size exchange, and
        # no collective in backward
        for with_entropy in (False, True):
            fwd, bwd = counts[("token_logprobs", with_entropy)]
            assert {k: fwd[k] for k in ("all_reduce", "all_gather")} == {"all_reduce": 2 * 3, "all_gather": 1}, fwd
            assert {k: bwd[k] for k in ("all_reduce", "all_gather")} == {"all_reduce": 0, "all_gather": 0}, bwd
        assert {k: loss_fwd[k] for k in ("all_reduce", "all_gather")} == {"all_reduce": 6, "all_gather": 1}


# ---------------------------------------------------------------------------------------------
# Bad input: a clear error, raised on EVERY rank


def _bad_calls(rank, world, group):
    logits, target = make_logits(7, tokens=(6,), vocab=13)
    x = shard(logits, world, rank).float()
    f = vparallel_ce.token_logprobs
    out_of_range, negative = target.clone(), target.clone()
    out_of_range[1], negative[2] = 13, -5
    hidden, weight, _, t2 = make_linear(8, tokens=(6,), vocab=13, bias=False)
    h, w = hidden.float(), shard(weight, world, rank, 0).float()
    g = vparallel_ce.linear_token_logprobs
    sp_h, sp_t = shard(h, world, rank, 0), shard(t2, world, rank, 0).clone()
    if rank == 1:
        sp_t[0] = 13  # only rank 1's tokens hold an out-of-range id
    return {
        "temperature 0": lambda: f(x, target, group=group, temperature=0.0),
        "negative temperature": lambda: f(x, target, group=group, temperature=-1.0, with_entropy=True),
        "nan temperature": lambda: f(x, target, group=group, temperature=float("nan")),
        "integer logits": lambda: f(x.long(), target, group=group),
        "target shape": lambda: f(x, target[:5], group=group),
        "float target": lambda: f(x, target.float(), group=group),
        "target out of range": lambda: f(x, out_of_range, group=group),
        "negative target": lambda: f(x, negative, group=group),
        "target out of range, with entropy": lambda: f(x, out_of_range, group=group, with_entropy=True),
        "chunks 0": lambda: f(x, target, group=group, chunks=0),
        "only rank 1 has temperature 0": lambda: f(x, target, group=group, temperature=0.0 if rank == 1 else 1.0),
        "only rank 1 has a bad shape": lambda: f(x, target[: 5 if rank == 1 else 6], group=group),
        "linear: temperature 0": lambda: g(h, w, t2, group=group, temperature=0.0, with_entropy=True),
        "linear: hidden size": lambda: g(h[..., :5], w, t2, group=group),
        "linear: target shape": lambda: g(h, w, t2[:5], group=group),
        "linear: integer hidden": lambda: g(h.long(), w, t2, group=group),
        "linear: target out of range": lambda: g(h, w, torch.full_like(t2, 13), group=group),
        "linear sp: out of range on rank 1 only": lambda: g(sp_h, w, sp_t, group=group, sequence_parallel=True),
        "linear sp: only rank 1 has temperature 0": lambda: g(
            sp_h, w, shard(t2, world, rank, 0), group=group, sequence_parallel=True, temperature=0.0 if rank == 1 else 1.0),
    }


EXPECTED_MESSAGES = {
    "temperature 0": "temperature",
    "negative temperature": "temperature",
    "nan temperature": "temperature",
    "integer logits": "floating-point",
    "target shape": "target shape",
    "float target": "integer class ids",
    "target out of range": "outside [0, 13)",
    "negative target": "outside [0, 13)",
    "target out of range, with entropy": "outside [0, 13)",
    "chunks 0": "chunks must be",
    "only rank 1 has temperature 0": "",
    "only rank 1 has a bad shape": "",
    "linear: temperature 0": "temperature",
    "linear: hidden size": "does not match weight's hidden size",
    "linear: target shape": "target shape",
    "linear: integer hidden": "floating-point",
    "linear: target out of range": "outside [0, 13)",
    "linear sp: out of range on rank 1 only": "outside [0, 13)",
    "linear sp: only rank 1 has temperature 0": "",
}


def bad_input_rank(rank, world):
    import torch.distributed as dist

    return errors_of(_bad_calls(rank, world, dist.group.WORLD))


@pytest.mark.parametrize("world", [2, 3])
def test_bad_input_raises_a_clear_error_on_every_rank(world):
    results = run_ranks(bad_input_rank, world, timeout=120)
    missing = [f"rank {r}: {name!r} did not raise" for r, errs in enumerate(results) for name in EXPECTED_MESSAGES
               if errs[name] is None]
    assert not missing, "\n".join(missing)
    wrong = [f"rank {r}: {name!r}: expected {exp!r} in {errs[name]!r}" for r, errs in enumerate(results)
             for name, exp in EXPECTED_MESSAGES.items() if exp not in errs[name]]
    assert not wrong, "\n".join(wrong)
    # the rank with the bad input names the problem; the others point at it
    for name in ("only rank 1 has temperature 0", "linear sp: only rank 1 has temperature 0"):
        assert "temperature" in results[1][name], results[1][name]
        assert "rank(s) 1: " in results[0][name], results[0][name]
    assert "target shape" in results[1]["only rank 1 has a bad shape"]


def test_single_process_errors_and_check_false():
    logits, target = make_logits(9, tokens=(4,), vocab=5)
    f, g = vparallel_ce.token_logprobs, vparallel_ce.linear_token_logprobs
    for bad in (0.0, -0.5, float("nan")):
        with pytest.raises(ValueError, match="temperature"):
            f(logits, target, temperature=bad)
    with pytest.raises(ValueError, match="outside"):
        f(logits, torch.tensor([0, 1, 5, 2]), with_entropy=True)
    with pytest.raises(ValueError, match="vocab_size=6"):
        f(logits, target, vocab_size=6)
    hidden, weight, bias, t2 = make_linear(9, tokens=(4,), vocab=5)
    with pytest.raises(ValueError, match="temperature"):
        g(hidden, weight, t2, bias, temperature=0.0)
    with pytest.raises(ValueError, match="does not match weight's hidden size"):
        g(hidden[..., :5], weight, t2)
    with pytest.raises(ValueError, match="outside"):
        g(hidden, weight, torch.full_like(t2, 5))
    # check=False skips the target check (documented as a speed switch) and gives the same values
    ok = torch.where(target == -100, 0, target)
    a = f(logits, ok, check=False, with_entropy=True)
    b = f(logits, ok, with_entropy=True)
    assert rel_err(a[0], b[0]) < 1e-14 and rel_err(a[1], b[1]) < 1e-14


def unchecked_rank(rank, world):
    import torch.distributed as dist

    report = Report()
    case = Case(950, 17, 1.9, torch.float64, "logprobs+entropy", 2, -100, label="check=False, vocab_size=17")
    logits, target = make_logits(950, vocab=17)
    u, v = _upstream(950, target.shape)
    ref_logp, ref_ent, ref_grad = _reference_logits(logits, target, 1.9, -100, case.mode, u, v)
    x = shard(logits, world, rank).clone().requires_grad_()
    logp, ent = vparallel_ce.token_logprobs(x, target, group=dist.group.WORLD, vocab_size=17, check=False,
                                            temperature=1.9, with_entropy=True, chunks=2)
    report.err(case, "logprobs", rel_err(logp.detach(), ref_logp), 1e-12)
    report.err(case, "entropy", rel_err(ent.detach(), ref_ent), 1e-12)
    _objective(case.mode, logp, ent, u, v).backward()
    report.err(case, "d logits", rel_err(x.grad, shard(ref_grad, world, rank), ref_grad), 1e-12)
    hidden, weight, bias, target = make_linear(951, vocab=17)
    u, v = _upstream(951, target.shape)
    ref_logp, ref_ent, dh_ref, dw_ref, db_ref = _reference_linear(hidden, weight, bias, target, 1.9, -100, case.mode, u, v)
    h = hidden.clone().requires_grad_()
    w, b = (shard(t, world, rank, 0).clone().requires_grad_() for t in (weight, bias))
    logp, ent = vparallel_ce.linear_token_logprobs(h, w, target, b, group=dist.group.WORLD, vocab_size=17, check=False,
                                                   temperature=1.9, with_entropy=True, chunks=2)
    case = case._replace(label="linear, check=False, vocab_size=17")
    report.err(case, "logprobs", rel_err(logp.detach(), ref_logp), 1e-12)
    report.err(case, "entropy", rel_err(ent.detach(), ref_ent), 1e-12)
    _objective(case.mode, logp, ent, u, v).backward()
    report.err(case, "d hidden", rel_err(h.grad, dh_ref), 1e-12)
    report.err(case, "d weight", rel_err(w.grad, shard(dw_ref, world, rank, 0), dw_ref), 1e-12)
    report.err(case, "d bias", rel_err(b.grad, shard(db_ref, world, rank, 0), db_ref), 1e-12)
    return report.result()


def test_check_false_with_vocab_size_needs_no_size_exchange():
    assert_clean(run_ranks(unchecked_rank, 3))


# ---------------------------------------------------------------------------------------------
# Memory: chunked like the loss ops


def _largest_tensors(fn):
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = {"any": 0, "fp32": 0}

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    seen["any"] = max(seen["any"], t.numel())
                    if t.dtype == torch.float32:
                        seen["fp32"] = max(seen["fp32"], t.numel())
            return out

    with Watch():
        fn()
    return seen


def test_no_full_fp32_copy_of_the_logits_when_chunked():
    n, v = 64, 40
    logits, target = make_logits(11, tokens=(n,), vocab=v)
    x = logits.bfloat16().requires_grad_()

    def run():
        logp, ent = vparallel_ce.token_logprobs(x, target, chunks=4, temperature=0.7, with_entropy=True)
        (logp.sum() + ent.sum()).backward()

    seen = _largest_tensors(run)
    assert n * v // 4 <= seen["fp32"] < n * v, seen
    assert x.grad.dtype == torch.bfloat16


def test_linear_op_never_materialises_the_local_logits():
    n, v = 64, 40
    hidden, weight, bias, target = make_linear(12, tokens=(n,), vocab=v)
    h, w, b = (t.float().requires_grad_() for t in (hidden, weight, bias))

    def run():
        logp, ent = vparallel_ce.linear_token_logprobs(h, w, target, b, chunks=4, temperature=0.7, with_entropy=True)
        (logp.sum() - 0.01 * ent.sum()).backward()

    seen = _largest_tensors(run)
    assert n * v // 4 <= seen["any"] < n * v, seen  # one chunk of logits existed, never all of them


def test_callers_logits_are_not_modified():
    logits, target = make_logits(13, vocab=29)
    x = logits.float().requires_grad_()
    before = x.detach().clone()
    logp, ent = vparallel_ce.token_logprobs(x, target, chunks=2, temperature=0.7, with_entropy=True)
    (logp.sum() + ent.sum()).backward()
    assert torch.equal(x.detach(), before)


def test_masked_vocab_entries_at_minus_inf_give_the_exact_entropy_and_finite_gradients():
    # padded vocab rows masked with -inf: their p is 0 and their entropy term 0 (never 0 * -inf)
    x = torch.randn(3, 9, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    x[:, 4:] = float("-inf")
    x.requires_grad_()
    target = torch.tensor([0, 1, 3])
    logp, ent = vparallel_ce.token_logprobs(x, target, with_entropy=True, chunks=2)
    ref = torch.distributions.Categorical(logits=x.detach())
    assert torch.allclose(ent, ref.entropy(), atol=1e-12) and torch.allclose(logp, ref.log_prob(target), atol=1e-12)
    (logp.sum() + ent.sum()).backward()
    assert torch.isfinite(x.grad).all() and (x.grad[:, 4:] == 0).all()
