"""Smoke test of ``torchrun -m launch.bench.tp``: 2 gloo ranks on CPU, tiny shapes (``--smoke``).

Checks that the benchmark exits 0 (every correctness check of our ops within tolerance at TP=2,
bf16/fp32, sequence parallel on/off), prints its final table with a row per method, and writes JSON
lines. The timings themselves mean nothing here (2 shared cores); the multi-GPU run is documented in
docs/benchmarks.md.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
METHODS = ("ours_lce:auto", "ours_lce:token1", "ours_ce", "megatron_ce", "loss_parallel")
ROW_RE = re.compile(r"^\| 2 \| (\S+) \| (\S+) \| [^|]* \| ([0-9.]+) \| [^|]* \| ([0-9.-]+) \|", re.M)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_bench_tp_smoke_two_gloo_ranks(tmp_path):
    env = dict(os.environ)
    env["CUDA_VISIBLE_DEVICES"] = ""
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env.pop("OMP_NUM_THREADS", None)
    out = tmp_path / "bench_tp.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           "-m", "launch.bench.tp", "--smoke", "--repeats", "2", "--warmup", "1", "--timeout", "60", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert "## launch.bench.tp: world 2 (gloo)" in proc.stdout, log[-4000:]
    assert "correctness: ok, all 6 checks of ours" in proc.stdout, log[-4000:]
    rows = {m.group(1): m for m in ROW_RE.finditer(proc.stdout)}
    assert set(rows) == set(METHODS), proc.stdout[-3000:]
    assert float(rows["ours_lce:auto"].group(3)) > 0
    assert float(rows["megatron_ce"].group(4)) > 0  # local (group=None) time column filled
    # the table is the last thing printed
    assert proc.stdout.rstrip().splitlines()[-1].startswith("| 2 | loss_parallel |")
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    checks = [r for r in recs if r["kind"] == "check"]
    assert len(checks) == 10 and all(r["ok"] for r in checks), [r for r in checks if not r["ok"]]
    assert {r["method"] for r in recs if r["kind"] == "perf"} == set(METHODS)
