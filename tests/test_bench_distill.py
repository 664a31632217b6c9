"""Smoke test of ``python -m launch.bench.distill`` on CPU: tiny shapes, bf16, every smoke method.

Checks that the benchmark exits 0, prints its final table with a row per shape and method, writes
JSON lines, and that ours agrees with the float64 reference at the bf16 level, as the plain
computation does. The timings mean nothing here; the GPU run is in docs/distillation.md.
"""

from __future__ import annotations

from tests.bench_smoke import assert_like_plain, run_smoke

SHAPES = ("smoke", "smoke_odd")


def test_bench_distill_smoke_on_cpu(tmp_path):
    from launch.bench.distill import SMOKE_METHODS

    rows, recs = run_smoke("launch.bench.distill", tmp_path / "distill.jsonl")
    assert rows == {(s, m) for s in SHAPES for m in SMOKE_METHODS}, rows
    assert {(r["shape"], r["method"]) for r in recs} == rows
    assert_like_plain(recs, lambda r: (r["shape"], r["method"].split(":")[1]))
