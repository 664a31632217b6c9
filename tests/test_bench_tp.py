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
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.warm import kill, start_python

ROOT = Path(__file__).resolve().parents[1]
METHODS = ("ours_lce:auto", "ours_lce:token1", "ours_ce", "megatron_ce", "loss_parallel")
ROW_RE = re.compile(r"^\| 2 \| (\S+) \| (\S+) \| [^|]* \| ([0-9.]+) \| [^|]* \| ([0-9.-]+) \|", re.M)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_ranks(tmp_path, module: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """``torchrun --nproc_per_node 2 -m module *args``: its two ranks, with the environment torchrun
    gives them, forked from a process that imported torch already (tests/warm.py); rank 0's output."""
    env = dict(os.environ)
    env["CUDA_VISIBLE_DEVICES"] = ""
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    port = str(free_port())
    logs = [(tmp_path / f"rank{r}.out", tmp_path / f"rank{r}.err") for r in range(2)]
    procs = [start_python("-m", module, *args, cwd=ROOT, out=out, err=err,
                          env={**env, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
                               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "OMP_NUM_THREADS": "1"})
             for r, (out, err) in enumerate(logs)]
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.exitcode is None:
            kill(p)
    text = [(out.read_text() if out.exists() else "", err.read_text() if err.exists() else "") for out, err in logs]
    failed = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode != 0]
    assert not failed, f"ranks (rank, exit code) {failed}:\n" + "\n".join(o[-2000:] + e[-3000:] for o, e in text)
    return subprocess.CompletedProcess([module, *args], 0, text[0][0], text[0][1])


@pytest.mark.slow
def test_bench_tp_smoke_two_gloo_ranks(tmp_path):
    out = tmp_path / "bench_tp.jsonl"
    proc = _two_ranks(tmp_path, "launch.bench.tp", "--smoke", "--repeats", "2", "--warmup", "1", "--timeout", "60",
                      "--out", str(out))
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
