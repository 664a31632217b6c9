"""GPU time per kernel of one forward+backward, next to the event-timed median of the same step.

For each method (``bench_loss.py``'s names, e.g. ``ours:vocab:16``, ``compile``, ``gemm3``) it runs
``--steps`` event-timed steps back to back, then traces ONE more step with the torch profiler and
prints the kernels' busy time, the span from first to last kernel, and the largest kernel families.
The traced step follows the timed ones with no pause (and the profiler is started once before, as
its first start idles the GPU): the H200's clock drops under sustained GEMM load, and a step traced
after a pause ran 15-18% faster per kernel (docs/benchmarks.md, run 9).

    python3 launch/profile_kernels.py --shapes llama3_8b --methods ours:vocab:16,ours:vocab:4,ours:token:1
"""
from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_loss  # noqa: E402


def profile_step(step) -> tuple[float, float, int, list[tuple[str, float, int]]]:
    """``(busy ms, span ms, kernels, [(name, ms, count)] largest first)`` of one traced ``step()``."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    evs = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    total = collections.defaultdict(lambda: [0.0, 0])
    for e in evs:
        total[e.name[:60]][0] += e.device_time_total / 1e3
        total[e.name[:60]][1] += 1
    span = (max(e.time_range.end for e in evs) - min(e.time_range.start for e in evs)) / 1e3
    families = sorted(((k, ms, c) for k, (ms, c) in total.items()), key=lambda x: -x[1])
    return sum(ms for _, ms, _ in families), span, len(evs), families


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="llama3_8b", help="comma list of bench_loss shape names, or NxHxV")
    p.add_argument("--methods", default="ours:vocab:16,ours:token:1", help="comma list of bench_loss methods")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--top", type=int, default=6, help="kernel families to list")
    args = p.parse_args(argv)
    dev = torch.device("cuda")
    profile_step(lambda: torch.ones(1, device=dev))  # the profiler's first start, away from any measurement
    for tag in args.shapes.split(","):
        h, w, t = bench_loss.inputs(bench_loss.shape_of(tag), dev)
        for name in args.methods.split(","):
            fn = bench_loss.make_method(name, dev)
            if fn is None:
                print(f"# {name}: not available here")
                continue
            step = lambda: bench_loss.run_once(fn, h, w, t)  # noqa: E731
            ms = bench_loss.timed(step, dev, args.steps, warmup=3)
            busy, span, count, families = profile_step(step)
            print(f"\n## {tag} {name} ({bench_loss.ours_plan(name, *h.shape, w.shape[0], dev) or '-'}): "
                  f"median {ms:.2f} ms over {args.steps} steps; traced step: busy {busy:.2f} ms, span "
                  f"{span:.2f} ms, {count} kernels")
            for k, kms, c in families[: args.top]:
                print(f"  {kms:8.3f} ms  x{c:<3d} {k}")


if __name__ == "__main__":
    main()
