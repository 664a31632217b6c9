"""Inputs that used to give a plausible wrong number, or an unclear error, give a clear one.

* the full (unsharded) logits or lm_head weight passed on every rank of a group: refused on every
  rank, naming each rank's shard (the loss would be off by ``ln W``);
* a ``TopKTeacher`` recorded at one temperature and used at another: refused, naming both;
* a negative tensor ``num_valid_tokens``: refused at world 1 as on a group;
* ids beyond the classes say what usually causes them (hidden states for logits, a forgotten
  ``group=``); a process outside its group is told so;
* ``check=False`` with a layout only one rank can see is wrong: no rank waits forever;
* ``batch_invariant=True`` with ``sequence_parallel=True`` computes the float64 reference.

The group cases run at TP 2 (gloo), all in one spawned group.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import vparallel_ce
from tests.dist import errors_of, run_ranks
from tests.reference import reference_distillation, reference_loss, shard

N, V, H = 6, 12, 4  # V even: at TP 2 both shards have 6 entries, as the full tensor on each rank would
UNSHARDED = "is the full, unsharded"


def _full(seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, H, generator=g, dtype=torch.float64)
    w = torch.randn(V, H, generator=g, dtype=torch.float64)
    t = torch.tensor([11, 2, 7, 0, 5, 9])
    return h, w, t


def _unsharded_calls(rank, world, group):
    """name -> call of each op with the full tensor on every rank of ``group``."""
    h, w, t = _full()
    x = h @ w.T
    y = x.flip(-1)
    topk = vparallel_ce.TopKTeacher.from_logits(y, 3)
    return {
        "cross_entropy": lambda: vparallel_ce.cross_entropy(x, t, group=group),
        "linear_cross_entropy": lambda: vparallel_ce.linear_cross_entropy(h, w, t, group=group),
        "token_logprobs": lambda: vparallel_ce.token_logprobs(x, t, group=group),
        "linear_token_logprobs": lambda: vparallel_ce.linear_token_logprobs(h, w, t, group=group),
        "distillation_loss": lambda: vparallel_ce.distillation_loss(x, y, t, group=group, hard_weight=0.5),
        "distillation_loss top-k": lambda: vparallel_ce.distillation_loss(x, topk, t, group=group),
        "linear_distillation_loss": lambda: vparallel_ce.linear_distillation_loss(h, w, h, w.flip(0), t, group=group),
    }


def _group_cases(rank, world):
    import torch.distributed as dist

    group = dist.group.WORLD
    out = {}
    # 1. the full tensor on every rank: every op refuses it on every rank
    out["unsharded"] = errors_of(_unsharded_calls(rank, world, group))
    # ... while the shards of the same tensors compute the float64 reference, loss and gradients
    h, w, t = _full()
    x = (h @ w.T).requires_grad_()
    xs = shard(x.detach(), world, rank).clone().requires_grad_()
    loss = vparallel_ce.cross_entropy(xs, t, group=group)
    loss.backward()
    ref = reference_loss(x, t)
    ref.backward()
    out["sharded"] = (float(loss), float(ref), float((xs.grad - shard(x.grad, world, rank)).abs().max()))
    ws = shard(w, world, rank, 0).clone().requires_grad_()
    lin = vparallel_ce.linear_cross_entropy(h, ws, t, group=group)
    lin.backward()
    wf = w.clone().requires_grad_()
    ref_lin = reference_loss(h @ wf.T, t)
    ref_lin.backward()
    out["sharded linear"] = (float(lin), float(ref_lin), float((ws.grad - shard(wf.grad, world, rank, 0)).abs().max()))
    # shards that really are identical (constant logits) go through where a target lies beyond the
    # first shard (the full tensor's targets never do), or once vocab_size says so
    const = torch.zeros(N, V // world, dtype=torch.float64)
    low = t % (V // world)
    out["identical"] = [float(vparallel_ce.cross_entropy(const, t, group=group)),
                        float(vparallel_ce.cross_entropy(const, low, group=group, vocab_size=V))]
    out["identical, first shard's ids"] = errors_of({"": lambda: vparallel_ce.cross_entropy(const, low, group=group)})

    # 2. a top-k record of temperature 2 used at temperature 1
    record = vparallel_ce.TopKTeacher.from_logits(x.detach().flip(-1), 4, temperature=2.0)
    ss = shard(x.detach(), world, rank)
    out["temperature"] = errors_of({
        "distillation_loss": lambda: vparallel_ce.distillation_loss(ss, record, t, group=group),
        "linear_distillation_loss": lambda: vparallel_ce.linear_distillation_loss(
            h, shard(w, world, rank, 0), record, target=t, group=group),
    })

    # 3. a negative tensor count on a group (as at world 1, test_negative_tensor_count_raises_at_world_1)
    out["count"] = errors_of({"negative": lambda: vparallel_ce.cross_entropy(
        ss, t, group=group, num_valid_tokens=torch.tensor(-2))})

    # 5. ids beyond the classes: a shard without its group, hidden states for logits; a process
    # outside the group
    solo = dist.new_group([0])
    out["hints"] = errors_of({
        "forgot group": lambda: vparallel_ce.cross_entropy(ss, torch.full((N,), V - 1), reduction="sum"),
        "hidden states": lambda: vparallel_ce.cross_entropy(h, t, group=group),
        "outside the group": lambda: vparallel_ce.cross_entropy(ss, t, group=solo, vocab_size=V // world)
        if rank != 0 else None,
    })

    # 6. check=False with a vocab_size that only the last rank's shard contradicts (V=11: shards
    # of 6 and 5; vocab_size=12 gives the last rank 6): no rank raises alone, none waits
    odd = shard(torch.randn(N, 11, dtype=torch.float64), world, rank)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        errors = errors_of({"check=False": lambda: vparallel_ce.cross_entropy(
            odd, t.clamp(max=10), group=group, vocab_size=12, check=False)})
    out["unchecked layout"] = (errors["check=False"], [str(m.message) for m in seen])

    # 7. batch_invariant with sequence_parallel: each rank its own tokens, the float64 reference
    hs = shard(h, world, rank, 0).clone().requires_grad_()
    sp = vparallel_ce.linear_cross_entropy(hs, shard(w, world, rank, 0), shard(t, world, rank, 0), group=group,
                                           sequence_parallel=True, batch_invariant=True)
    sp.backward()
    hf = h.clone().requires_grad_()
    ref_sp = reference_loss(hf @ w.T, t)
    ref_sp.backward()
    grad_err = float((hs.grad - shard(hf.grad, world, rank, 0)).abs().max())
    out["batch_invariant sp"] = (float(sp), float(ref_sp), grad_err)
    return out


@pytest.fixture(scope="module")
def group_results():
    return run_ranks(_group_cases, 2, timeout=150)


def test_the_full_tensor_on_every_rank_is_refused_by_every_op_on_every_rank(group_results):
    for rank, res in enumerate(group_results):
        for op, error in res["unsharded"].items():
            assert error is not None and error.startswith("InvalidInputError"), f"{op}: rank {rank}: {error}"
            assert UNSHARDED in error and "rank 0: 0x" in error and "rank 1: 0x" in error, f"{op}: {error}"
            assert "ln 2" in error, f"{op}: {error}"
        assert "student_logits" in res["unsharded"]["distillation_loss"]
        assert "student_weight" in res["unsharded"]["linear_distillation_loss"]


def test_true_shards_still_compute_the_float64_reference(group_results):
    for res in group_results:
        for case in ("sharded", "sharded linear"):
            got, ref, grad_err = res[case]
            assert got == pytest.approx(ref, rel=1e-12, abs=1e-12), case
            assert grad_err < 1e-12, case
        assert res["identical"] == pytest.approx([math.log(V)] * 2, rel=1e-12)
        assert UNSHARDED in (res["identical, first shard's ids"][""] or "")


def test_a_top_k_record_used_at_another_temperature_is_refused_on_every_rank(group_results):
    for rank, res in enumerate(group_results):
        for op, error in res["temperature"].items():
            assert error is not None and error.startswith("InvalidInputError"), f"{op}: rank {rank}: {error}"
            assert "temperature=2.0" in error and "temperature=1.0" in error, f"{op}: {error}"


def test_a_negative_tensor_count_is_refused_on_every_rank(group_results):
    for res in group_results:
        assert "num_valid_tokens must be >= 0, got -2" in (res["count"]["negative"] or "")


def test_ids_beyond_the_classes_say_what_usually_puts_them_there(group_results):
    for rank, res in enumerate(group_results):
        hints = res["hints"]
        assert "did you forget group=?" in (hints["forgot group"] or ""), hints["forgot group"]
        assert "hidden states" in (hints["hidden states"] or ""), hints["hidden states"]
        assert "linear_cross_entropy" in hints["hidden states"]
        if rank:
            assert "not a member of the group" in (hints["outside the group"] or ""), hints["outside the group"]


def test_check_false_with_a_layout_one_rank_sees_wrong_never_leaves_a_rank_waiting(group_results):
    for rank, res in enumerate(group_results):
        error, warned = res["unchecked layout"]
        assert error is None, f"rank {rank}: {error}"
        assert any("holds 5 vocab rows" in m for m in warned) == (rank == 1), warned


def test_batch_invariant_with_sequence_parallel_computes_the_float64_reference(group_results):
    for res in group_results:
        got, ref, grad_err = res["batch_invariant sp"]
        assert got == pytest.approx(ref, rel=1e-12)
        assert grad_err < 1e-12


# ---------------------------------------------------------------------------------------------
# World 1


def test_negative_tensor_count_raises_at_world_1():
    x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    t = torch.tensor([1, 2, 3, 4])
    h, w = torch.randn(4, 3, dtype=torch.float64, requires_grad=True), torch.randn(8, 3, dtype=torch.float64)
    calls = {
        "forward only": lambda: vparallel_ce.cross_entropy(x.detach(), t, num_valid_tokens=torch.tensor(-3)),
        "with a backward": lambda: vparallel_ce.cross_entropy(x, t, num_valid_tokens=torch.tensor(-3)).backward(),
        "linear": lambda: vparallel_ce.linear_cross_entropy(h, w, t, num_valid_tokens=torch.tensor(-3)).backward(),
        "token_logprobs sum": lambda: vparallel_ce.distillation_loss(x, x.detach(), num_valid_tokens=torch.tensor(-1)),
    }
    for name, call in calls.items():
        with pytest.raises(vparallel_ce.InvalidInputError, match="num_valid_tokens must be >= 0"):
            call()
    # (hidden states for logits, at world 1: the ids beyond their last dim say so)
    with pytest.raises(vparallel_ce.InvalidInputError, match="hidden states.*linear_cross_entropy"):
        vparallel_ce.cross_entropy(h.detach(), t * 2)
    # a count that is fine is the divisor, in float64
    got = vparallel_ce.cross_entropy(x.detach(), t, num_valid_tokens=torch.tensor(3))
    assert float(got) == pytest.approx(float(reference_loss(x.detach(), t, reduction="sum")) / 3, rel=1e-12)


def test_a_top_k_record_carries_its_temperature_and_refuses_another():
    g = torch.Generator().manual_seed(1)
    s = torch.randn(5, 10, generator=g, dtype=torch.float64, requires_grad=True)
    teacher = torch.randn(5, 10, generator=g, dtype=torch.float64)
    target = torch.tensor([1, 0, 9, 4, 4])
    record = vparallel_ce.TopKTeacher.from_logits(teacher, 10, temperature=2.0)
    assert record.temperature == 2.0
    with pytest.raises(vparallel_ce.InvalidInputError, match=r"recorded at temperature=2\.0.*temperature=1\.0"):
        vparallel_ce.distillation_loss(s, record, target)
    # at its own temperature, with every id, it is the dense loss (float64)
    got = vparallel_ce.distillation_loss(s, record, target, temperature=2.0)
    ref = reference_distillation(s, teacher, target, kind="forward_kl", temperature=2.0)
    assert got.item() == pytest.approx(ref.item(), rel=1e-12)
    # a record without a temperature is not checked (documented)
    bare = vparallel_ce.TopKTeacher(record.ids, record.logprobs)
    vparallel_ce.distillation_loss(s, bare, target)


def test_doc_snippets_run_as_a_registered_module():
    """A snippet that calls torch.compile runs in a module dynamo can look up by name."""
    import sys

    from tests import test_docs

    ns = test_docs._namespace()
    assert sys.modules[ns["__name__"]].__dict__ is ns


def test_a_refused_call_under_fullgraph_compile_raises_eagers_error():
    """dynamo would wrap an error raised while it traces (``Unsupported: Observed exception``, or a
    fake-tensor ``TorchRuntimeError``): the compiled call raises eager's, type and message."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, 8, generator=g, requires_grad=True)
    t = torch.tensor([1, 7, 0, 3])
    h, w = torch.randn(4, 3, generator=g, requires_grad=True), torch.randn(8, 3, generator=g)
    record = vparallel_ce.TopKTeacher.from_logits(torch.randn(4, 8, generator=g), 3, temperature=2.0)
    cases = {
        "temperature 0": lambda x, t: vparallel_ce.token_logprobs(x, t, temperature=0.0),
        "label_smoothing 2": lambda x, t: vparallel_ce.cross_entropy(x, t, label_smoothing=2.0),
        "label_smoothing 2, per token": lambda x, t: vparallel_ce.cross_entropy(x, t, label_smoothing=2.0,
                                                                                reduction="none"),
        "jsd beta 1": lambda x, t: vparallel_ce.distillation_loss(x, x.detach(), t, kind="jsd", beta=1.0),
        "negative int count": lambda x, t: vparallel_ce.cross_entropy(x, t, num_valid_tokens=-1),
        "negative tensor count": lambda x, t: vparallel_ce.cross_entropy(x, t, num_valid_tokens=torch.tensor(-1)),
        "float target": lambda x, t: vparallel_ce.cross_entropy(x, t.float()),
        "float target, linear": lambda x, t: vparallel_ce.linear_cross_entropy(h, w, t.float()),
        "top-k record of another temperature": lambda x, t: vparallel_ce.distillation_loss(x, record, t),
    }
    for name, fn in cases.items():
        with pytest.raises((ValueError, TypeError)) as eager:
            fn(x, t)
        torch._dynamo.reset()
        with pytest.raises((ValueError, TypeError)) as got:
            torch.compile(fn, fullgraph=True, backend="aot_eager")(x, t)
        assert type(got.value) is type(eager.value), f"{name}: {type(got.value).__name__}: {got.value}"
        assert str(got.value) == str(eager.value), name
    # a record at its own temperature compiles and gives the eager loss
    torch._dynamo.reset()
    fn = lambda x, t: vparallel_ce.distillation_loss(x, record, t, temperature=2.0)  # noqa: E731
    assert torch.equal(torch.compile(fn, fullgraph=True, backend="aot_eager")(x, t), fn(x, t))
