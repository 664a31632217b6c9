"""The minimal examples in launch/examples/ run on CPU and check themselves (each ends with OK).

tp_cross_entropy.py, grad_accumulation.py (DDP and FSDP2), distillation.py and rollout_support.py start
their two gloo processes themselves (launch/examples/_spawn.py), or run as torchrun's ranks: here
tp_cross_entropy.py starts its own, the other three run as two ranks with the environment torchrun
gives them (the examples' code is the same either way past _spawn.py); rl_logprobs.py and
hf_llama.py are one process each (hf_llama.py needs transformers: skipped without it). Each run has
a bounded wall time.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.warm import free_port, run_like_torchrun, run_python

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "launch" / "examples"
TIMEOUT = 180  # seconds per run

pytestmark = pytest.mark.slow  # separate processes each: started first (tests/conftest.py)


def _env() -> dict:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env.pop("OMP_NUM_THREADS", None)
    return env


@pytest.mark.parametrize("cmd", [
    ["tp_cross_entropy.py"],
    ["rl_logprobs.py"],
    ["torchrun's ranks", "grad_accumulation.py"],
    ["torchrun's ranks", "distillation.py"],
    ["hf_llama.py"],
    ["torchrun's ranks", "rollout_support.py"],
], ids=["tp", "rl", "grad-accumulation-torchrun", "distillation", "hf-llama", "rollout-support"])
def test_example_runs_and_checks_itself(tmp_path, cmd):
    if cmd == ["hf_llama.py"]:
        pytest.importorskip("transformers")
    # forked from a process that imported torch already (tests/warm.py): python FILE, or the two ranks of
    # torchrun --nproc-per-node 2 FILE with the environment torchrun gives them
    if cmd[0] == "torchrun's ranks":
        proc = run_like_torchrun("", EXAMPLES / cmd[1], nproc=2, env=_env(), cwd=tmp_path, logdir=tmp_path,
                                 timeout=TIMEOUT, port=free_port())
    else:
        proc = run_python("", EXAMPLES / cmd[0], *cmd[1:], env=_env(), cwd=tmp_path, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert proc.stdout.rstrip().endswith("OK"), proc.stdout[-2000:]
