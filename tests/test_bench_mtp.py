"""Smoke test of ``python -m launch.bench.mtp`` on CPU: tiny shapes, bf16, every smoke method.

Checks that the benchmark exits 0, prints its final table with a row per shape and method, writes
JSON lines, and that ours (auto, explicit token chunks, vocab blocks) agrees with the float64
reference at the bf16 level, as the plain computation does; ``lce`` (another loss over the same
rows) gets no error columns. The timings mean nothing here; the GPU run is described in docs/mtp.md.
"""

from __future__ import annotations

from tests.bench_smoke import assert_like_plain, run_smoke

SHAPES = ("smoke", "smoke_odd")


def test_bench_mtp_smoke_on_cpu(tmp_path):
    from launch.bench.mtp import SMOKE_METHODS

    rows, recs = run_smoke("launch.bench.mtp", tmp_path / "mtp.jsonl", "--repeats", "1")
    assert rows == {(s, m) for s in SHAPES for m in SMOKE_METHODS}, rows
    assert {(r["shape"], r["method"]) for r in recs} == rows
    assert all("err_loss" not in r for r in recs if r["method"].startswith("lce"))
    assert {r["plan"] for r in recs if r["method"] == "ours:3:2"} == {"tokenx2/fwd"}
    assert_like_plain([r for r in recs if not r["method"].startswith("lce")], lambda r: (r["shape"], r["depths"]))
