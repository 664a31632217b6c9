"""Smoke test of ``python -m launch.bench.rollout`` on CPU: tiny shapes, every CPU method.

Checks that the benchmark exits 0, prints a row per shape and method, writes JSON lines, and that
the set op's logp and dh agree with the float64 reference (fp32 here). Timings mean nothing on CPU.
"""

from __future__ import annotations

import json

from tests.bench_smoke import run_bench


def test_bench_rollout_smoke_on_cpu(tmp_path):
    out = tmp_path / "rollout.jsonl"
    proc = run_bench("launch.bench.rollout", out, timeout=180)
    records = [json.loads(line) for line in out.read_text().splitlines()]
    got = {(r["shape"], r["method"]) for r in records}
    want = {(s, m) for s in ("smoke", "smoke-tp4") for m in ("set:4", "set:16", "full")}
    assert want <= got, f"missing rows {sorted(want - got)}"
    for r in records:
        assert "error" not in r, r
        if r["method"].startswith("set:"):
            assert r["logp_err"] < 1e-5 and r["dh_err"] < 1e-5, r
    assert "| smoke-tp4 | set:16 |" in proc.stdout
