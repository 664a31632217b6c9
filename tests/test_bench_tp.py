"""Smoke test of ``torchrun --nproc_per_node 2 -m launch.bench.tp``: its 2 gloo ranks on CPU, tiny shapes
(``--smoke``).

Checks that the benchmark exits 0 (every correctness check of our ops within tolerance at TP=2,
bf16/fp32, sequence parallel on/off), prints its final table with a row per method, and writes JSON
lines. The timings themselves mean nothing here (2 shared cores); the multi-GPU run is documented in
docs/benchmarks.md.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from tests.warm import free_port, run_like_torchrun

ROOT = Path(__file__).resolve().parents[1]
METHODS = ("ours_lce:auto", "ours_lce:token1", "ours_ce", "megatron_ce", "loss_parallel")
ROW_RE = re.compile(r"^\| 2 \| (\S+) \| (\S+) \| [^|]* \| ([0-9.]+) \| [^|]* \| ([0-9.-]+) \|", re.M)


@pytest.mark.slow
def test_bench_tp_smoke_two_gloo_ranks(tmp_path):
    out = tmp_path / "bench_tp.jsonl"
    env = dict(os.environ)
    env["CUDA_VISIBLE_DEVICES"] = ""
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env.pop("OMP_NUM_THREADS", None)
    # torchrun's two ranks, forked from a process that imported torch already (tests/warm.py)
    proc = run_like_torchrun("-m", "launch.bench.tp", "--smoke", "--repeats", "1", "--warmup", "0", "--timeout", "60",
                             "--out", str(out), nproc=2, env=env, cwd=ROOT, logdir=tmp_path, timeout=120,
                             port=free_port())
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
