"""Smoke test of ``python -m launch.bench.mtp`` on CPU: tiny shapes, bf16, every smoke method.

Checks that the benchmark exits 0, prints its final table with a row per shape and method, writes
JSON lines, and that ours agrees with the float64 reference at the bf16 level, as the plain
computation does. The timings mean nothing here; the GPU run is described in docs/mtp.md.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPES = ("smoke", "smoke_odd")
ROW_RE = re.compile(r"^\| (smoke\S*) \| (\S+) \| ([0-9.]+) \|", re.M)


def test_bench_mtp_smoke_on_cpu(tmp_path):
    from launch.bench.mtp import SMOKE_METHODS

    env = dict(os.environ)
    env["CUDA_VISIBLE_DEVICES"] = ""
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    out = tmp_path / "mtp.jsonl"
    proc = subprocess.run([sys.executable, "-m", "launch.bench.mtp", "--smoke", "--repeats", "1", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=240, stdin=subprocess.DEVNULL)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    rows = {(m.group(1), m.group(2)) for m in ROW_RE.finditer(proc.stdout)}
    assert rows == {(s, m) for s in SHAPES for m in SMOKE_METHODS}, proc.stdout[-3000:]
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert {(r["shape"], r["method"]) for r in recs} == rows
    plain = {(r["shape"], r["depths"]): r for r in recs if r["method"].startswith("plain")}
    for r in recs:
        assert "error" not in r, r
        base = plain[(r["shape"], r["depths"])]
        # bf16 level: within 2x the plain bf16-logits computation's own error (and never far off)
        for err in ("err_loss", "err_dh", "err_dw"):
            assert r[err] < max(2 * base[err], 1e-3) and r[err] < 3e-2, (err, r, base)
