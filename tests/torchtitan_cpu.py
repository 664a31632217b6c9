"""Run torchtitan's own trainer (``torchtitan.train.main(Trainer)``) on CPU with gloo.

    torchrun --nproc-per-node 2 tests/torchtitan_cpu.py <torchtitan.train arguments>

torchtitan 0.2.2 takes "cuda" when no accelerator is found and calls CUDA-only functions. Before
torchtitan is imported, this script makes its device lookup answer "cpu" with a device module that
has the few functions torchtitan calls (memory numbers: peak RSS), and makes FSDP's gradient
reduction use plain sums, since gloo has no PREMUL_SUM (FSDP uses it for torchtitan's divide
factor of 1); it skips the trainer's 2-second sleep after its last step (a pause for other ranks'
logs; here every rank has finished its last collective by then, and the tests launch the trainer
a dozen times) and ends the process once the trainer returns (see the end). Nothing else changes:
the trainer, the train specs and the log lines are torchtitan's. Test helper only; not part of
the library.
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


def without_final_sleep(module: types.ModuleType) -> None:
    """``module.time`` as the time module with a ``sleep`` that returns at once."""
    clock = types.ModuleType("time")
    clock.__dict__.update({k: v for k, v in vars(time).items() if not k.startswith("__")})
    clock.sleep = lambda seconds: None
    module.time = clock


if __name__ == "__main__":
    use_cpu()
    import torchtitan.train
    from torchtitan.train import Trainer, main

    without_final_sleep(torchtitan.train)
    main(Trainer)
    # The trainer has finished and destroyed its process groups. Interpreter finalization can
    # still abort ("terminate called without an active exception") when gloo's worker threads are
    # torn down after the interpreter (a known gloo teardown race, seen about once in a CI run
    # under load): exit here instead, once every log line is out. A failing trainer raises above.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
