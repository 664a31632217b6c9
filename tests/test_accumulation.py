"""``num_valid_tokens``: the divisor of ``reduction="mean"`` given by the caller, and
``count_valid_tokens`` at the top level -- exact gradient accumulation without a pipeline.

With ``num_valid_tokens=n`` a loss op returns ``sum_i loss_i / n`` over its valid tokens, and its
gradients are those of that value, at every TP degree, for the logits and the linear op, whatever
``n`` is (an int or an integer tensor, larger or smaller than the call's own count, 0). The
data-parallel recipe built on it (DDP and FSDP2 over 2 gloo ranks, microbatches of 12, 1, 0, 7
and 3, 12, 9, 2 valid tokens) is launch/examples/grad_accumulation.py, run by test_examples.py.
"""

from __future__ import annotations

import pytest
import torch

import vparallel_ce
from tests.dist import errors_of, run_ranks
from tests.reference import reference_loss, shard

N, V, H = 10, 13, 6
IGNORE = -100


def _case():
    g = torch.Generator().manual_seed(5)
    h = torch.randn(N, H, generator=g, dtype=torch.float64)
    w = torch.randn(V, H, generator=g, dtype=torch.float64)
    t = torch.randint(0, V, (N,), generator=g)
    t[[2, 7]] = IGNORE
    return h, w, t


def divisor_rank(rank, world):
    import torch.distributed as dist

    group = dist.group.WORLD if world > 1 else None
    h_full, w_full, t = _case()
    checked = []
    for n in (3, torch.tensor(25), torch.tensor([8], dtype=torch.int32), 0):
        want_n = int(n)
        for op in ("cross_entropy", "linear_cross_entropy"):
            for chunks in (1, 3):
                h = h_full.clone().requires_grad_()
                w = w_full.clone().requires_grad_()
                ref = reference_loss(h @ w.T, t, reduction="sum") / want_n
                ref.backward()
                mine_h = h_full.clone().requires_grad_()
                mine_w = shard(w_full, world, rank, 0).clone().requires_grad_()
                if op == "cross_entropy":
                    logits = (mine_h @ mine_w.T).detach().requires_grad_()
                    out = vparallel_ce.cross_entropy(logits, t, group=group, num_valid_tokens=n, chunks=chunks)
                    out.backward()
                    x = (h_full @ w_full.T).requires_grad_()
                    (reference_loss(x, t, reduction="sum") / want_n).backward()
                    grads = {"logits": (logits.grad, shard(x.grad, world, rank))}
                else:
                    out = vparallel_ce.linear_cross_entropy(mine_h, mine_w, t, group=group, num_valid_tokens=n,
                                                            chunks=chunks)
                    out.backward()
                    grads = {"hidden": (mine_h.grad, h.grad), "weight": (mine_w.grad, shard(w.grad, world, rank, 0))}
                case = f"{op}, num_valid_tokens={n!r}, chunks={chunks}, TP {world}"
                if want_n == 0:  # a count of 0 with valid tokens: an infinite mean, never a finite number
                    assert out.item() == float("inf"), case
                    for name, (got, _) in grads.items():
                        assert not torch.isfinite(got).all(), f"{case}: {name}"
                    if op == "cross_entropy":  # the ignored tokens' rows stay exactly 0
                        assert torch.equal(logits.grad[t == IGNORE], torch.zeros_like(logits.grad[t == IGNORE]))
                else:
                    torch.testing.assert_close(out, ref.detach(), rtol=1e-12, atol=1e-12, msg=case)
                    for name, (got, want) in grads.items():
                        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12, msg=f"{case}: {name} grad")
                checked.append(case)
    return len(checked)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_the_mean_divides_by_the_given_count_loss_and_gradients(world):
    results = [divisor_rank(0, 1)] if world == 1 else run_ranks(divisor_rank, world, timeout=120)
    assert all(n == 16 for n in results)


def test_the_sum_of_microbatch_losses_with_the_step_count_is_the_big_batch_mean():
    # gradient accumulation in one process: 4 microbatches, 12 / 1 / 0 / 7 valid tokens
    g = torch.Generator().manual_seed(1)
    h = torch.randn(4, 12, H, generator=g, dtype=torch.float64)
    w = torch.randn(V, H, generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, V, (4, 12), generator=g)
    for i, valid in enumerate((12, 1, 0, 7)):
        t[i, valid:] = IGNORE
    n = vparallel_ce.count_valid_tokens(list(t))
    assert int(n) == 20
    for i in range(4):
        vparallel_ce.linear_cross_entropy(h[i], w, t[i], num_valid_tokens=n).backward()
    accumulated = w.grad.clone()
    w.grad = None
    vparallel_ce.linear_cross_entropy(h.reshape(-1, H), w, t.reshape(-1)).backward()
    torch.testing.assert_close(accumulated, w.grad, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("value, message", [
    (torch.tensor(3.0), "num_valid_tokens must be an int >= 0, a one-element integer tensor or None"),
    (torch.tensor([1, 2]), "num_valid_tokens must be"),
    (-1, "num_valid_tokens must be"),
    (True, "num_valid_tokens must be"),
])
def test_a_bad_count_is_an_error(value, message):
    h, w, t = _case()
    with pytest.raises(ValueError, match=message):
        vparallel_ce.linear_cross_entropy(h, w, t, num_valid_tokens=value)


def test_a_count_with_another_reduction_is_an_error():
    h, w, t = _case()
    with pytest.raises(ValueError, match="num_valid_tokens is the divisor of reduction='mean', got reduction='sum'"):
        vparallel_ce.cross_entropy(h @ w.T, t, reduction="sum", num_valid_tokens=5)


def bad_counts_rank(rank, world):
    import torch.distributed as dist

    h, w, t = _case()
    w = shard(w, world, rank, 0)
    group = dist.group.WORLD
    return errors_of({
        "different ints": lambda: vparallel_ce.linear_cross_entropy(h, w, t, group=group, num_valid_tokens=5 + rank),
        "different tensors": lambda: vparallel_ce.cross_entropy(
            h @ w.T, t, group=group, num_valid_tokens=torch.tensor(7 if rank else 9)),
        "negative everywhere": lambda: vparallel_ce.linear_cross_entropy(
            h, w, t, group=group, num_valid_tokens=torch.tensor(-5)),
        "None against -1": lambda: vparallel_ce.cross_entropy(
            h @ w.T, t, group=group, num_valid_tokens=None if rank == 0 else torch.tensor(-1)),
    })


def test_ranks_that_pass_different_or_negative_counts_raise_on_every_rank():
    for errors in run_ranks(bad_counts_rank, 2, timeout=60):
        assert "num valid tokens: rank 0: 5, rank 1: 6" in errors["different ints"], errors
        assert "num valid tokens: rank 0: 9, rank 1: 7" in errors["different tensors"], errors
        assert "num_valid_tokens must be >= 0, got -5" in errors["negative everywhere"], errors
        assert "num valid tokens: rank 0: None, rank 1: -1" in errors["None against -1"], errors


def test_the_module_wrappers_take_the_count_per_call():
    h, w, t = _case()
    want = vparallel_ce.linear_cross_entropy(h, w, t, num_valid_tokens=4)
    assert torch.equal(vparallel_ce.build_loss_fn("fused")(h, w, t, num_valid_tokens=4), want)
    assert torch.equal(vparallel_ce.build_loss_fn("chunked")(h @ w.T, t, num_valid_tokens=4),
                       vparallel_ce.cross_entropy(h @ w.T, t, num_valid_tokens=4))
    torch.testing.assert_close(vparallel_ce.build_loss_fn("naive")(h @ w.T, t, num_valid_tokens=4), want)


def test_a_negative_tensor_count_without_an_exchange_is_nan_never_a_number():
    """With ``check=False`` (and in the reference module) nothing reads the count: the loss is nan.
    With the check (the default) it raises at world 1 as on a group (tests/test_trust.py)."""
    h, w, t = _case()
    for fn in (lambda n: vparallel_ce.linear_cross_entropy(h, w, t, num_valid_tokens=n, check=False),
               lambda n: vparallel_ce.cross_entropy(h @ w.T, t, num_valid_tokens=n, check=False),
               lambda n: vparallel_ce.build_loss_fn("naive")(h @ w.T, t, num_valid_tokens=n)):
        assert torch.isnan(fn(torch.tensor(-5))).item()
    with pytest.raises(vparallel_ce.InvalidInputError, match="num_valid_tokens must be >= 0, got -5"):
        vparallel_ce.cross_entropy(h @ w.T, t, num_valid_tokens=torch.tensor(-5))


def test_the_reference_module_checks_the_count_as_the_ops_do():
    h, w, t = _case()
    naive = vparallel_ce.build_loss_fn("naive", reduction="sum")
    with pytest.raises(ValueError, match="num_valid_tokens is the divisor of reduction='mean'"):
        naive(h @ w.T, t, num_valid_tokens=5)
    with pytest.raises(ValueError, match="num_valid_tokens must be"):
        vparallel_ce.build_loss_fn("naive")(h @ w.T, t, num_valid_tokens=2.5)


@pytest.mark.parametrize("labels", [torch.tensor([True, False]), torch.tensor([1.0, 2.0]), torch.tensor([1j])])
def test_count_valid_tokens_takes_integer_labels_only(labels):
    with pytest.raises(TypeError, match="labels must be integer tensors"):
        vparallel_ce.count_valid_tokens(labels)


@pytest.mark.parametrize("count", [7, torch.tensor(7), torch.tensor(7.0).int()])
def test_the_loss_keeps_its_dtype_with_a_count(count):
    h, w, t = (x.float() if x.is_floating_point() else x for x in _case())
    assert vparallel_ce.linear_cross_entropy(h, w, t, num_valid_tokens=count).dtype == torch.float32
    assert vparallel_ce.cross_entropy(h @ w.T, t, num_valid_tokens=count).dtype == torch.float32
