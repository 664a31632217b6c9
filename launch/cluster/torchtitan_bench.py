#!/usr/bin/env python
"""torchtitan's own trainer on one of its llama3 flavors cut to fewer layers, and a summary of runs.

    torchrun --nproc-per-node 1 launch/cluster/torchtitan_bench.py --flavor 8B --layers 12 -- <torchtitan.train args>
    python launch/cluster/torchtitan_bench.py --summarize llama3=A.log llama3_vparallel=B.log ... > results.jsonl

Train: registers the flavor ``{flavor}_{layers}layers`` (the flavor's TransformerModelArgs with
``n_layers`` replaced) in torchtitan's llama3 flavors -- which the vparallel specs share -- imports
vparallel_ce.integrations.torchtitan, adds ``--model.flavor`` and runs ``torchtitan.train.main``.

Summarize: reads torchtitan's log lines (``step: N  loss: X  grad_norm: G  memory: M GiB(P%)  tps: T``)
and prints one JSON line per run: step-1 loss, the max abs loss gap to the first run over their
common steps, peak reserved memory and the median tps of steps >= 2 (step 1 includes warm-up).
launch/cluster/torchtitan_gpu.sh runs the three specs and this summary.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import statistics
import sys

LINE_RE = re.compile(r"step:\s*(\d+)\s+loss:\s*([-0-9.]+)\s+grad_norm:\s*([-0-9.]+)\s+memory:\s*([0-9.]+)GiB"
                     r"\(([0-9.]+)%\)\s+tps:\s*([0-9,]+)")


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


def add_flavor(flavor: str, layers: int) -> None:
    from torchtitan.models import llama3

    llama3.llama3_args[f"{flavor}_{layers}layers"] = dataclasses.replace(llama3.llama3_args[flavor], n_layers=layers)


def main() -> None:
    argv = sys.argv[1:]
    own, rest = (argv[: argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--flavor", default="8B")
    p.add_argument("--layers", type=int, default=None)
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
    flavor = a.flavor if a.layers is None else f"{a.flavor}_{a.layers}layers"
    # before torchtitan is imported: its ConfigManager.parse_args defaults to sys.argv[1:] as it was then
    sys.argv = [sys.argv[0], *rest, "--model.flavor", flavor]
    if a.layers is not None:
        add_flavor(a.flavor, a.layers)
    import vparallel_ce.integrations.torchtitan  # noqa: F401  (registers the specs)
    from torchtitan.train import Trainer, main as train_main

    train_main(Trainer)


if __name__ == "__main__":
    main()
