"""Run a benchmark module's ``--smoke`` mode on CPU in a new process (test helper; tests/warm.py)."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

from tests.warm import run_python

ROOT = Path(__file__).resolve().parents[1]
ROW_RE = re.compile(r"^\| (smoke\S*) \| (\S+) \| ([0-9.]+) \|", re.M)


def run_bench(module: str, out: Path, *args: str, timeout: float = 240,
              interpreted: bool = False) -> subprocess.CompletedProcess:
    """``python -m module --smoke --out out *args`` with no GPU visible and this checkout
    importable; asserts exit 0 and returns the finished process. ``interpreted``: with
    ``TRITON_INTERPRET=1`` in its environment (a module whose smoke run takes the Triton kernels:
    the setting must be there before the process imports triton, not set by the module)."""
    env = dict(os.environ)
    if interpreted:
        env["TRITON_INTERPRET"] = "1"
    env["CUDA_VISIBLE_DEVICES"] = ""
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    proc = run_python("-m", module, "--smoke", "--out", str(out), *args, env=env, cwd=ROOT, timeout=timeout)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc


def run_smoke(module: str, out: Path, *args: str, timeout: float = 240) -> tuple[set, list[dict]]:
    """:func:`run_bench`, then the ``(shape, method)`` rows of its final table that hold a time, and
    the JSON records written."""
    proc = run_bench(module, out, *args, timeout=timeout)
    rows = {(m.group(1), m.group(2)) for m in ROW_RE.finditer(proc.stdout)}
    return rows, [json.loads(line) for line in out.read_text().splitlines()]


def assert_like_plain(recs: list[dict], key) -> None:
    """Every record measured without error, and at the bf16 level: each error within 2x that of
    the ``plain`` method of the same ``key(record)`` (and never far off)."""
    plain = {key(r): r for r in recs if r["method"].startswith("plain")}
    for r in recs:
        assert "error" not in r, r
        base = plain[key(r)]
        for err in ("err_loss", "err_dh", "err_dw"):
            assert r[err] < max(2 * base[err], 1e-3) and r[err] < 3e-2, (err, r, base)
