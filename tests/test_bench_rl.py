"""Smoke test of ``python -m launch.bench.rl`` on CPU: tiny shapes, bf16, every method.

Checks that the benchmark exits 0, prints its final table with a row per shape and method, writes
JSON lines, and that ``linear_token_logprobs``'s logp, entropy, dh and dW agree with the float64
gathered computation at the bf16 level. The timings mean nothing here; the GPU run is in docs/rl.md.
"""

from __future__ import annotations

import json
import re

from tests.bench_smoke import run_bench

METHODS = ("rl_fused", "loss_op", "gathered")
SHAPES = ("smoke", "smoke_odd")
ROW_RE = re.compile(r"^\| (smoke\S*) \| (\S+) \| ([0-9.]+) \|", re.M)


def test_bench_rl_smoke_on_cpu(tmp_path):
    out = tmp_path / "bench_rl.jsonl"
    proc = run_bench("launch.bench.rl", out, timeout=120)
    rows = {(m.group(1), m.group(2)): float(m.group(3)) for m in ROW_RE.finditer(proc.stdout)}
    assert set(rows) == {(s, m) for s in SHAPES for m in METHODS}, proc.stdout[-3000:]
    assert all(ms > 0 for ms in rows.values()), rows
    assert proc.stdout.rstrip().splitlines()[-1].startswith(f"| {SHAPES[-1]} | {METHODS[-1]} |")
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert {(r["shape"], r["method"]) for r in recs} == set(rows)
    for r in recs:
        assert "error" not in r, r
        if r["method"] == "rl_fused":
            assert "x_loss_op_time" in r and r["x_loss_op_time"] > 0, r
            # bf16 level (tests/test_logprobs.py: 2e-2, entropy gradients of the linear op 6e-2)
            assert r["err_logp"] < 2e-2 and r["err_entropy"] < 2e-2, r
            assert r["err_dh"] < 6e-2 and r["err_dw"] < 6e-2, r
