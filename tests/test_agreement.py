"""Everything the ranks of a group must agree on is agreed in the call's first exchange.

That exchange is one all-gather of the same number of integers on every rank, whatever the op,
its options and inputs, so a rank that disagrees can neither abort the exchange (rows of different
lengths) nor leave the others waiting in a later collective: every rank raises, within seconds, an
error that names what differs and each rank's value. One case per disagreement, at TP 2 and 4
(gloo); the odd rank out is the last one.
"""

from __future__ import annotations

import time

import pytest
import torch

import vparallel_ce
from tests.dist import PG_TIMEOUT, errors_of, run_ranks
from tests.reference import shard

N, V, H = 6, 13, 4


def _inputs(rank, world):
    g = torch.Generator().manual_seed(3)
    h = torch.randn(N, H, generator=g)
    w = torch.randn(V, H, generator=g)
    t = torch.tensor([11, 2, 7, 0, 12, 5])
    return h, shard(w, world, rank, 0).clone(), t


def _disagreements(rank, world, group):
    """name -> (call, words the error must hold on every rank)."""
    odd = rank == world - 1
    h, w, t = _inputs(rank, world)
    x = torch.randn(N, w.shape[0])

    def linear(hidden=h, weight=w, target=t, **kw):
        return lambda: vparallel_ce.linear_cross_entropy(hidden, weight, target, group=group, **kw).backward()

    swapped = t.clone()
    swapped[[0, 1]] = swapped[[1, 0]]
    assert int(t[0]) != int(t[1])
    shifted = torch.roll(t, 1)
    # a 3-cycle of ids whose position-weighted sums match (0*1 + 2*2 + 1*3 = 1*1 + 0*2 + 2*3)
    base, cycled = t.clone(), t.clone()
    base[:3], cycled[:3] = torch.tensor([0, 2, 1]), torch.tensor([1, 0, 2])
    rows_swapped = h[[1, 0, 2, 3, 4, 5]]

    def autocast_on_odd():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=odd):
            linear()()

    def no_grad_on_odd():
        with torch.set_grad_enabled(not odd):
            out = vparallel_ce.linear_cross_entropy(h.clone().requires_grad_(), w.clone().requires_grad_(), t, group=group)
        if out.requires_grad:
            out.backward()

    return {
        "sequence_parallel on one rank": (
            linear(sequence_parallel=odd), ["sequence parallel", "rank 0: False", f"rank {world - 1}: True"]),
        "fp64 on one rank": (
            linear(hidden=h.double() if odd else h, weight=w.double() if odd else w),
            ["input dtype", "torch.float32", "torch.float64"]),
        "int32 target on one rank": (linear(target=t.int() if odd else t), ["target dtype", "torch.int32"]),
        "int8 target on one rank": (linear(target=t.to(torch.int8) if odd else t), ["int8", "torch.int64 or torch.int32"]),
        "uint8 target everywhere": (linear(target=t.to(torch.uint8)), ["torch.int64 or torch.int32", "uint8"]),
        "int8 target for cross_entropy": (
            lambda: vparallel_ce.cross_entropy(x, t.to(torch.int8) if odd else t, group=group), ["int8"]),
        "hidden requires grad on one rank": (
            linear(hidden=h.clone().requires_grad_(odd), weight=w.clone().requires_grad_()),
            ["grads", "requires grad: weight", "requires grad: input, weight"]),
        "no_grad on one rank": (no_grad_on_odd, ["grads", "grad mode off"]),
        "permuted targets on one rank": (linear(target=swapped if odd else t), ["target checksum", "same order"]),
        "targets shifted by one on one rank": (linear(target=shifted if odd else t), ["target checksum"]),
        "fewer tokens on one rank": (
            linear(hidden=h[:-1] if odd else h, target=t[:-1] if odd else t),
            ["token count", "rank 0: 6", f"rank {world - 1}: 5"]),
        "hidden not replicated": (linear(hidden=h + 1 if odd else h), ["hidden checksum", "replicated"]),
        "targets 3-cycled on one rank": (linear(target=cycled if odd else base), ["target checksum"]),
        "hidden rows swapped on one rank": (linear(hidden=rows_swapped if odd else h), ["hidden checksum"]),
        "entropy asked on one rank": (
            lambda: vparallel_ce.token_logprobs(x, t, group=group, with_entropy=odd),
            ["entropy", "rank 0: False", f"rank {world - 1}: True"]),
        "autocast on one rank": (autocast_on_odd, ["matmul dtype", "torch.float32", "torch.bfloat16"]),
        "ignore_index beyond int64 on one rank": (
            linear(ignore_index=2**63 if odd else -100),
            ["ignore_index must be an int64, got 9223372036854775808"]),
        "chunks beyond int64 on one rank": (
            linear(chunks=2**63 if odd else 1), ["chunks must be an int in [1, 2**31]"]),
        "vocab_size beyond int64 on one rank": (
            linear(vocab_size=2**64 if odd else V), ["vocab_size must be a positive int"]),
        "vocab_size a string on one rank": (
            linear(vocab_size="13" if odd else V), ["vocab_size must be", "'13'"]),
        "check not a bool on one rank": (
            linear(vocab_size=V, check=0 if odd else True), ["check must be True or False"]),
        "label_smoothing differs": (linear(label_smoothing=0.1 if odd else 0.0), ["label smoothing", "0.1", "0.0"]),
        "ignore_index differs": (linear(ignore_index=-1 if odd else -100), ["ignore index", "-1", "-100"]),
        "schedule differs": (linear(schedule="vocab" if odd else "token"), ["schedule", "'vocab'", "'token'"]),
        "reduction differs": (linear(reduction="sum" if odd else "mean"), ["reduction", "'sum'", "'mean'"]),
        "chunk policies differ": (
            linear(policy=vparallel_ce.ChunkPolicy(budget_bytes=1 << (20 + rank))),
            ["chunk policy", "ChunkPolicy(budget_bytes=1048576"]),
        "different ops": (
            (lambda: vparallel_ce.linear_token_logprobs(h, w, t, group=group)) if odd else linear(reduction="none"),
            ["op", "'linear_cross_entropy'", "'linear_token_logprobs'"]),
        "logits dtypes differ": (
            lambda: vparallel_ce.cross_entropy(x.double() if odd else x, t, group=group), ["input dtype"]),
    }


def disagreement_rank(rank, world):
    import torch.distributed as dist

    cases = _disagreements(rank, world, dist.group.WORLD)
    out = {}
    for name, (call, _) in cases.items():
        start = time.monotonic()
        out[name] = (errors_of({name: call})[name], time.monotonic() - start)
    # the group still works after every one of them
    h, w, t = _inputs(rank, world)
    out["after"] = float(vparallel_ce.linear_cross_entropy(h, w, t, group=dist.group.WORLD))
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_every_disagreement_raises_on_every_rank_within_seconds_and_names_each_value(world):
    expected = {name: words for name, (_, words) in _disagreements(0, world, None).items()}
    results = run_ranks(disagreement_rank, world, timeout=120)
    for rank, errors in enumerate(results):
        for name, words in expected.items():
            error, seconds = errors[name]
            assert error is not None, f"{name}: rank {rank} did not raise"
            # well under the collectives' own timeout (what a rank left waiting would take), with
            # room for a loaded machine: 8 s alone, 12 s beside a full test run on a GPU host
            assert seconds < PG_TIMEOUT.total_seconds() / 2, f"{name}: rank {rank} took {seconds:.1f}s"
            for word in words:
                assert word in error, f"{name}: rank {rank}: {word!r} not in {error!r}"
    assert len({r["after"] for r in results}) == 1


def test_a_token_count_mismatch_is_reported_as_such_not_as_a_checksum():
    # the fields are checked in their declared order: the count before the checksum of the ids
    from vparallel_ce.agreement import Facts
    import dataclasses

    names = [f.name for f in dataclasses.fields(Facts)]
    assert names.index("token_count") < names.index("target_checksum")
    assert names.index("sequence_parallel") < names.index("token_count")


def test_the_exchange_row_has_the_same_length_for_every_op_and_option():
    from vparallel_ce.options import Options
    from vparallel_ce.agreement import Facts

    t = torch.zeros(3, dtype=torch.long)
    rows = [
        Facts.of(op="cross_entropy", options=Options(), inputs=(torch.zeros(3, 4),), target=t, target_checksum=0),
        Facts.of(op="linear_cross_entropy", options=Options(
                     sequence_parallel=True, reduction="sum", chunks=3, schedule="vocab", recompute=True,
                     label_smoothing=0.1, softcap=2.0, with_entropy=True),
                 inputs=(torch.zeros(3, 2), torch.zeros(4, 2), torch.zeros(4)), target=t, target_checksum=0,
                 fused=True, matmul_dtype=torch.bfloat16),
    ]
    assert len({len(r.row()) for r in rows}) == 1


def unreplicated_unchecked_rank(rank, world):
    import torch.distributed as dist

    h, w, t = _inputs(rank, world)
    # the caller says the hidden states differ on purpose: no error, and the loss is this rank's own
    return float(vparallel_ce.linear_cross_entropy(h + rank, w, t, group=dist.group.WORLD, check_replicated=False))


def test_check_replicated_false_skips_only_the_hidden_check():
    assert len(run_ranks(unreplicated_unchecked_rank, 2, timeout=60)) == 2
