"""torchtitan's own trainer with the specs of vparallel_ce.integrations.torchtitan (CPU, gloo).

Each run is ``torchrun ... tests/torchtitan_cpu.py`` -- torchtitan's ``main(Trainer)`` with its device
lookup pointed at the CPU -- training torchtitan's llama3 debug model for a few steps on a tokenizer
and a text dataset that launch/cluster/torchtitan_assets.py writes into the test's tmp dir (nothing is
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
ASSETS = ROOT / "launch" / "cluster" / "torchtitan_assets.py"
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
           "(CI installs it; without it these tests skip)",
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
    assert loss.options["chunks"] == 3 and loss.options["schedule"] == "vocab" and loss.options["recompute"] is True
    assert loss.options["reduction"] == "sum"
    assert loss.policy.budget_bytes == 8 << 20 and loss.policy.memory_bytes == 96 << 20
    assert tt.LogitsLoss(tt.VParallel(chunks=5)).options["chunks"] == 5  # an int from a TOML file
    for bad in ({"chunks": "0"}, {"chunks": "many"}, {"schedule": "rows"}, {"recompute": "maybe"},
                {"budget_mib": -1.0}, {"memory_mib": -1.0}, {"label_smoothing": 2.0}):
        with pytest.raises(ValueError):
            tt.FusedLoss(tt.VParallel(**bad))


@needs_titan
def test_the_torchtitan_loss_builder_checks_options_when_torchtitan_builds_the_loss():
    from types import SimpleNamespace

    from vparallel_ce.integrations import torchtitan as tt

    job = SimpleNamespace(compile=SimpleNamespace(enable=False, components=[]), vparallel=tt.VParallel(z_loss=-1.0))
    with pytest.raises(ValueError, match="z_loss must be a finite number >= 0"):
        tt.build_torchtitan_loss_fn(job, parallel_dims=None)
    job.vparallel = tt.VParallel(chunks="4")
    assert isinstance(tt.build_torchtitan_loss_fn(job, parallel_dims=None, fused=True), tt.FusedLoss)


@needs_titan
def test_the_loss_is_compiled_when_compile_components_hold_loss():
    """torchtitan's own switch compiles our losses: one graph, no break, the eager values."""
    from types import SimpleNamespace

    import torch

    from vparallel_ce.integrations import torchtitan as tt

    g = torch.Generator().manual_seed(3)
    logits, hidden, weight = torch.randn(2, 6, 40, generator=g), torch.randn(2, 6, 8, generator=g), torch.randn(40, 8)
    labels = torch.randint(0, 40, (2, 6), generator=g)
    for fused, args in ((False, (logits,)), (True, (hidden, weight))):
        def job(enable):
            return SimpleNamespace(compile=SimpleNamespace(enable=enable, components=["loss"], backend="aot_eager"),
                                   vparallel=tt.VParallel(chunks="2"))

        compiled = tt.build_torchtitan_loss_fn(job(True), parallel_dims=None, fused=fused)
        plain = tt.build_torchtitan_loss_fn(job(False), parallel_dims=None, fused=fused)
        assert hasattr(compiled.forward, "_torchdynamo_orig_callable") and not hasattr(plain.forward,
                                                                                         "_torchdynamo_orig_callable")
        torch._dynamo.reset()
        explained = torch._dynamo.explain(compiled.forward._torchdynamo_orig_callable)(*args, labels)
        assert explained.graph_count == 1 and explained.graph_break_count == 0, explained
        grads = []
        for loss in (compiled, plain):
            leaves = [a.clone().requires_grad_() for a in args]
            pred = leaves[0] if len(leaves) == 1 else tuple(leaves)
            value = loss(pred, labels)
            value.backward()
            grads.append([value.detach()] + [a.grad for a in leaves])
        for got, want in zip(*grads):
            torch.testing.assert_close(got, want)


@needs_titan
def test_specs_are_registered_once_and_share_the_flavors():
    import torch
    from torchtitan.protocols.train_spec import get_train_spec

    from vparallel_ce.integrations import torchtitan as tt

    base = get_train_spec("llama3")
    again = tt.register()  # importing the module registered them; a second call changes nothing
    assert sorted(again) == sorted(tt.SPEC_NAMES)
    for name, spec in again.items():
        assert get_train_spec(name) is spec
        assert spec.model_args is base.model_args
    fused = again["llama3_vparallel_fused"]
    assert fused.parallelize_fn is tt.parallelize_llama_fused
    assert again["llama3_vparallel"].parallelize_fn is base.parallelize_fn
    model = _meta_model(fused)
    assert type(model.output) is tt.FusedLMHead and issubclass(type(model), base.model_cls)
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in _meta_model(base).named_parameters()]


def _meta_model(spec):
    import torch

    with torch.device("meta"):
        return spec.model_cls(spec.model_args["debugmodel"])


@needs_titan
def test_a_fused_spec_from_another_base_asks_for_its_parallelize_fn():
    import dataclasses

    from torchtitan.protocols.train_spec import get_train_spec

    from vparallel_ce.integrations import torchtitan as tt

    def parallelize_other(model, parallel_dims, job_config):
        return model

    other = dataclasses.replace(get_train_spec("llama3"), parallelize_fn=parallelize_other)
    with pytest.raises(ValueError, match="parallelize_other needs parallelize_fn="):
        tt.vparallel_train_spec(other, fused=True)
    assert tt.vparallel_train_spec(other, fused=True, parallelize_fn=parallelize_other).parallelize_fn is parallelize_other


@needs_titan
def test_fused_head_parallel_style_applies_only_to_a_fused_head():
    from torch import nn

    from vparallel_ce.integrations import torchtitan as tt

    with pytest.raises(TypeError, match="ColwiseParallel"):
        tt.FusedLMHeadParallel()._apply(nn.Linear(4, 8, bias=False), None)
    with pytest.raises(TypeError, match="without bias"):
        tt.FusedLMHead.from_linear(nn.Linear(4, 8))


def fused_head_parallel_rank(rank, world):
    """trunk -> FusedLMHead under FusedLMHeadParallel -> FusedLoss, against the float64 reference:
    the weight is this rank's Shard(0) vocab rows, the head returns the hidden states (Replicate)
    and that shard, and every gradient is the full model's."""
    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import parallelize_module

    from tests.reference import reference_loss
    from vparallel_ce.integrations import torchtitan as tt

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    g = torch.Generator().manual_seed(7)
    tokens = torch.randn(2, 6, 5, generator=g, dtype=torch.float64)
    target = torch.randint(0, 23, (2, 6), generator=g)
    target[0, 0] = -100
    errs = {}
    for sequence_sharded in (False, True):
        torch.manual_seed(0)
        trunk = nn.Linear(5, 5, dtype=torch.float64)
        head = nn.Linear(5, 23, bias=False, dtype=torch.float64)
        ref_h = torch.tanh(trunk(tokens))
        ref_h.retain_grad()
        ref = reference_loss(head(ref_h), target, reduction="sum")
        ref.backward()
        ref_trunk, ref_head, ref_dh = trunk.weight.grad.clone(), head.weight.grad.clone(), ref_h.grad
        trunk.zero_grad(), head.zero_grad()
        model = nn.ModuleDict({"trunk": trunk, "output": tt.FusedLMHead.from_linear(head)})
        style = tt.FusedLMHeadParallel(input_layouts=Shard(1)) if sequence_sharded else tt.FusedLMHeadParallel()
        parallelize_module(model, mesh, {"output": style})
        weight = model["output"].weight
        assert weight.placements == (Shard(0),) and weight.to_local().shape[0] == torch.chunk(head.weight, world)[rank].shape[0]
        h = torch.tanh(model["trunk"](tokens))
        if sequence_sharded:  # this rank's rows of the sequence, as a sequence-parallel norm hands them on
            h = torch.chunk(h.detach(), world, dim=1)[rank].clone().requires_grad_()
        out = model["output"](h)
        assert isinstance(out, tuple) and out[0].placements == (Replicate(),) and out[0].shape == ref_h.shape
        loss = tt.FusedLoss(tt.VParallel(chunks="2"))(out, target)
        loss.backward()
        if sequence_sharded:  # the hidden gradient of this rank's rows
            input_err = (h.grad - torch.chunk(ref_dh, world, dim=1)[rank]).abs().max().item()
        else:  # the trunk's: hidden got the full gradient (summed over the vocab shards)
            input_err = (model["trunk"].weight.grad - ref_trunk).abs().max().item()
        key = "sequence-sharded input" if sequence_sharded else "replicated input"
        errs[key] = max(abs(loss.item() - ref.item()), (weight.grad.full_tensor() - ref_head).abs().max().item(),
                        input_err)
    return errs


@needs_titan
def test_fused_head_parallel_shards_the_weight_and_hands_the_loss_the_hidden_states():
    from tests.dist import run_ranks

    for errs in run_ranks(fused_head_parallel_rank, 2):
        assert max(errs.values()) < 1e-12, errs


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
    """launch/cluster/torchtitan_assets.py: a word-level tokenizer (ids < 2048, the debug model's vocab) and
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
    curve = _curve(log)
    assert sorted(curve) == list(range(1, STEPS + 1)), f"{spec}: no loss lines for every step:\n{log[-3000:]}"
    return curve, log


def _curve(log: str) -> dict[int, tuple[float, float]]:
    return {int(s): (float(loss), float(g)) for s, loss, g in STEP_RE.findall(log)}


def assert_same_curves(got, want, *, what: str, loss_tol: float = 5e-4, norm_rtol: float = 2e-3) -> None:
    for step in want:
        (loss, norm), (ref_loss, ref_norm) = got[step], want[step]
        assert abs(loss - ref_loss) <= loss_tol, f"{what} step {step}: loss {got} vs {want}"
        assert norm == pytest.approx(ref_norm, rel=norm_rtol), f"{what} step {step}: grad_norm {got} vs {want}"


def _compare_specs(assets, tmp, nproc, *extra, specs=SPECS):
    """Train the default spec and ``specs[1:]`` (ours) with the same flags; ours' curves must be the
    default's. Returns each spec's log."""
    runs = {spec: train(assets, tmp, nproc, spec, *extra) for spec in specs}
    curves = {spec: curve for spec, (curve, _) in runs.items()}
    assert all(0 < loss < 10 for loss, _ in curves["llama3"].values()), curves
    for spec in specs[1:]:
        assert_same_curves(curves[spec], curves["llama3"], what=f"{spec} {extra}")
    return {spec: log for spec, (_, log) in runs.items()}


@needs_titan
def test_world1_matches_default_eager_and_with_the_loss_compiled(assets, tmp_path):
    """One process, torchtitan's AMP (bf16 autocast): the fused head casts like F.linear would.
    Then with ``--compile.components loss`` our specs compile their loss (aot_eager: no C++
    compiler in the test) and the curves stay the default's eager one (compiling the default's
    plain loss would move it by far less than the curves' tolerance). The integration compiles both
    specs' loss the same way, so the fused spec stands for both there (the ops' own compiled paths:
    test_compile.py)."""
    want = _curve(_compare_specs(assets, tmp_path, 1)["llama3"])
    compiled_flags = ("--compile.enable", "--compile.components", "loss", "--compile.backend", "aot_eager")
    (tmp_path / "compiled").mkdir()
    for spec in ("llama3_vparallel_fused",):
        curve, log = train(assets, tmp_path / "compiled", 1, spec, *compiled_flags)
        assert_same_curves(curve, want, what=f"{spec} with the loss compiled")
        assert "vparallel_ce: compiling the loss with torch.compile (backend aot_eager)" in log, log[-3000:]
        assert "zlib.crc32" not in log and "Graph break" not in log, log[-3000:]


@needs_titan
def test_fsdp_dp2_matches_default(assets, tmp_path):
    """FSDP2 over 2 ranks, resharding after every forward: outside its forward the lm_head weight is
    FSDP's shard; the fused spec takes the unsharded view from inside it. Explicit chunk counts. (The
    logits spec's loss sees plain logits under FSDP, as at world 1: not run again here.)"""
    logs = _compare_specs(assets, tmp_path, 2, "--parallelism.data_parallel_shard_degree", "2",
                          "--parallelism.fsdp_reshard_after_forward", "always", "--vparallel.chunks", "4",
                          specs=("llama3", "llama3_vparallel_fused"))
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
