"""torchtitan's own trainer with the specs of vparallel_ce.integrations.torchtitan (CPU, gloo).

Each run is ``torchrun ... tests/torchtitan_cpu.py`` -- torchtitan's ``main(Trainer)`` with its device
lookup pointed at the CPU -- training torchtitan's llama3 debug model for a few steps on a tokenizer
and a text dataset that launch/torchtitan_assets.py writes into the test's tmp dir (nothing is
downloaded). The tests parse
torchtitan's log lines (``step: N  loss: X  grad_norm: G ...``) and compare, layout by layout:

* world 1, FSDP dp2 and TP tp2: ``llama3_vparallel`` and ``llama3_vparallel_fused`` give torchtitan's
  ``llama3`` loss and grad-norm curves;
* PP pp2: the same step-1 loss, both of our curves agree, and their grad norm is the default's
  divided by the step's token count: torchtitan 0.2.2 back-propagates un-normalised sums under PP,
  our specs normalise inside the schedule.

Every run has a bounded wall time and is killed (with its workers) when it overruns.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.test_demo import _env as demo_env, free_port

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
LAUNCHER = ROOT / "tests" / "torchtitan_cpu.py"
ASSETS = ROOT / "launch" / "torchtitan_assets.py"
RUN_TIMEOUT = 240  # seconds per torchrun
STEPS = 3
LOCAL_BATCH, SEQ_LEN = 2, 64
STEP_RE = re.compile(r"step:\s*(\d+)\s+loss:\s*([-+0-9.eEnaif]+)\s+grad_norm:\s*([-+0-9.eEnaif]+)")
SPECS = ("llama3", "llama3_vparallel", "llama3_vparallel_fused")

try:
    import torchtitan  # noqa: F401

    TITAN_ERROR = None
except Exception as e:  # noqa: BLE001 - any import failure means: cannot run torchtitan here
    TITAN_ERROR = f"{type(e).__name__}: {e}"

needs_titan = pytest.mark.skipif(
    TITAN_ERROR is not None,
    reason=f"torchtitan cannot be imported ({TITAN_ERROR}); pip install 'vparallel_ce[torchtitan]' "
           "(the test extra includes it)",
)


def test_importing_the_library_does_not_import_torchtitan():
    code = ("import sys, vparallel_ce, vparallel_ce.integrations, vparallel_ce.pipeline; "
            "assert 'torchtitan' not in sys.modules, sorted(m for m in sys.modules if 'titan' in m)")
    proc = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]


# ---------------------------------------------------------------------------------------------
# In-process checks of the pieces (cheap)


@needs_titan
def test_options_are_parsed_and_checked():
    from vparallel_ce.integrations import torchtitan as tt

    loss = tt.FusedLoss(tt.VParallel(chunks="3", schedule="vocab", recompute="true", budget_mib=8, memory_mib=96))
    assert loss.kwargs["chunks"] == 3 and loss.kwargs["schedule"] == "vocab" and loss.kwargs["recompute"] is True
    assert loss.policy.budget_bytes == 8 << 20 and loss.policy.memory_bytes == 96 << 20
    assert tt.LogitsLoss(tt.VParallel(chunks=5)).kwargs["chunks"] == 5  # an int from a TOML file
    for bad in ({"chunks": "0"}, {"chunks": "many"}, {"schedule": "rows"}, {"recompute": "maybe"},
                {"budget_mib": -1.0}, {"memory_mib": -1.0}):
        with pytest.raises(ValueError):
            tt.FusedLoss(tt.VParallel(**bad))


@needs_titan
def test_specs_are_registered_once_and_share_the_flavors():
    from torchtitan.protocols.train_spec import get_train_spec

    from vparallel_ce.integrations import torchtitan as tt

    base = get_train_spec("llama3")
    again = tt.register_specs("llama3")
    for name, spec in again.items():
        assert get_train_spec(name) is spec
        assert spec.model_args is base.model_args
    fused = again["llama3_vparallel_fused"]
    import torch

    with torch.device("meta"):
        model = fused.model_cls(base.model_args["debugmodel"])
    assert isinstance(model.output, tt.FusedLMHead)
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in _meta_model(base).named_parameters()]


def _meta_model(spec):
    import torch

    with torch.device("meta"):
        return spec.model_cls(spec.model_args["debugmodel"])


@needs_titan
def test_head_output_passes_the_tensor_parallel_output_hook_unchanged():
    import torch
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel

    from vparallel_ce.integrations import torchtitan as tt

    out = tt.LMHeadInputs(torch.zeros(2, 3, 4), torch.zeros(5, 4))
    for layouts, local in (((Shard(-1),), False), ((Replicate(),), True)):
        assert ColwiseParallel._prepare_output_fn(layouts, local, None, out, None) is out


@needs_titan
def test_fused_loss_refuses_logits():
    import torch

    from vparallel_ce.integrations import torchtitan as tt

    with pytest.raises(TypeError, match="FusedLMHead"):
        tt.FusedLoss(tt.VParallel())(torch.zeros(1, 2, 8), torch.zeros(1, 2, dtype=torch.long))


# ---------------------------------------------------------------------------------------------
# torchtitan's trainer


def _env() -> dict:
    """The demo tests' subprocess environment (this checkout importable), offline for HF."""
    return {**demo_env(), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    """launch/torchtitan_assets.py: a word-level tokenizer (ids < 2048, the debug model's vocab) and
    a jsonl text dataset, in torchtitan's hf_assets / dataset_path layout."""
    root = tmp_path_factory.mktemp("titan_assets")
    proc = subprocess.run([sys.executable, str(ASSETS), str(root), "--vocab", "2048", "--docs", "100"],
                          env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root


def train(assets: Path, tmp: Path, nproc: int, spec: str, *extra: str) -> tuple[dict[int, tuple[float, float]], str]:
    """torchtitan's trainer for STEPS steps: ({step: (loss, grad_norm)}, log) as logged by the last
    rank (which holds the last pipeline stage, hence the loss)."""
    out = tmp / spec
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-port", str(free_port()), "--local-ranks-filter", str(nproc - 1), "--role", "rank", "--tee", "3",
           str(LAUNCHER),
           "--experimental.custom_import", "vparallel_ce.integrations.torchtitan",
           "--job.custom_config_module", "vparallel_ce.integrations.torchtitan",
           "--model.name", spec, "--model.flavor", "debugmodel", "--model.hf_assets_path", str(assets / "tokenizer"),
           "--training.dataset", "c4_test", "--training.dataset_path", str(assets / "data"),
           "--training.local_batch_size", str(LOCAL_BATCH), "--training.seq_len", str(SEQ_LEN),
           "--training.steps", str(STEPS), "--metrics.log_freq", "1", "--metrics.disable_color_printing",
           "--debug.seed", "42", "--debug.deterministic", "--job.dump_folder", str(out),
           "--comm.init_timeout_seconds", "60", "--comm.train_timeout_seconds", "60",
           "--parallelism.data_parallel_shard_degree", "1", *extra]
    proc = subprocess.Popen(cmd, cwd=tmp, env=_env(), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=RUN_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and its workers
        log, _ = proc.communicate()
        pytest.fail(f"{spec} {extra}: torchtitan did not finish within {RUN_TIMEOUT}s:\n{log[-4000:]}")
    assert proc.returncode == 0, f"{spec} {extra} failed ({proc.returncode}):\n{log[-6000:]}"
    curve = {int(s): (float(loss), float(g)) for s, loss, g in STEP_RE.findall(log)}
    assert sorted(curve) == list(range(1, STEPS + 1)), f"{spec}: no loss lines for every step:\n{log[-3000:]}"
    return curve, log


def assert_same_curves(got, want, *, what: str, loss_tol: float = 5e-4, norm_rtol: float = 2e-3) -> None:
    for step in want:
        (loss, norm), (ref_loss, ref_norm) = got[step], want[step]
        assert abs(loss - ref_loss) <= loss_tol, f"{what} step {step}: loss {got} vs {want}"
        assert norm == pytest.approx(ref_norm, rel=norm_rtol), f"{what} step {step}: grad_norm {got} vs {want}"


def _compare_specs(assets, tmp, nproc, *extra):
    runs = {spec: train(assets, tmp, nproc, spec, *extra) for spec in SPECS}
    curves = {spec: curve for spec, (curve, _) in runs.items()}
    assert all(0 < loss < 10 for loss, _ in curves["llama3"].values()), curves
    for spec in SPECS[1:]:
        assert_same_curves(curves[spec], curves["llama3"], what=f"{spec} {extra}")
    return {spec: log for spec, (_, log) in runs.items()}


@needs_titan
def test_world1_matches_default(assets, tmp_path):
    """One process, torchtitan's AMP (bf16 autocast): the fused head casts like F.linear would."""
    _compare_specs(assets, tmp_path, 1)


@needs_titan
def test_fsdp_dp2_matches_default(assets, tmp_path):
    """FSDP2 over 2 ranks, resharding after every forward: outside its forward the lm_head weight is
    FSDP's shard; the fused spec takes the unsharded view from inside it. Explicit chunk counts."""
    logs = _compare_specs(assets, tmp_path, 2, "--parallelism.data_parallel_shard_degree", "2",
                          "--parallelism.fsdp_reshard_after_forward", "always", "--vparallel.chunks", "4")
    assert "'chunks': 4" in logs["llama3_vparallel_fused"], logs["llama3_vparallel_fused"][-3000:]


@needs_titan
def test_tp2_matches_default(assets, tmp_path):
    """TP 2 with loss parallel: the logits are a Shard(-1) DTensor, the lm_head weight Shard(0). The
    [vparallel] options come from a TOML config file."""
    config = tmp_path / "vparallel.toml"
    config.write_text(textwrap.dedent("""\
        [job]
        custom_config_module = "vparallel_ce.integrations.torchtitan"

        [vparallel]
        chunks = 2
        schedule = "vocab"
        """))
    logs = _compare_specs(assets, tmp_path, 2, "--job.config_file", str(config),
                          "--parallelism.tensor_parallel_degree", "2")
    assert "'chunks': 2" in logs["llama3_vparallel"] and "'schedule': 'vocab'" in logs["llama3_vparallel_fused"]


@needs_titan
def test_pp2_normalises_inside_the_schedule(assets, tmp_path):
    """PP 2 (1F1B, 2 microbatches): equal step-1 losses; the default's step-1 gradient is the sum over
    the step's tokens (torchtitan 0.2.2 divides after the schedule's backward), ours the mean."""
    extra = ("--parallelism.pipeline_parallel_degree", "2")
    curves = {spec: train(assets, tmp_path, 2, spec, *extra)[0] for spec in SPECS}
    ours, fused, default = curves["llama3_vparallel"], curves["llama3_vparallel_fused"], curves["llama3"]
    assert_same_curves(fused, ours, what="fused vs logits under PP")
    assert abs(ours[1][0] - default[1][0]) <= 5e-4, (ours, default)
    tokens = LOCAL_BATCH * SEQ_LEN  # every label of the packed text dataset is valid
    assert default[1][1] / ours[1][1] == pytest.approx(tokens, rel=2e-3), (default, ours)
