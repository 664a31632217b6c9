"""Smoke test of ``python -m launch.bench.profile`` on CPU: one tiny shape of every kind of case.

Checks that the tool exits 0, profiles each case (a record with the host time and the ops with the
most self time) and prints a table per case. Timings mean nothing on CPU.
"""

from __future__ import annotations

import json

from tests.bench_smoke import run_bench


def test_bench_profile_smoke_on_cpu(tmp_path):
    # imported where it runs, not at collection: the benchmark modules it loads set up torch.compile
    # (dynamo and Inductor), seconds in every test process that merely collects this file
    from launch.bench.profile import SMOKE_CASES

    out = tmp_path / "profile.jsonl"
    proc = run_bench("launch.bench.profile", out, timeout=180)
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["case"] for r in records] == list(SMOKE_CASES)
    for r in records:
        assert r["host_ms"] > 0 and r["top"], r
        assert any(name.startswith("aten::") for name, _, _ in r["top"]), r  # the profiler saw the ops
        assert f"== {r['case']} at 64x32x500 on cpu" in proc.stdout
