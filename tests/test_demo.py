"""End-to-end checks of launch/train_demo.py through torchrun (CPU, gloo).

Every run trains the tiny model for a few steps on short sequences, prints
``step: N  loss: X`` lines, and the tests compare those curves:

* the loss kinds agree (naive reference vs the library's fused op),
* the layouts agree (DP2 vs DP2 x TP2 x PP2, with and without sequence parallel),
* a run resumed from a checkpoint (by hand, or by torchrun after a worker died)
  continues the uninterrupted curve,
* two "nodes" on loopback meet through the c10d rendezvous and agree too,
* bad command lines give one error message and a non-zero exit.

launch/ is not a package: the demo runs as a script, nothing is imported from it.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "launch" / "train_demo.py"
MULTINODE = ROOT / "launch" / "multinode.sh"
STEPS = 4
# Short, deterministic runs; 6 decimals so 1e-4 relative is far above print rounding.
COMMON = ["--model", "tiny", "--steps", str(STEPS), "--seq-len", "32", "--batch-size", "8",
          "--deterministic", "--log-digits", "6", "--timeout", "60"]
RUN_TIMEOUT = 240  # seconds per torchrun; a hang fails the test instead of the CI job
STEP_RE = re.compile(r"^step: (\d+)  loss: ([-+0-9.eEnaif]+)  memory: ", re.M)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    env = dict(os.environ)
    # The demo imports vparallel_ce; make the checkout importable even if not installed.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env.pop("OMP_NUM_THREADS", None)  # torchrun sets 1 per worker
    return env


def torchrun_cmd(nproc: int, *launcher_args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), *launcher_args]


def run(cmd: list[str], cwd: Path, timeout: float = RUN_TIMEOUT) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def train(tmp_path: Path, nproc: int, *args: str, launcher: tuple[str, ...] = ()) -> dict[int, float]:
    """Run the demo under torchrun and return {step: loss}; a later line for the same step
    (after a restart) replaces the earlier one."""
    if not launcher:
        launcher = ("--master-port", str(free_port()))
    proc = run(torchrun_cmd(nproc, *launcher, str(DEMO), *COMMON, *args), cwd=tmp_path)
    assert proc.returncode == 0, f"demo failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return parse_losses(proc.stdout)


def parse_losses(stdout: str) -> dict[int, float]:
    return {int(step): float(loss) for step, loss in STEP_RE.findall(stdout)}


def assert_same_curve(got: dict[int, float], want: dict[int, float], rel: float = 1e-4) -> None:
    assert sorted(got) == sorted(want) == list(range(1, STEPS + 1)), (got, want)
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=rel), f"step {step}: {got} vs {want}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, float]:
    """DP2, naive loss (full logits + F.cross_entropy): the curve everything must match."""
    curve = train(tmp_path_factory.mktemp("ref"), 2, "--dp", "2", "--loss", "naive")
    # it learns, and the numbers are sane
    assert all(0 < v < 10 for v in curve.values()), curve
    return curve


def test_fused_loss_matches_naive(tmp_path, reference):
    assert_same_curve(train(tmp_path, 2, "--dp", "2", "--loss", "fused"), reference)


@pytest.mark.parametrize("extra", [["--loss", "naive"], ["--loss", "fused", "--sp"]], ids=["naive", "fused-sp"])
def test_dp2_tp2_pp2_matches_dp2(tmp_path, reference, extra):
    curve = train(tmp_path, 8, "--dp", "2", "--tp", "2", "--pp", "2", *extra)
    assert_same_curve(curve, reference)


def test_resume_matches_uninterrupted(tmp_path, reference):
    ckpt = tmp_path / "ckpt"
    first = train(tmp_path, 2, "--dp", "2", "--loss", "chunked", "--checkpoint-dir", str(ckpt),
                  "--steps", "2")
    assert sorted(first) == [1, 2]
    assert (ckpt / "step-00000002" / ".metadata").exists()
    rest = train(tmp_path, 2, "--dp", "2", "--loss", "chunked", "--checkpoint-dir", str(ckpt), "--resume")
    assert sorted(rest) == list(range(3, STEPS + 1)), rest
    assert_same_curve({**first, **rest}, reference)


def test_worker_failure_restarts_from_checkpoint(tmp_path, reference):
    """torchrun --max-restarts: the last rank dies at step 3; the group restarts and --resume
    picks up the step-2 checkpoint (DP2 x PP2: FSDP and pipeline state in the checkpoint)."""
    launcher = ("--max-restarts", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
                "--rdzv-id", "restart-test")
    curve = train(tmp_path, 4, "--dp", "2", "--pp", "2", "--tp", "1", "--loss", "fused",
                  "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "2", "--resume",
                  "--fail-at-step", "3", launcher=launcher)
    assert_same_curve(curve, reference)


def test_two_nodes_on_loopback(tmp_path, reference):
    """2 "nodes" x 2 processes, each started by launch/multinode.sh, meet through the c10d
    rendezvous on 127.0.0.1 and train one DP2 x TP2 job."""
    env = {**_env(), "NNODES": "2", "NPROC_PER_NODE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "RDZV_ID": "loopback-test", "PYTHON": sys.executable}
    cmd = ["bash", str(MULTINODE), *COMMON, "--dp", "2", "--tp", "2", "--loss", "fused"]
    nodes = [subprocess.Popen(cmd, cwd=tmp_path, env=env, text=True, stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
    outs = []
    try:
        for node in nodes:
            outs.append(node.communicate(timeout=RUN_TIMEOUT))
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
                node.wait()
    for node, (out, err) in zip(nodes, outs, strict=True):
        assert node.returncode == 0, f"node failed:\n{out[-3000:]}\n{err[-6000:]}"
    printed = [curve for curve in (parse_losses(out) for out, _ in outs) if curve]
    assert len(printed) == 1, "exactly one node (the one holding global rank 0) prints the curve"
    assert_same_curve(printed[0], reference)


@pytest.mark.parametrize(
    "nproc, args, message",
    [
        (2, ["--tp", "1", "--pp", "2", "--dp", "2"], "tp*pp*dp"),
        (3, ["--tp", "3"], "not divisible by --tp 3"),
        (2, ["--pp", "2", "--tp", "1", "--n-layers", "1"], "1 layers, fewer than --pp 2"),
        (2, ["--data", "no/such/file.bin"], "no such file"),
        (2, ["--loss", "bogus"], "invalid choice"),
    ],
    ids=["world-mismatch", "kv-heads", "layers-lt-pp", "missing-data", "bad-choice"],
)
def test_bad_flags_one_message(tmp_path, nproc, args, message):
    proc = run(torchrun_cmd(nproc, "--master-port", str(free_port()), str(DEMO), *args), cwd=tmp_path,
               timeout=120)
    assert proc.returncode != 0
    output = proc.stdout + proc.stderr
    errors = [line for line in output.splitlines() if line.startswith("train_demo.py: error:")]
    assert len(errors) == 1, output
    assert message in errors[0], errors[0]
    # no per-rank tracebacks, nothing was trained
    assert "train_demo.py\", line" not in output, output
    assert not STEP_RE.search(output)
