"""Smoke test of ``python -m launch.bench.rl`` on CPU: tiny shapes, bf16, every method.

Checks that the benchmark exits 0, prints its final table with a row per shape and method, writes
JSON lines, and that ``linear_token_logprobs``'s logp, entropy, dh and dW agree with the float64
gathered computation at the bf16 level. The timings mean nothing here; the GPU run is in docs/rl.md.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
METHODS = ("rl_fused", "loss_op", "gathered")
SHAPES = ("smoke", "smoke_odd")
ROW_RE = re.compile(r"^\| (smoke\S*) \| (\S+) \| ([0-9.]+) \|", re.M)


def test_bench_rl_smoke_on_cpu(tmp_path):
    env = dict(os.environ)
    env["CUDA_VISIBLE_DEVICES"] = ""
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    out = tmp_path / "bench_rl.jsonl"
    proc = subprocess.run([sys.executable, "-m", "launch.bench.rl", "--smoke", "--out", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
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
