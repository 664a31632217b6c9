"""Liger-Kernel's own test cases for its fused-linear JSD and KL losses, run against ours.

The grids -- shapes (odd ones included), dtypes, bias, temperature, the hard/soft weights, beta,
``ignore_index`` values that are real class ids, reductions, a teacher given as probabilities, all
tokens ignored, autocast -- are Liger-Kernel's (``test/chunked_loss/test_jsd_loss.py`` and
``test/transformers/test_fused_linear_kl_div.py``). Each case is written here as our API expresses
Liger's loss, and checked against a float64 reference of Liger's definition written out below
(loss and every student gradient):

* ``LigerFusedLinearJSDLoss``: ``w_hard * CE(s) + w_soft * JSD_beta(softmax(t / T), softmax(s / T))``,
  both means over the valid tokens, the JSD unscaled by ``T**2`` with ``m = beta p + (1 - beta) q``
  (its kernel's mixture). Ours: ``T**2 JSD + hard_weight CE``, so the case is
  ``w_soft / T**2 * ours(hard_weight = w_hard T**2 / w_soft)``, or ``w_hard *
  linear_cross_entropy`` where ``w_soft = 0``.
* ``LigerFusedLinearKLDivLoss``: ``KL(P || softmax(s / T))`` against given probabilities ``P``;
  ``"batchmean"`` over the valid tokens, ``"sum"``, and ``"mean"`` (over tokens x vocab). Ours: a
  sparse teacher with every id, ``TopKTeacher(arange(V), log P)`` (``k = V``), divided by ``T**2``
  (and by ``V`` for its ``"mean"``).

Where ours deliberately differs the test says so: a ``"mean"`` over no valid token is NaN (as
``F.cross_entropy``'s), where Liger returns 0.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import vparallel_ce
from tests.reference import rel_err

# ------------------------------------------------------------------- Liger's definitions, in float64


def liger_jsd_reference(h, w, b, th, tw, tb, target, *, temperature, w_hard, w_soft, beta, ignore_index):
    s = F.linear(h, w, b)
    with torch.no_grad():
        t = F.linear(th, tw, tb)
    lq, lp = F.log_softmax(s / temperature, -1), F.log_softmax(t / temperature, -1)
    lm = torch.logaddexp(lp + torch.log(torch.tensor(beta, dtype=s.dtype)),
                         lq + torch.log(torch.tensor(1 - beta, dtype=s.dtype)))
    jsd = beta * (lp.exp() * (lp - lm)).sum(-1) + (1 - beta) * (lq.exp() * (lq - lm)).sum(-1)
    valid = target != ignore_index
    n = valid.sum().clamp_min(1)
    soft = torch.where(valid, jsd, 0.0).sum() / n
    hard = F.cross_entropy(s, target, ignore_index=ignore_index, reduction="sum") / n
    return w_hard * hard + w_soft * soft


def liger_kl_reference(h, w, probs, labels, *, temperature, reduction, ignore_index):
    lq = F.log_softmax(F.linear(h, w) / temperature, -1)
    per = (probs * (probs.clamp_min(1e-10).log() - lq)).sum(-1)
    valid = torch.ones_like(per, dtype=torch.bool) if labels is None else labels != ignore_index
    total = torch.where(valid, per, 0.0).sum()
    if reduction == "sum":
        return total
    n = valid.sum()
    return total / n if reduction == "batchmean" else total / (n * w.shape[0])


# ------------------------------------------------------------------------------- the JSD cases

JSD_SHAPES = [(3, 47, 31, 123), (2, 2, 8, 8), (9, 7, 41, 41)]  # (B, T, H, V); the student has H // 2
# (temperature, weight_hard_loss, weight_soft_loss, beta, ignore_index)
JSD_PARAMS = [(1.0, 0.5, 0.5, 0.5, -100), (2.0, 0.0, 1.0, 0.8, -100), (0.5, 1.0, 0.0, 0.2, -100),
              (2.0, 0.1, 0.9, 0.5, 42)]


def _jsd_case(shape, dtype, bias, seed=0):
    b_, t_, h_, v = shape
    g = torch.Generator().manual_seed(seed)
    rand = lambda *size: torch.rand(*size, generator=g, dtype=torch.float64)  # noqa: E731 -- Liger's inputs
    n = b_ * t_
    h, w, th, tw = rand(n, h_ // 2), rand(v, h_ // 2), rand(n, h_), rand(v, h_)
    b, tb = (rand(v), rand(v)) if bias else (None, None)
    target = torch.randint(0, v, (n,), generator=g)
    return [None if x is None else x.to(dtype) for x in (h, w, b, th, tw, tb)], target


def ours_jsd(h, w, b, th, tw, tb, target, *, temperature, w_hard, w_soft, beta, ignore_index):
    if w_soft == 0:
        return w_hard * vparallel_ce.linear_cross_entropy(h, w, target, bias=b, ignore_index=ignore_index)
    loss = vparallel_ce.linear_distillation_loss(
        h, w, th, tw, target, student_bias=b, teacher_bias=tb, kind="jsd", beta=beta, temperature=temperature,
        hard_weight=w_hard * temperature**2 / w_soft, ignore_index=ignore_index)
    return w_soft / temperature**2 * loss


def _loss_and_grads(fn, inputs, target, **kw):
    h, w, b, th, tw, tb = (None if x is None else x.detach().clone() for x in inputs)
    for x in (h, w, b):
        if x is not None:
            x.requires_grad_()
    loss = fn(h, w, b, th, tw, tb, target, **kw)
    loss.backward()
    return [loss.detach()] + [x.grad for x in (h, w, b) if x is not None]


@pytest.mark.parametrize("shape", JSD_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("params", JSD_PARAMS, ids=lambda p: "T{}_hard{}_soft{}_beta{}_ignore{}".format(*p))
def test_liger_jsd_cases_in_fp32(shape, bias, params):
    temperature, w_hard, w_soft, beta, ignore_index = params
    kw = dict(temperature=temperature, w_hard=w_hard, w_soft=w_soft, beta=beta, ignore_index=ignore_index)
    inputs, target = _jsd_case(shape, torch.float64, bias)
    ref = _loss_and_grads(liger_jsd_reference, inputs, target, **kw)
    got = _loss_and_grads(ours_jsd, [None if x is None else x.float() for x in inputs], target, **kw)
    errs = [rel_err(g, r) for g, r in zip(got, ref)]
    # Liger's uniform [0, 1) inputs give logits of one sign and up to ~H / 8 in size: fp32 GEMM rounding
    assert max(errs) < 5e-5, f"loss, dh, dW(, db) errors {errs}"


@pytest.mark.parametrize("shape", JSD_SHAPES[:1] + [(1, 64, 64, 300)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("params", JSD_PARAMS[:2] + JSD_PARAMS[3:], ids=lambda p: "T{}_hard{}_soft{}_beta{}".format(*p))
def test_liger_jsd_cases_in_bf16_are_within_the_plain_bf16_paths_error(shape, params):
    temperature, w_hard, w_soft, beta, ignore_index = params
    kw = dict(temperature=temperature, w_hard=w_hard, w_soft=w_soft, beta=beta, ignore_index=ignore_index)
    inputs, target = _jsd_case(shape, torch.float64, bias=True)
    bf16 = [x.bfloat16() for x in inputs]
    ref = _loss_and_grads(liger_jsd_reference, [x.double() for x in bf16], target, **kw)
    got = _loss_and_grads(ours_jsd, bf16, target, **kw)
    plain = _loss_and_grads(liger_jsd_reference, bf16, target, **kw)  # Liger's definition in bf16
    for what, g, p, r in zip(("loss", "dh", "dW", "db"), got, plain, ref):
        assert rel_err(g, r) <= 2 * rel_err(p, r) + 1e-3, (what, rel_err(g, r), rel_err(p, r))


def test_a_liger_jsd_case_at_its_large_shape():
    # (B, T, H, V) = (8, 128, 1024, 4096), its first parameter row, fp32 (one case: the suite's budget)
    kw = dict(temperature=1.0, w_hard=0.5, w_soft=0.5, beta=0.5, ignore_index=-100)
    inputs, target = _jsd_case((8, 128, 1024, 4096), torch.float64, bias=False)
    ref = _loss_and_grads(liger_jsd_reference, inputs, target, **kw)
    got = _loss_and_grads(ours_jsd, [None if x is None else x.float() for x in inputs], target, **kw)
    errs = [rel_err(g, r) for g, r in zip(got, ref)]
    assert max(errs) < 5e-5, f"loss, dh, dW errors {errs}"


# -------------------------------------------------------------------------------- the KL cases

KL_SHAPES = [(4, 423, 167, 1423), (2, 2, 8, 8), (9, 7, 41, 41)]
# (temperature, reduction, ignore_index, some tokens ignored)
KL_PARAMS = [(1.0, "batchmean", 2, True), (2.0, "sum", 42, True), (1.0, "mean", -100, True),
             (1.0, "batchmean", -100, False), (2.0, "sum", -100, False)]


def _kl_case(shape, ignore_index, some_ignored, seed=1):
    b_, t_, h_, v = shape
    n = b_ * t_
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, h_, generator=g, dtype=torch.float64)
    w = torch.rand(v, h_, generator=g, dtype=torch.float64)
    probs = torch.rand(n, v, generator=g, dtype=torch.float64).softmax(-1)
    labels = None
    if some_ignored:
        labels = torch.randint(0, v, (n,), generator=g)
        ignored = torch.randperm(n, generator=g)[: int(torch.randint(1, max(2, n // 2), (1,), generator=g))]
        labels[ignored] = ignore_index
    return h, w, probs, labels


def ours_kl(h, w, probs, labels, *, temperature, reduction, ignore_index):
    n, v = probs.shape
    teacher = vparallel_ce.TopKTeacher(torch.arange(v).expand(n, v), probs.log())  # every id: k = V
    loss = vparallel_ce.linear_distillation_loss(
        h, w, teacher, target=labels, kind="forward_kl", temperature=temperature, ignore_index=ignore_index,
        reduction="sum" if reduction == "sum" else "mean")
    return loss / temperature**2 / (v if reduction == "mean" else 1)


def _kl_loss_and_grads(fn, h, w, probs, labels, **kw):
    h, w = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    loss = fn(h, w, probs, labels, **kw)
    loss.backward()
    return loss.detach(), h.grad, w.grad


@pytest.mark.parametrize("shape", KL_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("params", KL_PARAMS, ids=lambda p: "T{}_{}_ignore{}_{}".format(*p[:3], "some" if p[3] else "none"))
def test_liger_kl_cases_against_probabilities_in_fp32(shape, params):
    temperature, reduction, ignore_index, some_ignored = params
    kw = dict(temperature=temperature, reduction=reduction, ignore_index=ignore_index)
    h, w, probs, labels = _kl_case(shape, ignore_index, some_ignored)
    ref = _kl_loss_and_grads(liger_kl_reference, h, w, probs, labels, **kw)
    got = _kl_loss_and_grads(ours_kl, h.float(), w.float(), probs.float(), labels, **kw)
    errs = [rel_err(g, r) for g, r in zip(got, ref)]
    assert max(errs) < 5e-5, f"loss, dh, dW errors {errs}"


@pytest.mark.parametrize("reduction", ["sum", "batchmean"])
def test_liger_kl_case_with_every_token_ignored(reduction):
    h, w, probs, labels = _kl_case((9, 7, 41, 41), 42, some_ignored=True)
    labels[:] = 42
    loss, dh, dw = _kl_loss_and_grads(ours_kl, h.float(), w.float(), probs.float(), labels, temperature=2.0,
                                      reduction=reduction, ignore_index=42)
    # every gradient 0, as Liger's; the sum 0 too, but a mean over no token is NaN here (as
    # F.cross_entropy's "mean"), where Liger returns 0
    assert torch.equal(dh, torch.zeros_like(dh)) and torch.equal(dw, torch.zeros_like(dw))
    assert loss.item() == 0.0 if reduction == "sum" else loss.isnan()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_liger_kl_case_under_autocast_is_within_the_plain_paths_error(dtype):
    # Liger's AMP case: fp32 parameters under torch.autocast; (B, T, H, V) = (2, 4, 2048, 3200)
    h, w, probs, _ = _kl_case((2, 4, 2048, 3200), -100, some_ignored=False)
    kw = dict(temperature=1.0, reduction="batchmean", ignore_index=-100)
    ref = _kl_loss_and_grads(liger_kl_reference, h, w, probs, None, **kw)
    with torch.autocast("cpu", dtype=dtype):
        got = _kl_loss_and_grads(ours_kl, h.float(), w.float(), probs.float(), None, **kw)
    with torch.autocast("cpu", dtype=dtype):  # the plain path: Liger's definition under the same autocast
        plain = _kl_loss_and_grads(liger_kl_reference, h.float(), w.float(), probs.float(), None, **kw)
    assert got[1].dtype == got[2].dtype == torch.float32  # gradients in the parameters' dtype
    for what, g, p, r in zip(("loss", "dh", "dW"), got, plain, ref):
        assert rel_err(g, r) <= 2 * rel_err(p, r) + 1e-3, (what, rel_err(g, r), rel_err(p, r))
