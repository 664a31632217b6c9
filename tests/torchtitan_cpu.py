"""Run torchtitan 0.3's own trainer (``torchtitan.train.main``) on CPU with gloo, several times.

    RANK=r WORLD_SIZE=n MASTER_ADDR=127.0.0.1 MASTER_PORT=p python tests/torchtitan_cpu.py \
        <arguments of every run> --and <arguments of run 1> --and <arguments of run 2> ...

Each rank runs the trainer once per ``--and`` group, one after the other in the same process (the
trainer destroys its process groups at the end and the next run makes new ones), printing
``vparallel-run: K`` before run K: torchtitan's import, which takes most of a short CPU run, is paid
once per rank instead of once per run.

torchtitan takes "cuda" when no accelerator is found and calls CUDA-only functions. Before
torchtitan is imported, this script makes its device lookup answer "cpu" with a device module that
has the few functions torchtitan calls (memory numbers: peak RSS), makes FSDP's gradient reduction
use plain sums, since gloo has no PREMUL_SUM (FSDP uses it for torchtitan's divide factor of 1),
gives ``torch.distributed`` the ``set_timeout`` that torchtitan 0.3.0 calls after the first step
(torch 2.13 has it only on process groups), lets torch 2.13's pipeline schedules take the
microbatches torchtitan 0.3.0 splits itself, and skips the trainer's 2-second sleep after its last
step (a pause for other ranks' logs). :func:`debugmodel_two_layers` and
:func:`deepseek_v3_mtp_debugmodel` are the configs the tests train. Nothing else changes: the
trainer, the losses and the log lines are torchtitan's. Test helper only; not part of the library.
"""

from __future__ import annotations

import os
import resource
import sys
import time
import types

import torch
import torch._utils
from torch.distributed.fsdp import FSDPModule


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class _HostProperties:
    name = "cpu"
    total_memory = 1 << 40  # nominal; only the % in the log line uses it


def _cpu_device_module() -> types.ModuleType:
    cpu = types.ModuleType("cpu_device_module")
    for name in dir(torch.cpu):
        if not name.startswith("__"):
            setattr(cpu, name, getattr(torch.cpu, name))
    cpu.current_device = lambda: 0
    cpu.get_device_name = lambda device=None: "cpu"
    cpu.get_device_properties = lambda device=None: _HostProperties()
    cpu.reset_peak_memory_stats = lambda device=None: None
    cpu.empty_cache = lambda: None
    cpu.memory_stats = lambda device=None: {
        "active_bytes.all.peak": _peak_rss(), "reserved_bytes.all.peak": _peak_rss(),
        "num_alloc_retries": 0, "num_ooms": 0,
    }
    return cpu


def use_cpu() -> None:
    cpu = _cpu_device_module()
    get_module = torch._utils._get_device_module
    torch._utils._get_available_device_type = lambda: "cpu"
    torch._utils._get_device_module = lambda device_type=None: cpu if device_type == "cpu" else get_module(device_type)

    set_factor = FSDPModule.set_gradient_divide_factor

    def set_factor_with_sums(self, factor):
        set_factor(self, factor)
        self.set_force_sum_reduction_for_comms(True)

    FSDPModule.set_gradient_divide_factor = set_factor_with_sums


def with_set_timeout() -> None:
    """torchtitan 0.3.0 calls ``torch.distributed.set_timeout(timeout, group)`` after the first step;
    torch 2.13 has no such function, only the process groups' own ``set_timeout``."""
    if not hasattr(torch.distributed, "set_timeout"):
        def set_timeout(timeout, group=None):
            (group or torch.distributed.distributed_c10d._get_default_group()).set_timeout(timeout)

        torch.distributed.set_timeout = set_timeout


def with_presplit_pipeline_step() -> None:
    """torchtitan 0.3.0 hands pipeline schedules microbatches it split itself,
    ``step(arg_mbs=, kwarg_mbs=, target_mbs=, ...)``; torch 2.13's ``step`` takes the whole batch
    and splits it along dim 0. Where ``step`` lacks ``arg_mbs``, the microbatches are concatenated
    and torch splits them again into the same equal microbatches."""
    import inspect

    from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle

    def whole(parts):
        return torch.cat(parts) if isinstance(parts[0], torch.Tensor) else parts[0]

    for cls in (PipelineScheduleSingle, PipelineScheduleMulti):
        if "arg_mbs" in inspect.signature(cls.step).parameters:
            continue

        def step(self, *args, arg_mbs=None, kwarg_mbs=None, target_mbs=None, _step=cls.step, **kwargs):
            if arg_mbs:
                args = tuple(whole(list(parts)) for parts in zip(*arg_mbs))
            if kwarg_mbs and kwarg_mbs[0]:
                kwargs.update({key: whole([mb[key] for mb in kwarg_mbs]) for key in kwarg_mbs[0]})
            target = torch.cat(target_mbs) if target_mbs else None
            return _step(self, *args, target=target, **kwargs)

        cls.step = step


def without_final_sleep(module: types.ModuleType) -> None:
    """``module.time`` as the time module with a ``sleep`` that returns at once."""
    clock = types.ModuleType("time")
    clock.__dict__.update({k: v for k, v in vars(time).items() if not k.startswith("__")})
    clock.sleep = lambda seconds: None
    module.time = clock


def debugmodel():
    """``--module tests.torchtitan_cpu --config debugmodel``: torchtitan's ``llama3_debugmodel_ce_loss``
    (its debug Llama with its plain ``CrossEntropyLoss``), with SDPA attention (torchtitan's flex
    attention has no backward on CPU), fp32 parameters (FSDP's bf16 mixed precision makes every
    matmul take CPU's slow bf16 path) and no activation checkpointing (a few steps on a tiny
    model)."""
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3.config_registry import llama3_debugmodel_ce_loss

    config = llama3_debugmodel_ce_loss()
    for layer in config.model_spec.model.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    config.activation_checkpoint = None
    config.training.mixed_precision_param = "float32"
    return config


def debugmodel_two_layers():
    """``--config debugmodel_two_layers``: :func:`debugmodel` cut to its first two layers, what the
    tests train (the losses see the last hidden state and the lm_head: the layer count changes
    nothing they are checked for, and PP 2 still gives each stage one; two layers make a run's
    per-op DTensor, FSDP and pipeline work on CPU a third of six's)."""
    config = debugmodel()
    config.model_spec.model.layers = config.model_spec.model.layers[:2]
    return config


def deepseek_v3_mtp_debugmodel():
    """``--config deepseek_v3_mtp_debugmodel``: torchtitan's ``deepseek_v3_debugmodel_mtp`` (its debug
    DeepSeek-V3 with one MTP depth and its ``MTPLoss``), cut to its first two layers (the dense one
    and a MoE one) and with :func:`debugmodel`'s SDPA attention, fp32 parameters and no activation
    checkpointing."""
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.deepseek_v3.config_registry import deepseek_v3_debugmodel_mtp

    config = deepseek_v3_debugmodel_mtp()
    model = config.model_spec.model
    model.layers = model.layers[:2]
    for layer in (*model.layers, *model.mtp_layers):
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    config.activation_checkpoint = None
    config.training.mixed_precision_param = "float32"
    return config


def runs(argv: list[str]) -> list[list[str]]:
    """``common --and a --and b`` -> ``[common + a, common + b]`` (``[common]`` without ``--and``)."""
    groups, current = [], []
    for arg in argv:
        if arg == "--and":
            groups.append(current)
            current = []
        else:
            current.append(arg)
    groups.append(current)
    common, own = groups[0], groups[1:] or [[]]
    return [common + extra for extra in own]


if __name__ == "__main__":
    use_cpu()
    with_set_timeout()
    with_presplit_pipeline_step()
    import torchtitan.trainer
    from torchtitan.train import main

    without_final_sleep(torchtitan.trainer)
    ports = os.environ.get("MASTER_PORTS", os.environ.get("MASTER_PORT", "")).split(",")
    for k, args in enumerate(runs(sys.argv[1:])):
        print(f"vparallel-run: {k}", flush=True)
        # a fresh rendezvous port per run: rank 0's store of the previous run may still hold its port
        os.environ["MASTER_PORT"] = ports[k % len(ports)]
        sys.argv = [sys.argv[0], *args]
        main()
    # Every trainer has finished and destroyed its process groups. Interpreter finalization can
    # still abort ("terminate called without an active exception") when gloo's worker threads are
    # torn down after the interpreter (a known gloo teardown race, seen about once in a CI run
    # under load): exit here instead, once every log line is out. A failing trainer raises above.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
