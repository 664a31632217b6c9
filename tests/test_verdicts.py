"""Specification of the world-1 front door's memory (:mod:`vparallel_ce.verdicts`): a call with
the metadata of an earlier passing call skips the checks that call passed -- and nothing else. Every
call still checks its own target ids and reads its own ``num_valid_tokens``; whatever the checks
read that differs from the remembered call (a dtype, a shape, a device, an option's type, the
teacher, the autocast state, the kernel settings) is checked again."""

from __future__ import annotations

import pytest
import torch

import vparallel_ce
from tests.reference import reference_loss
from vparallel_ce import kernels
from vparallel_ce.call import linear_call
from vparallel_ce.options import Options
from vparallel_ce.verdicts import VERDICTS, Verdicts, tensor_metadata

N, H, HT, V = 12, 6, 10, 17


@pytest.fixture(autouse=True)
def fresh():
    VERDICTS.forget()
    yield
    VERDICTS.forget()


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]


def case(seed=0, dtype=torch.float64, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, H, generator=g, dtype=dtype)
    w = torch.randn(V, H, generator=g, dtype=dtype)
    th = torch.randn(N, HT, generator=g, dtype=dtype)
    tw = torch.randn(V, HT, generator=g, dtype=dtype)
    t = torch.randint(0, V, (N,), generator=g)
    t[3] = -100
    return tuple(x.to(device) for x in (h, w, th, tw, t))


def distill(h, w, th, tw, t, **kw):
    return vparallel_ce.linear_distillation_loss(h, w, th, tw, t, **kw)


def ce(h, w, t, **kw):
    return vparallel_ce.linear_cross_entropy(h, w, t, **kw)


def test_a_repeated_call_is_remembered_and_gives_the_same_loss_and_gradients():
    h, w, th, tw, t = case()
    results = []
    for _ in range(2):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        loss = distill(hh, ww, th, tw, t, hard_weight=0.5, chunks=2)
        loss.backward()
        results.append((loss.detach(), hh.grad, ww.grad))
    assert len(VERDICTS._known) == 1
    for first, again in zip(*results):
        assert torch.equal(first, again)


OPS = {
    "linear_cross_entropy": lambda h, w, th, tw, t: ce(h, w, t),
    "linear_distillation_loss": distill,
    "cross_entropy": lambda h, w, th, tw, t: vparallel_ce.cross_entropy(h @ w.T, t),
    "distillation_loss": lambda h, w, th, tw, t: vparallel_ce.distillation_loss(h @ w.T, th @ tw.T, t),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("bad_id", [V, -2])
def test_every_call_checks_its_own_target_ids(op, bad_id, device):
    h, w, th, tw, t = case(dtype=torch.float32, device=device)
    OPS[op](h, w, th, tw, t)
    t_bad = t.clone()
    t_bad[5] = bad_id
    with pytest.raises(vparallel_ce.InvalidInputError, match="target"):
        OPS[op](h, w, th, tw, t_bad)
    # and where a backward follows, the forward's loss is nan and the backward raises
    hh = h.clone().requires_grad_()
    with pytest.raises(vparallel_ce.InvalidInputError, match="target"):
        loss = OPS[op](hh, w, th, tw, t_bad)
        assert loss.isnan()
        loss.backward()
    assert len(VERDICTS._known) == 1


@pytest.mark.parametrize("device", DEVICES)
def test_every_call_divides_by_its_own_num_valid_tokens_tensor(device):
    h, w, th, tw, t = case(device=device)
    for op in (lambda n: ce(h, w, t, num_valid_tokens=n), lambda n: distill(h, w, th, tw, t, num_valid_tokens=n)):
        four, eight = op(torch.tensor(4, device=device)), op(torch.tensor(8, device=device))
        assert torch.allclose(four, 2 * eight, rtol=1e-12)
        assert torch.allclose(op(torch.tensor(4, device=device)), four, rtol=1e-12)


# each a change to one thing the front door reads, after a passing call: it must raise
CHANGES = {
    "target dtype": lambda h, w, th, tw, t: ce(h, w, t.double()),
    "hidden width": lambda h, w, th, tw, t: ce(h[:, :-1], w, t),
    "weight dtype": lambda h, w, th, tw, t: ce(h, w.float(), t),
    "hidden device": lambda h, w, th, tw, t: ce(h.to("meta"), w, t),
    "option type": lambda h, w, th, tw, t: ce(h, w, t, chunks=True),
    "option value": lambda h, w, th, tw, t: ce(h, w, t, chunks=0),
    "vocab size": lambda h, w, th, tw, t: ce(h, w, t, vocab_size=V + 1),
    "teacher vocab rows": lambda h, w, th, tw, t: distill(h, w, th, tw[:-1], t),
    "teacher dtype": lambda h, w, th, tw, t: distill(h, w, th.float(), tw.float(), t),
    "teacher tokens": lambda h, w, th, tw, t: distill(h, w, th[:-1], tw, t),
    "teacher device": lambda h, w, th, tw, t: distill(h, w, th.to("meta"), tw, t),
    "hard term without target": lambda h, w, th, tw, t: distill(h, w, th, tw, None, hard_weight=0.5),
    "top-k tail mode": lambda h, w, th, tw, t: distill(h, w, _topk(th @ tw.T, tail="nope"), None, t),
    "top-k ids dtype": lambda h, w, th, tw, t: distill(h, w, _topk(th @ tw.T, ids_dtype=torch.float64), None, t),
    "top-k with a teacher weight": lambda h, w, th, tw, t: distill(h, w, _topk(th @ tw.T), tw, t),
    "logits dtype": lambda h, w, th, tw, t: vparallel_ce.cross_entropy((h @ w.T).to(torch.int64), t),
    "logits target shape": lambda h, w, th, tw, t: vparallel_ce.cross_entropy(h @ w.T, t[:-1]),
    "logits option type": lambda h, w, th, tw, t: vparallel_ce.cross_entropy(h @ w.T, t, chunks=True),
    "logits teacher shape": lambda h, w, th, tw, t: vparallel_ce.distillation_loss(h @ w.T, (th @ tw.T)[:, :-1], t),
    "logits teacher device": lambda h, w, th, tw, t: vparallel_ce.distillation_loss(h @ w.T, (th @ tw.T).to("meta"),
                                                                                    t),
    "logits hard term without target": lambda h, w, th, tw, t: vparallel_ce.distillation_loss(
        h @ w.T, th @ tw.T, None, hard_weight=0.5),
    "logits top-k tail mode": lambda h, w, th, tw, t: vparallel_ce.distillation_loss(
        h @ w.T, _topk(th @ tw.T, tail="nope"), t),
    "logits top-k ids dtype": lambda h, w, th, tw, t: vparallel_ce.distillation_loss(
        h @ w.T, _topk(th @ tw.T, ids_dtype=torch.float64), t),
}


def _topk(logits, *, tail="bucket", ids_dtype=torch.int64):
    logprobs, ids = torch.log_softmax(logits, -1).topk(4, -1)
    return vparallel_ce.TopKTeacher(ids.to(ids_dtype), logprobs, tail=tail)


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_change_to_what_the_checks_read_is_checked_again(change):
    h, w, th, tw, t = case()
    # the passing calls each change is a variant of, remembered first
    x, teacher = h @ w.T, th @ tw.T
    for _ in range(2):
        ce(h, w, t)
        ce(h, w, t, chunks=1)
        distill(h, w, th, tw, t, hard_weight=0.5)
        distill(h, w, _topk(teacher), None, t)
        vparallel_ce.cross_entropy(x, t)
        vparallel_ce.cross_entropy(x, t, chunks=1)
        vparallel_ce.distillation_loss(x, teacher, t, hard_weight=0.5)
        vparallel_ce.distillation_loss(x, _topk(teacher), t)
    # the front door's own message (a later step may refuse the input too, less clearly)
    with pytest.raises((TypeError, ValueError), match="tail must be one of" if "tail" in change else None):
        CHANGES[change](h, w, th, tw, t)


def test_mixed_dtypes_pass_inside_autocast_and_raise_outside_after_it():
    h, w, _, _, t = case(dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ce(h.bfloat16(), w, t)
        ce(h.bfloat16(), w, t)
    with pytest.raises(TypeError, match="dtypes differ"):
        ce(h.bfloat16(), w, t)


def test_a_call_takes_the_kernel_settings_current_at_it():
    h, w, _, _, t = case()
    first, _ = linear_call(h, w, t, None, op="linear_cross_entropy", group=None, options=Options())
    with kernels.use("torch", fused=False):
        inside, _ = linear_call(h, w, t, None, op="linear_cross_entropy", group=None, options=Options())
    after, _ = linear_call(h, w, t, None, op="linear_cross_entropy", group=None, options=Options())
    assert inside.kernels == kernels.KernelSettings(choice="torch", fused=False) != first.kernels
    assert after.kernels == first.kernels == kernels.settings()


def test_a_tensor_option_other_than_the_count_is_checked_on_every_call():
    # its value is what the check reads, and it can change in place between calls
    h, w, _, _, t = case()
    smoothing = torch.tensor(0.1, dtype=torch.float64)
    ce(h, w, t, label_smoothing=smoothing)
    smoothing.fill_(2.0)
    with pytest.raises(ValueError, match="label_smoothing must be in"):
        ce(h, w, t, label_smoothing=smoothing)
    assert not VERDICTS._known


def test_a_call_plans_with_the_default_policy_current_at_it(monkeypatch):
    h, w, _, _, t = case()
    x = h @ w.T

    def plans():
        return (linear_call(h, w, t, None, op="linear_cross_entropy", group=None, options=Options())[0].plan,
                vparallel_ce.call.logits_call(x, t, op="cross_entropy", group=None, options=Options())[0].plan)

    before = plans()
    small = vparallel_ce.policy.ChunkPolicy(budget_bytes=4 * V * 4, min_chunk_tokens=1)
    monkeypatch.setattr(vparallel_ce.policy, "DEFAULT_POLICY", small)
    after = plans()
    assert [p.chunks for p in before] == [1, 1] and [p.chunks for p in after] == [3, 3], (before, after)


def test_each_call_gets_its_own_pending_check_and_divisor():
    h, w, _, _, t = case()
    calls = [linear_call(h, w, t, None, op="linear_cross_entropy", group=None, options=Options(num_valid_tokens=n))[0]
             for n in (3, 5)]
    assert calls[0].pending is not calls[1].pending
    assert [c.divisor.item() for c in calls] == [3, 5]
    vparallel_ce.cross_entropy(h @ w.T, t, num_valid_tokens=3)
    for remembered in VERDICTS._known.values():  # they hold no tensor of a call
        assert remembered.pending is None and remembered.divisor is None


def test_what_is_never_remembered():
    h, w, _, _, t = case()
    sub = h.as_subclass(_Sub)
    assert tensor_metadata(sub, w) is None  # a DTensor or fake tensor unwraps or traces differently
    assert tensor_metadata(h, None) == ((torch.Tensor, h.shape, h.dtype, h.device), None)
    assert Verdicts.key("cross_entropy", Options(policy=_UnhashablePolicy()), (h, t)) is not None
    assert VERDICTS.get(Verdicts.key("cross_entropy", Options(policy=_UnhashablePolicy()), (h, t))) is None
    with pytest.raises(ValueError):  # a call the front door refused is not remembered
        ce(h, w, t, chunks=0)
    assert not VERDICTS._known


def test_the_memory_is_bounded():
    memo = Verdicts(capacity=3)
    for i in range(7):
        memo.remember(("key", i), i)
        assert len(memo._known) <= 3
    assert memo.get(("key", 6)) == 6


class _Sub(torch.Tensor):
    pass


class _UnhashablePolicy(vparallel_ce.policy.ChunkPolicy):
    __hash__ = None


def test_a_remembered_call_matches_the_float64_reference():
    h, w, _, _, t = case()
    ref = reference_loss(h @ w.T, t)
    for _ in range(3):
        assert torch.allclose(ce(h, w, t), ref, rtol=1e-12)
