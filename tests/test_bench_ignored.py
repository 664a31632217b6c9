"""Smoke test of ``python -m launch.bench.ignored`` on CPU: one tiny shape, fp32, every op and method
at 0% and 50% ignored tokens.

Checks that the benchmark exits 0, prints a table row per op, fraction and method, writes JSON lines
with the time ratios, and that the compacted calls' loss and gradients agree with the uncompacted
ones at the fp32 level. The timings mean nothing here; the GPU run is in docs/benchmarks.md.
"""

from __future__ import annotations

import json
import re

from tests.bench_smoke import run_bench

OPS, FRACTIONS, METHODS = ("ce", "logprobs", "distill"), (0.0, 0.5), ("uncompacted", "compacted", "default")
ROW_RE = re.compile(r"^\| smoke \| (\S+) \| ([0-9.]+) \| 0 \| (\S+) \| ([0-9.]+) \|", re.M)


def test_bench_ignored_smoke_on_cpu(tmp_path):
    out = tmp_path / "bench_ignored.jsonl"
    proc = run_bench("launch.bench.ignored", out, "--shapes", "smoke", "--ignored", "0,0.5", timeout=180)
    rows = {(m.group(1), float(m.group(2)), m.group(3)): float(m.group(4)) for m in ROW_RE.finditer(proc.stdout)}
    assert set(rows) == {(o, f, m) for o in OPS for f in FRACTIONS for m in METHODS}, proc.stdout[-3000:]
    assert all(ms > 0 for ms in rows.values()), rows
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert {(r["op"], r["ignored"], r["method"]) for r in recs} == set(rows)
    for r in recs:
        assert "error" not in r, r
        assert r["x_uncompacted"] > 0 and r["x_all_valid"] > 0, r
        assert max(r["err_loss"], r["err_dh"], r["err_dw"]) < 1e-5, r
