"""torchtitan 0.3 with the losses of vparallel_ce.integrations.torchtitan (CPU, gloo).

In-process checks of the pieces, then torchtitan's own trainer (tests/torchtitan_cpu.py) on its
llama3 debug model (its first two layers) for a few steps, on a tokenizer and a text dataset that
launch/cluster/torchtitan_assets.py writes into the test's tmp dir (nothing is downloaded). World 1
runs in one process and every world-2 layout in one pair of processes, the trainer once per layout
and loss: torchtitan's plain ``CrossEntropyLoss`` (the debug config's ``llama3_debugmodel_ce_loss``),
then ours selected by ``--override.imports``. Ours must give that layout's loss and grad-norm curves:

* world 1 (also with the fused loss compiled), FSDP dp2 (resharding after every forward), TP 2 with
  and without sequence parallelism, PP 2 (1F1B, 2 microbatches: ``global_valid_tokens`` reaches
  the loss through the schedule's ``loss_kwargs``).

Multi-rank layouts use ``--parallelism.spmd_backend partial_dtensor``: with torch 2.13, torchtitan
0.3.0's default ``spmd_types`` backend cannot apply FSDP (FSDP2 wants DTensor parameters there).
Every run has a bounded wall time and is killed (with its ranks) when it overruns.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_demo import _env as demo_env
from tests.warm import first_failure, free_port, join_all, start_python

ROOT = Path(__file__).resolve().parents[1]
LAUNCHER = ROOT / "tests" / "torchtitan_cpu.py"
ASSETS = ROOT / "launch" / "cluster" / "torchtitan_assets.py"
RUN_TIMEOUT = 120, 60  # seconds per set of processes: to start, and per trainer run in it
STEPS = 2  # step 1's loss and gradient norm, then step 2's after one optimizer update: the curve
STEP_RE = re.compile(r"step:\s*(\d+)\s+loss:\s*([-+0-9.eEnaif]+)\s+grad_norm:\s*([-+0-9.eEnaif]+)")
OVERRIDES = "vparallel_ce.integrations.torchtitan.overrides"
LOGITS = ("--override.imports", f"{OVERRIDES}.vparallel_cross_entropy")
FUSED = ("--override.imports", f"{OVERRIDES}.vparallel_linear_cross_entropy")
MULTI_RANK = ("--parallelism.spmd_backend", "partial_dtensor")

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


# ---------------------------------------------------------------------------------------------
# In-process checks of the pieces (cheap)


def _tiny(seed: int = 0, *, ignored: int = 1):
    import torch

    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, 8, 16, generator=g)
    labels = torch.randint(0, 40, (2, 8), generator=g)
    labels.view(-1)[:ignored] = -100
    return hidden, labels, (labels != -100).sum()


@needs_titan
def test_options_are_checked_when_torchtitan_builds_the_loss():
    from torchtitan.components.loss import CrossEntropyLoss, MSELoss

    from vparallel_ce.integrations.torchtitan import VParallelCrossEntropyLoss, VParallelLinearCrossEntropyLoss

    def fused(**fields):
        return VParallelLinearCrossEntropyLoss.Config(loss_fn=CrossEntropyLoss.Config(global_vocab_size=40), **fields)

    loss = fused(chunks="3", schedule="vocab", recompute="true", budget_mib=8, memory_mib=96).build()
    assert (loss.options["chunks"], loss.options["schedule"], loss.options["recompute"]) == (3, "vocab", True)
    assert loss.policy.budget_bytes == 8 << 20 and loss.policy.memory_bytes == 96 << 20
    assert loss.options["vocab_size"] == 40
    assert VParallelCrossEntropyLoss.Config(chunks=5).build().options["chunks"] == 5
    for bad in ({"chunks": "0"}, {"chunks": "many"}, {"schedule": "rows"}, {"recompute": "maybe"},
                {"budget_mib": -1.0}, {"memory_mib": -1.0}, {"label_smoothing": 2.0}, {"z_loss": -1.0}):
        with pytest.raises(ValueError):
            fused(**bad).build()
    with pytest.raises(ValueError, match="loss_fn must be a CrossEntropyLoss.Config"):
        VParallelLinearCrossEntropyLoss.Config(loss_fn=MSELoss.Config()).build()


@needs_titan
def test_overrides_replace_a_cross_entropy_keeping_its_vocab_and_refuse_other_losses():
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss, MSELoss

    from vparallel_ce.integrations.torchtitan import VParallelCrossEntropyLoss, VParallelLinearCrossEntropyLoss
    from vparallel_ce.integrations.torchtitan import overrides

    plain = CrossEntropyLoss.Config(global_vocab_size=2048)
    chunked = ChunkedLossWrapper.Config(loss_fn=CrossEntropyLoss.Config(global_vocab_size=2048))
    for source in (plain, chunked):
        logits = overrides.vparallel_cross_entropy(source, chunks=4)
        fused = overrides.vparallel_linear_cross_entropy(source, schedule="vocab")
        assert type(logits) is VParallelCrossEntropyLoss.Config and logits.global_vocab_size == 2048
        assert logits.chunks == 4
        assert type(fused) is VParallelLinearCrossEntropyLoss.Config and fused.global_vocab_size == 2048
        assert fused.schedule == "vocab"
    for other in (MSELoss.Config(), ChunkedLossWrapper.Config(loss_fn=MSELoss.Config())):
        with pytest.raises(ValueError, match="replace a cross-entropy loss"):
            overrides.vparallel_linear_cross_entropy(other)


@needs_titan
def test_logits_loss_gives_torchtitans_cross_entropy_and_gradient():
    """Sum / global_valid_tokens with the count, the sum without (validation), as torchtitan's."""
    import torch
    from torchtitan.components.loss import CrossEntropyLoss

    from vparallel_ce.integrations.torchtitan import VParallelCrossEntropyLoss

    _, labels, count = _tiny(ignored=3)
    logits = torch.randn(2, 8, 40, generator=torch.Generator().manual_seed(1))
    ours, theirs = VParallelCrossEntropyLoss.Config(chunks=3).build(), CrossEntropyLoss.Config().build()
    for global_valid_tokens in (count, None):
        results = []
        for loss_fn in (ours, theirs):
            x = logits.clone().requires_grad_()
            loss, metrics = loss_fn(x, labels, global_valid_tokens, positions=None)
            loss.backward()
            results.append((loss.detach(), x.grad, metrics))
        (loss, grad, metrics), (want, want_grad, _) = results
        torch.testing.assert_close(loss, want, msg=f"count={global_valid_tokens}")
        torch.testing.assert_close(grad, want_grad, msg=f"count={global_valid_tokens}")
        assert metrics == {}


def _fused_and_chunked(**fields):
    import torch
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss

    from vparallel_ce.integrations.torchtitan import VParallelLinearCrossEntropyLoss

    torch.manual_seed(0)
    head = torch.nn.Linear(16, 40, bias=False)
    inner = CrossEntropyLoss.Config(global_vocab_size=40)
    ours = VParallelLinearCrossEntropyLoss.Config(loss_fn=inner, **fields).build()
    theirs = ChunkedLossWrapper.Config(num_chunks=2, loss_fn=inner).build()
    ours.set_lm_head(head)
    theirs.set_lm_head(head)
    return head, ours, theirs


@needs_titan
@pytest.mark.parametrize("fields", [{}, {"chunks": 3}, {"chunks": 2, "schedule": "vocab"}], ids=str)
def test_fused_loss_gives_chunked_loss_wrappers_loss_and_gradients(fields):
    """The loss, the decoder's hidden-state gradient (handed on by the loss's backward) and the
    lm_head's weight gradient, as torchtitan's ChunkedLossWrapper gives them; validation (no
    gradient) gives the sum."""
    import torch

    head, ours, theirs = _fused_and_chunked(**fields)
    hidden, labels, count = _tiny(ignored=3)
    results = []
    for loss_fn in (ours, theirs):
        head.zero_grad()
        h = hidden.clone().requires_grad_()
        loss, _ = loss_fn(torch.tanh(h), labels, count)  # a decoder op between the leaf and the loss
        loss.backward()
        with torch.no_grad():
            validation, _ = loss_fn(hidden, labels)
        results.append((loss.detach(), h.grad, head.weight.grad.clone(), validation))
    for name, got, want in zip(("loss", "hidden grad", "weight grad", "validation sum"), *results):
        torch.testing.assert_close(got, want, msg=f"{fields}: {name}")


@needs_titan
def test_fused_loss_asks_for_its_lm_head():
    from torchtitan.components.loss import CrossEntropyLoss

    from vparallel_ce.integrations.torchtitan import VParallelLinearCrossEntropyLoss

    loss = VParallelLinearCrossEntropyLoss.Config(loss_fn=CrossEntropyLoss.Config()).build()
    hidden, labels, count = _tiny()
    with pytest.raises(RuntimeError, match="set_lm_head"):
        loss(hidden, labels, count)


@needs_titan
def test_losses_are_compiled_when_compile_components_hold_loss():
    """torchtitan's own switch compiles our losses (aot_eager: no C++ compiler needed), with the
    eager values."""
    import torch
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.config import CompileConfig

    from vparallel_ce.integrations.torchtitan import VParallelCrossEntropyLoss, VParallelLinearCrossEntropyLoss

    compile_config = CompileConfig(enable=True, components=["loss"], backend="aot_eager")
    head, eager, _ = _fused_and_chunked()
    compiled = VParallelLinearCrossEntropyLoss.Config(loss_fn=CrossEntropyLoss.Config(global_vocab_size=40)).build(
        compile_config=compile_config)
    compiled.set_lm_head(head)
    assert hasattr(compiled.fn, "_torchdynamo_orig_callable") and not hasattr(eager.fn, "_torchdynamo_orig_callable")
    hidden, labels, count = _tiny()
    torch._dynamo.reset()
    values = []
    for loss_fn in (compiled, eager):
        head.zero_grad()
        h = hidden.clone().requires_grad_()
        loss, _ = loss_fn(h, labels, count)
        loss.backward()
        values.append((loss.detach(), h.grad, head.weight.grad.clone()))
    for name, got, want in zip(("loss", "hidden grad", "weight grad"), *values):
        torch.testing.assert_close(got, want, msg=name)
    logits_loss = VParallelCrossEntropyLoss.Config().build(compile_config=compile_config)
    assert hasattr(logits_loss.fn, "_torchdynamo_orig_callable")


# ---------------------------------------------------------------------------------------------
# torchtitan's trainer


def _env() -> dict:
    """The demo tests' subprocess environment (this checkout importable), offline for HF, one
    thread per rank (the ranks share the machine's cores)."""
    return {**demo_env(), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
            "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    """launch/cluster/torchtitan_assets.py: a word-level tokenizer (ids < 2048, the debug model's vocab) and
    a jsonl text dataset, in torchtitan's hf_assets / dataset_path layout."""
    root = tmp_path_factory.mktemp("titan_assets")
    proc = subprocess.run([sys.executable, str(ASSETS), str(root), "--vocab", "2048", "--docs", "100"],
                          env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root


def train(assets: Path, tmp: Path, nproc: int, layout: tuple, runs: dict[str, tuple], *,
          config: str = "debugmodel_two_layers", steps: int = STEPS) -> dict[str, dict]:
    """torchtitan's trainer on ``nproc`` ranks with the ``layout`` flags, once per entry of
    ``runs`` ({name: extra flags, which may add layout flags of their own}), in one set of
    processes, for ``steps`` steps of the ``config`` of tests/torchtitan_cpu.py: {name: {step:
    (loss, grad_norm)}} as logged by the last rank (which holds the last pipeline stage, hence the
    loss)."""
    common = ["--module", "tests.torchtitan_cpu", "--config", config,
              "--hf_assets_path", str(assets / "tokenizer"), "--dataloader.dataset", "c4_test",
              "--dataloader.dataset_path", str(assets / "data"), "--training.local_batch_size", "2",
              "--training.seq_len", "64", "--training.steps", str(steps), "--metrics.log_freq", "1",
              "--metrics.disable_color_printing", "--debug.seed", "42", "--debug.deterministic",
              "--validator.no-enable", "--checkpoint.no-enable", "--training.disable_cuda_graphs",
              "--comm.init_timeout_seconds", "60", "--comm.train_timeout_seconds", "60",
              "--parallelism.data_parallel_shard_degree", "1", *layout]
    argv = list(common)
    for k, extra in enumerate(runs.values()):
        argv += ["--and", "--dump_folder", str(tmp / f"run{k}"), *extra]
    ports = ",".join(str(free_port()) for _ in runs)
    logs = [tmp / f"rank{r}.log" for r in range(nproc)]
    procs = []
    for r in range(nproc):  # python LAUNCHER argv, forked from a process that imported torch (tests/warm.py)
        env = {**_env(), "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(nproc),
               "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORTS": ports}
        logs[r].write_text("")
        procs.append(start_python("", LAUNCHER, *argv, env=env, cwd=tmp, out=logs[r]))
    timeout = RUN_TIMEOUT[0] + RUN_TIMEOUT[1] * len(runs)
    if not join_all(procs, timeout):
        pytest.fail(f"{_last_run(runs, logs[-1])}: torchtitan did not finish within {timeout}s:\n"
                    f"{logs[-1].read_text()[-4000:]}")
    failed = first_failure(procs)
    if failed:
        r, code = failed
        pytest.fail(f"{_last_run(runs, logs[r])} rank {r} failed ({code}):\n{logs[r].read_text()[-6000:]}")
    parts = re.split(r"^vparallel-run: \d+$", logs[-1].read_text(), flags=re.M)[1:]
    assert len(parts) == len(runs), logs[-1].read_text()[-3000:]
    curves = {}
    for name, log in zip(runs, parts):
        curves[name] = {int(s): (float(loss), float(g)) for s, loss, g in STEP_RE.findall(log)}
        assert sorted(curves[name]) == list(range(1, steps + 1)), f"{name}: no loss line for every step:\n{log[-3000:]}"
    return curves


def _last_run(runs: dict[str, tuple], log: Path) -> str:
    """The name of the run a rank's log ends in (the launcher prints ``vparallel-run: K`` first)."""
    started = re.findall(r"^vparallel-run: (\d+)$", log.read_text(), flags=re.M)
    return f"run {list(runs)[int(started[-1])]!r}" if started else "before the first run"


def assert_same_curves(curves: dict, *, baseline: str = "torchtitan", loss_tol: float = 2e-4,
                       norm_rtol: float = 1e-3, max_loss: float = 10.0) -> None:
    """Every run's loss and grad norm at every step are the baseline's (fp32 parameters: the
    differences are summation order only); the baseline's losses are in ``(0, max_loss)``."""
    want = curves[baseline]
    assert all(0 < loss < max_loss for loss, _ in want.values()), want
    for name, got in curves.items():
        for step, (ref_loss, ref_norm) in want.items():
            loss, norm = got[step]
            assert abs(loss - ref_loss) <= loss_tol, f"{name} step {step}: loss {got} vs {baseline} {want}"
            assert norm == pytest.approx(ref_norm, rel=norm_rtol), f"{name} step {step}: grad_norm {got} vs {want}"


RUNS = {"torchtitan": (), "logits": LOGITS, "fused": FUSED}


@needs_titan
@pytest.mark.slow
def test_world1_gives_torchtitans_curves_also_with_the_loss_compiled(assets, tmp_path):
    """One process, torchtitan's default spmd_types backend. The last run compiles the fused loss
    with torchtitan's own switch (aot_eager: no C++ compiler in the test)."""
    compiled = (*FUSED, "--compile.enable", "--compile.components", "loss", "--compile.backend", "aot_eager")
    assert_same_curves(train(assets, tmp_path, 1, (), {**RUNS, "fused compiled": compiled}))


FSDP = (*MULTI_RANK, "--parallelism.data_parallel_shard_degree", "2", "--parallelism.fsdp_reshard_after_forward",
        "always")
TP = (*MULTI_RANK, "--parallelism.tensor_parallel_degree", "2")
NO_SP = ("--parallelism.no-enable-sequence-parallel",)
PP = (*MULTI_RANK, "--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "1F1B")
# {layout: {run: flags}}: every run of a layout is compared with that layout's torchtitan run
LAYOUTS_AT_WORLD_2 = {
    # FSDP2 over 2 ranks, resharding after every forward: the fused loss unshards the lm_head's
    # group itself, and its weight gradient is reduce-scattered with the norm's. (The logits loss
    # sees plain logits under FSDP, as at world 1.)
    "FSDP dp2": {"torchtitan": FSDP, "fused": (*FSDP, *FUSED)},
    # TP 2, torchtitan's loss parallelism: the logits are a Shard(-1) DTensor, the lm_head weight
    # Shard(0). The fused loss's options come from the override's kwargs. Without sequence
    # parallelism only the fused loss runs again, against the same baseline: torchtitan's loss sees
    # the same logits either way (the final norm gathers the sequence before the lm_head).
    "TP 2": {"torchtitan": TP, "logits": (*TP, *LOGITS), "fused": (*TP, *FUSED),
             "fused vocab blocks": (*TP, FUSED[0], f'{FUSED[1]}={{"chunks": 2, "schedule": "vocab"}}'),
             "fused without SP": (*TP, *NO_SP, *FUSED)},
    # PP 2 (1F1B, 2 microbatches): the schedule calls the loss per microbatch with the step's
    # global_valid_tokens; the fused loss runs its backward inside the call and hands the hidden
    # gradient to the schedule's backward.
    "PP 2": {"torchtitan": PP, "logits": (*PP, *LOGITS), "fused": (*PP, *FUSED)},
}


@needs_titan
@pytest.mark.slow
def test_fsdp_tp_and_pp_at_world_2_give_torchtitans_curves(assets, tmp_path):
    """Every world-2 layout in one pair of processes (torchtitan's import, most of a short CPU
    run, is paid once): each layout's runs give its torchtitan run's curves; a failure names the
    layout and the run."""
    runs = {f"{layout}: {name}": flags for layout, named in LAYOUTS_AT_WORLD_2.items() for name, flags in named.items()}
    curves = train(assets, tmp_path, 2, (), runs)
    for layout, named in LAYOUTS_AT_WORLD_2.items():
        assert_same_curves({f"{layout}: {name}": curves[f"{layout}: {name}"] for name in named},
                           baseline=f"{layout}: torchtitan")
