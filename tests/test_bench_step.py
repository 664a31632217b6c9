"""Smoke test of ``python -m launch.bench.step`` on CPU: the tiny model, checkpointed blocks,
gradients dropped as they complete, our loss and the plain one. The benchmark must exit 0, write one
JSON line per loss, and every loss must give the same step-1 loss value (the timings mean nothing
here; the GPU run is in docs/benchmarks.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_step_smoke_on_cpu(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    out = tmp_path / "step.jsonl"
    proc = subprocess.run([sys.executable, "-m", "launch.bench.step", "--smoke", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=240, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["loss"] for r in rows] == ["plain", "ours", "ours:token:1"], rows
    values = [r["loss_value"] for r in rows]
    assert max(values) - min(values) < 1e-3 * abs(values[0]), values  # bf16 model, same weights and tokens
    assert all(r["tps"] > 0 for r in rows), rows
