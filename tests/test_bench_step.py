"""Smoke test of ``python -m launch.bench.step`` on CPU: the tiny model, checkpointed blocks,
gradients dropped as they complete, our loss and the plain one. The benchmark must exit 0, write one
JSON line per loss, and every loss must give the same step-1 loss value (the timings mean nothing
here; the GPU run is in docs/benchmarks.md)."""

from __future__ import annotations

import json

from tests.bench_smoke import run_bench


def test_bench_step_smoke_on_cpu(tmp_path):
    out = tmp_path / "step.jsonl"
    run_bench("launch.bench.step", out)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["loss"] for r in rows] == ["plain", "ours", "ours:token:1"], rows
    values = [r["loss_value"] for r in rows]
    assert max(values) - min(values) < 1e-3 * abs(values[0]), values  # bf16 model, same weights and tokens
    assert all(r["tps"] > 0 for r in rows), rows
