#!/usr/bin/env python
"""torchtitan 0.3's own trainer on one of its configs cut to fewer layers, with a chosen loss; and a
summary of runs.

    torchrun --nproc-per-node 1 launch/cluster/torchtitan_bench.py --layers 12 --loss fused -- \\
        --module llama3 --config llama3_8b <torchtitan.train args>
    python launch/cluster/torchtitan_bench.py --summarize chunked=A.log plain=B.log fused=C.log > results.jsonl

Train: parses the torchtitan arguments with torchtitan's ``ConfigManager``, keeps the first
``--layers`` decoder layers of the model config, sets the loss and runs torchtitan's ``Trainer``:

* ``plain``: torchtitan's ``CrossEntropyLoss`` on the full logits;
* ``chunked``: torchtitan's ``ChunkedLossWrapper`` (8 sequence chunks; the llama3 configs' own);
* ``logits``: vparallel_ce's ``VParallelCrossEntropyLoss`` on the full logits;
* ``fused``: vparallel_ce's ``VParallelLinearCrossEntropyLoss`` (lm_head fused, chunks="auto").

torchtitan 0.3.0 calls ``torch.distributed.set_timeout`` after the first step, which torch 2.13
and older lack; this script gives it one (the process groups' own ``set_timeout``). With
``--torch211-compat`` it first applies torch211_compat.py (beside it): what torchtitan 0.3.0 takes
from torch >= 2.12, stood in for on an older torch, for a one-GPU run only.

Summarize: reads torchtitan's log lines (``step: N  loss: X  grad_norm: G  memory: M GiB(P%)  tps: T``)
and prints one JSON line per run: step-1 loss, the max abs loss gap to the first run over their
common steps, peak reserved memory and the median tps of steps >= 2 (step 1 includes warm-up).
launch/cluster/torchtitan_gpu.sh runs the losses and this summary.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys

LINE_RE = re.compile(r"step:\s*(\d+)\s+loss:\s*([-0-9.]+)\s+grad_norm:\s*([-0-9.]+)\s+memory:\s*([0-9.]+)GiB"
                     r"\(([0-9.]+)%\)\s+tps:\s*([0-9,]+)")
LOSSES = ("plain", "chunked", "logits", "fused")


def parse_log(text: str) -> dict[int, dict]:
    steps = {}
    for step, loss, norm, mem, pct, tps in LINE_RE.findall(text):
        steps[int(step)] = {"loss": float(loss), "grad_norm": float(norm), "memory_gib": float(mem),
                            "memory_pct": float(pct), "tps": int(tps.replace(",", ""))}
    return steps


def summarize(runs: dict[str, dict[int, dict]]) -> list[dict]:
    reference = next(iter(runs.values()))
    rows = []
    for name, steps in runs.items():
        common = sorted(set(steps) & set(reference))
        later = [s["tps"] for n, s in steps.items() if n >= 2]
        rows.append({
            "run": name,
            "steps": len(steps),
            "step1_loss": steps[1]["loss"] if 1 in steps else None,
            "last_loss": steps[max(steps)]["loss"] if steps else None,
            "max_abs_loss_gap": max((abs(steps[n]["loss"] - reference[n]["loss"]) for n in common), default=None),
            "peak_reserved_gib": max((s["memory_gib"] for s in steps.values()), default=None),
            "median_tps": statistics.median(later) if later else None,
        })
    return rows


def with_loss(config, loss: str):
    """``config`` (a torchtitan ``Trainer.Config`` whose loss is a cross-entropy) with ``loss``."""
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss

    from vparallel_ce.integrations.torchtitan import overrides

    vocab = overrides.cross_entropy_of(config.loss).global_vocab_size
    config.loss = {
        "plain": lambda: CrossEntropyLoss.Config(global_vocab_size=vocab),
        "chunked": lambda: ChunkedLossWrapper.Config(loss_fn=CrossEntropyLoss.Config(global_vocab_size=vocab)),
        "logits": lambda: overrides.vparallel_cross_entropy(config.loss),
        "fused": lambda: overrides.vparallel_linear_cross_entropy(config.loss),
    }[loss]()
    return config


def with_set_timeout() -> None:
    import torch.distributed as dist

    if not hasattr(dist, "set_timeout"):
        def set_timeout(timeout, group=None):
            (group or dist.distributed_c10d._get_default_group()).set_timeout(timeout)

        dist.set_timeout = set_timeout


def train(args: list[str], *, layers: int | None, loss: str, torch211_compat: bool = False) -> None:
    import torch

    stood_in = []
    if torch211_compat:
        import torch211_compat as compat  # beside this script, on sys.path[0]

        stood_in = compat.apply()
    from torchtitan.config import ConfigManager
    from torchtitan.tools.logging import init_logger, logger

    with_set_timeout()
    init_logger()
    if torch211_compat:
        logger.info(f"torchtitan_bench: torch {torch.__version__}, stand-ins for torch >= 2.12: "
                    f"{', '.join(stood_in) or 'none needed'}")
    config = ConfigManager().parse_args(args)
    if layers is not None:
        config.model_spec.model.layers = config.model_spec.model.layers[:layers]
    with_loss(config, loss)
    logger.info(f"torchtitan_bench: {len(config.model_spec.model.layers)} layers, "
                f"loss {type(config.loss).__qualname__}")
    trainer = config.build()
    try:
        trainer.train()
    finally:
        trainer.close()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def main() -> None:
    argv = sys.argv[1:]
    own, rest = (argv[: argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--loss", choices=LOSSES, default="fused")
    p.add_argument("--torch211-compat", action="store_true",
                   help="apply torch211_compat.py first (torch < 2.12, one GPU)")
    p.add_argument("--summarize", nargs="+", metavar="NAME=LOG")
    a = p.parse_args(own)
    if a.summarize:
        runs = {}
        for item in a.summarize:
            name, _, path = item.partition("=")
            with open(path, errors="replace") as f:
                runs[name] = parse_log(f.read())
        for row in summarize(runs):
            print(json.dumps(row))
        return
    train(rest, layers=a.layers, loss=a.loss, torch211_compat=a.torch211_compat)


if __name__ == "__main__":
    main()
