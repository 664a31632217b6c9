"""Specification of the chunk policy: properties that hold for every input, the Llama3-8B cases,
purity, and ``chunks="auto"`` giving the same result as an explicit count."""

from __future__ import annotations

import itertools

import torch

import vparallel_ce
from vparallel_ce.policy import GiB, ChunkPolicy, choose_chunks, choose_plan, explain

LLAMA3_V = 128256
TOKENS = [1, 7, 512, 1024, 4096, 8192, 65536]
VOCABS = [32, 32000, 32777, 128256, 256000]
TPS = [1, 2, 3, 4, 8, 16]
BUDGETS = [None, 1, 4096, 64 * 2**20, GiB, 8 * GiB]


def test_range_and_monotonicity_over_a_grid():
    for n, v, budget in itertools.product(TOKENS, VOCABS, BUDGETS):
        ks = [choose_chunks(n, v, tp, budget_bytes=budget) for tp in TPS]
        assert all(1 <= k <= n for k in ks)
        assert ks == sorted(ks, reverse=True), "more TP never means more chunks"
    for v, tp, budget in itertools.product(VOCABS, TPS, BUDGETS):
        ks = [choose_chunks(n, v, tp, budget_bytes=budget) for n in TOKENS]
        assert ks == sorted(ks), "more tokens never means fewer chunks"
    for n, tp, budget in itertools.product(TOKENS, TPS, BUDGETS):
        ks = [choose_chunks(n, v, tp, budget_bytes=budget) for v in VOCABS]
        assert ks == sorted(ks), "a larger vocab never means fewer chunks"


def test_one_chunk_when_the_microbatch_fits():
    for n, v, tp in itertools.product(TOKENS, VOCABS, TPS):
        local = -(-v // tp)
        assert choose_chunks(n, v, tp, budget_bytes=n * local * 4) == 1


def test_an_explicit_budget_is_a_hard_limit_on_one_chunks_fp32_logits():
    for n, v, tp, budget in itertools.product(TOKENS, VOCABS, TPS, BUDGETS[1:]):
        local = -(-v // tp)
        k = choose_chunks(n, v, tp, budget_bytes=budget)
        largest_chunk = -(-n // k)
        if local * 4 <= budget:  # one token's row fits
            assert largest_chunk * local * 4 <= budget, (n, v, tp, budget, k)
        else:
            assert k == n


def test_llama3_8b_cases_with_the_default_budget():
    assert choose_chunks(8192, LLAMA3_V, 1) >= 2  # 4 GiB of fp32 logits at tp=1: chunk
    assert choose_chunks(1024, LLAMA3_V, 8) == 1  # 64 MiB at tp=8 with a 1024-token microbatch: don't


def test_pure_same_answer_every_call():
    args = (8192, LLAMA3_V, 2)
    assert len({choose_chunks(*args) for _ in range(5)}) == 1
    assert choose_plan(*args, hidden_size=4096) == choose_plan(*args, hidden_size=4096)


def test_linear_plan_prefers_the_vocab_schedule_when_the_fp32_accumulator_exceeds_the_budget():
    lean = choose_plan(8192, LLAMA3_V, 1, hidden_size=4096)  # 2 GiB accumulator > 1 GiB default budget
    assert lean.schedule == "vocab" and lean.chunks >= 2 and not lean.grad_in_forward
    fast = choose_plan(8192, LLAMA3_V, 8, hidden_size=4096)  # fits in one chunk: 3 matmuls
    assert fast == type(fast)("token", 1, True)
    none = choose_plan(8192, LLAMA3_V, 8, hidden_size=4096, reduction="none")
    assert not none.grad_in_forward  # per-token losses: any grad_output, so recompute


def test_gpipe_microbatches_in_flight_turn_grads_in_forward_off():
    one_f1b = ChunkPolicy(microbatches_in_flight=1)
    gpipe = ChunkPolicy(microbatches_in_flight=8)
    assert one_f1b.plan(2048, LLAMA3_V, 8, hidden_size=4096).grad_in_forward
    assert not gpipe.plan(2048, LLAMA3_V, 8, hidden_size=4096).grad_in_forward


def test_explain_says_why():
    text = explain(8192, LLAMA3_V, 1, hidden_size=4096)
    assert "chunks" in text and "budget" in text and "vocab" in text
    assert "fit" in explain(1024, LLAMA3_V, 8)


def test_auto_equals_the_explicit_count():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(300, 50, generator=g, dtype=torch.float64)
    target = torch.randint(0, 50, (300,), generator=g)
    budget = 50 * 4 * 64  # 64 tokens per chunk
    k = choose_chunks(300, 50, 1, budget_bytes=budget)
    assert k == 5
    # "auto" resolves through the same function the op calls
    import vparallel_ce.policy as policy

    old = policy.DEFAULT_POLICY
    policy.DEFAULT_POLICY = ChunkPolicy(budget_bytes=budget)
    try:
        auto = vparallel_ce.cross_entropy(logits, target, chunks="auto")
    finally:
        policy.DEFAULT_POLICY = old
    explicit = vparallel_ce.cross_entropy(logits, target, chunks=k)
    assert torch.equal(auto, explicit)
