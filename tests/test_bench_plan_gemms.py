"""Smoke test of ``python -m launch.bench.plan_gemms`` on CPU (Triton interpreter, a tiny shape):
the tool exits 0 and times every part of the plan, and ``plan`` is the sum of its four GEMM
parts. Timings mean nothing on CPU."""

from __future__ import annotations

import json

import pytest

from tests.bench_smoke import run_bench

pytest.importorskip("triton")


def test_bench_plan_gemms_smoke_on_cpu(tmp_path):
    from launch.bench.plan_gemms import PARTS

    out = tmp_path / "plan_gemms.jsonl"
    proc = run_bench("launch.bench.plan_gemms", out, timeout=180, interpreted=True)
    rows = {r["part"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert tuple(rows) == PARTS
    assert all(r["ms"] > 0 and r["shape"] == "64x32x500" and r["blocks"] == 2 for r in rows.values()), rows
    four = sum(rows[k]["ms"] for k in ("stats", "recompute_grad", "dh", "dw"))
    assert rows["plan"]["ms"] == pytest.approx(four)
    assert "| plan |" in proc.stdout
