"""End-to-end checks of launch/train_demo.py (CPU, gloo), through torchrun but for the one-process reference.

Every run trains the tiny model for a few steps on short sequences, prints ``step: N  loss: X``
lines and ends with its own verdict: step 1 of the parallel run against the same model and batch in
one process with plain ``F.cross_entropy`` (loss and gradient norm), ``OK`` or ``MISMATCH``. The
tests check that verdict and compare the curves:

* the README's command (DP2 x TP2 x PP2, the fused loss) and the chunked loss with sequence parallel
  (TP2 x PP2) give OK and the curve of one process with the naive loss (full logits +
  ``F.cross_entropy``),
* two "nodes" on loopback (launch/cluster/multinode.sh, one process each) meet through the c10d
  rendezvous, train one TP2 job across them and agree,
* a layout that does not fit the world size exits non-zero with its message.

The demo runs as a script (as the README runs it); nothing is imported from it.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.warm import free_port, run_like_torchrun, run_python

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "launch" / "train_demo.py"
MULTINODE = ROOT / "launch" / "cluster" / "multinode.sh"
STEPS = 2  # step 1 (the demo's own check) and step 2, after one optimizer update: the curve
COMMON = ["--steps", str(STEPS), "--seq-len", "32", "--batch-size", "8"]  # short runs
RUN_TIMEOUT = 240  # seconds per torchrun; a hang fails the test instead of the CI job
STEP_RE = re.compile(r"^step: (\d+)  loss: ([-+0-9.eEnaif]+)", re.M)
CHECK_RE = re.compile(r"^check, step 1 against one process .* \(rel ([0-9.e+-]+)\), grad norm .* \(rel ([0-9.e+-]+)\)",
                      re.M)


def _env() -> dict:
    env = dict(os.environ)
    # The demo imports vparallel_ce; make the checkout importable even if not installed.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env.pop("OMP_NUM_THREADS", None)  # torchrun sets 1 per worker
    return env


def _cpu_env() -> dict:
    return {**_env(), "CUDA_VISIBLE_DEVICES": ""}  # gloo on CPU in float32, whatever the machine has


def torchrun_cmd(nproc: int, *launcher_args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), *launcher_args]


def run(cmd: list[str], cwd: Path, timeout: float = RUN_TIMEOUT, **env: str) -> subprocess.CompletedProcess:
    """``cmd`` in the CPU environment, with ``env`` added to it; ``python FILE ...`` and ``python -m
    MODULE ...`` (torchrun's agent, which starts its ranks as new interpreters) in a process forked
    from one that imported torch already (tests/warm.py), as a new interpreter runs them."""
    env = {**_cpu_env(), **env}
    if cmd[0] == sys.executable and cmd[1].endswith(".py"):
        return run_python("", cmd[1], *cmd[2:], env=env, cwd=cwd, timeout=timeout)
    if cmd[0] == sys.executable and cmd[1] == "-m":
        return run_python("-m", cmd[2], *cmd[3:], env=env, cwd=cwd, timeout=timeout)
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def parse_losses(stdout: str) -> dict[int, float]:
    return {int(step): float(loss) for step, loss in STEP_RE.findall(stdout)}


def assert_ok(stdout: str) -> None:
    """The demo's verdict: step 1 within 1e-4 of the one-process reference (float32 on CPU)."""
    assert stdout.rstrip().splitlines()[-1] == "OK", stdout[-3000:]
    errors = CHECK_RE.search(stdout)
    assert errors, stdout[-3000:]
    assert float(errors.group(1)) < 1e-4 and float(errors.group(2)) < 1e-4, errors.group(0)


def train(tmp_path: Path, nproc: int, *args: str, agent: bool = True) -> dict[int, float]:
    """Run the demo under torchrun, check its verdict and return {step: loss}; ``agent=False``: its
    ranks with the environment torchrun gives them, without the agent, forked from a process that
    imported torch already (tests/warm.py)."""
    if agent:
        proc = run(torchrun_cmd(nproc, "--master-port", str(free_port()), str(DEMO), *COMMON, *args), cwd=tmp_path)
    else:
        proc = run_like_torchrun("", DEMO, *COMMON, *args, nproc=nproc, env=_cpu_env(), cwd=tmp_path, logdir=tmp_path,
                                 timeout=RUN_TIMEOUT, port=free_port())
    return checked_curve(proc)


def checked_curve(proc: subprocess.CompletedProcess) -> dict[int, float]:
    """A finished demo run's {step: loss}, once it exited 0 with its verdict OK and no throughput
    lines (none on CPU)."""
    assert proc.returncode == 0, f"demo failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    assert_ok(proc.stdout)
    assert "tflops" not in proc.stdout and "mfu" not in proc.stdout
    return parse_losses(proc.stdout)


def assert_same_curve(got: dict[int, float], want: dict[int, float], rel: float = 1e-4) -> None:
    assert sorted(got) == sorted(want) == list(range(1, STEPS + 1)), (got, want)
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=rel), f"step {step}: {got} vs {want}"


@pytest.fixture(scope="session")
def reference(tmp_path_factory) -> dict[int, float]:
    """One process (plain ``python``: a group of one), naive loss (full logits + F.cross_entropy): the
    curve every layout must match. Run once per test session: under pytest-xdist the first worker to
    need it runs it and the others read its curve (a file in the run's shared temporary directory,
    under a lock)."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return _reference_curve(tmp_path_factory.mktemp("ref"))
    shared = tmp_path_factory.getbasetemp().parent  # this run's directory, above every worker's own
    with open(shared / "demo_reference.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        saved = shared / "demo_reference.json"
        if not saved.exists():
            saved.write_text(json.dumps(_reference_curve(tmp_path_factory.mktemp("ref"))))
        return {int(step): loss for step, loss in json.loads(saved.read_text()).items()}


def _reference_curve(tmp: Path) -> dict[int, float]:
    curve = checked_curve(run([sys.executable, str(DEMO), *COMMON, "--dp", "1", "--loss", "naive"], cwd=tmp,
                              MASTER_PORT=str(free_port())))
    assert all(0 < v < 10 for v in curve.values()), curve
    return curve


@pytest.mark.parametrize("nproc, extra, agent", [
    (8, [], True), (4, ["--dp", "1", "--tp", "2", "--pp", "2", "--loss", "chunked", "--sp"], False),
], ids=["readme-dp2-tp2-pp2-fused", "tp2-pp2-chunked-sp"])
def test_parallel_layouts_match_one_process(tmp_path, reference, nproc, extra, agent):
    """8 ranks with no layout flags, through torchrun as the README runs them: the README's DP2 x
    TP2 x PP2 with the fused loss; the chunked loss with sequence parallelism on TP2 x PP2 (4 ranks
    as torchrun starts them, without its agent: DP is covered by the README's layout and the two
    nodes)."""
    assert_same_curve(train(tmp_path, nproc, *extra, agent=agent), reference)


def test_two_nodes_on_loopback(tmp_path, reference):
    """2 "nodes" of one process each, started by launch/cluster/multinode.sh, meet through the c10d
    rendezvous on 127.0.0.1 and train one job whose TP group spans the nodes (TP2: the fused loss's
    collectives cross them; DP across processes is the README layout's)."""
    # one thread per rank, as torchrun gives the ranks of a node of several (here each node has one
    # and both share the machine's cores)
    env = {**_cpu_env(), "OMP_NUM_THREADS": "1", "NNODES": "2", "NPROC_PER_NODE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "RDZV_ID": "loopback-test", "PYTHON": sys.executable}
    cmd = ["bash", str(MULTINODE), *COMMON, "--dp", "1", "--tp", "2", "--loss", "fused"]
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
    printed = [out for out, _ in outs if parse_losses(out)]
    assert len(printed) == 1, "exactly one node (the one holding global rank 0) prints the curve"
    assert_ok(printed[0])
    assert_same_curve(parse_losses(printed[0]), reference)


def test_layout_that_does_not_fit_the_world_fails(tmp_path):
    """The layout is checked before the process group exists: one process given torchrun's
    environment for a world of 2 prints what each rank of ``torchrun --nproc_per_node 2`` does."""
    proc = run([sys.executable, str(DEMO), "--tp", "1", "--pp", "2", "--dp", "2"], cwd=tmp_path, timeout=120,
               RANK="0", WORLD_SIZE="2", LOCAL_RANK="0")
    assert proc.returncode != 0
    assert "train_demo.py: error: tp*pp*dp = 1*2*2 but the world size is 2" in proc.stdout + proc.stderr
    assert not STEP_RE.search(proc.stdout)
