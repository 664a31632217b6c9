"""Host time of one lm_head + loss call: forward+backward of tiny CUDA inputs (64 tokens, V=4096,
bf16), so the GPU work is nil and the time is what the CPU spends launching it. A call whose host
time exceeds its GPU time leaves the GPU idle (docs/benchmarks.md, run 5).

    python launch/bench_host.py              # on a CUDA machine
    python launch/bench_host.py --profile    # and a cProfile of ours per call (where the host time goes)
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import vparallel_ce  # noqa: E402


def tiny_inputs():
    """``h [64, 64]``, ``w [4096, 64]`` (bf16, requiring grad) and targets on the GPU: GPU work nil."""
    g = torch.Generator(device="cpu").manual_seed(0)
    h = torch.randn(64, 64, generator=g).to("cuda", torch.bfloat16).requires_grad_()
    w = (torch.randn(4096, 64, generator=g) / 8).to("cuda", torch.bfloat16).requires_grad_()
    t = torch.randint(0, 4096, (64,), generator=g).to("cuda")
    return h, w, t


def host_ms(loss, h, w, steps: int = 50) -> float:
    """Host ms per forward+backward of ``loss()`` (which reads ``h`` and ``w``), after 5 warm-ups."""
    def step():
        h.grad = w.grad = None
        loss().backward()

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps * 1e3


def profile(loss, h, w, steps: int = 50, top: int = 25) -> None:
    """cProfile of ``steps`` forward+backward calls (after ``host_ms``'s warm-ups): the functions
    by their own time, then by cumulative time (cProfile inflates Python next to C calls)."""
    host_ms(loss, h, w, steps=1)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        h.grad = w.grad = None
        loss().backward()
    torch.cuda.synchronize()
    prof.disable()
    stats = pstats.Stats(prof)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumtime").print_stats(top)


def main(argv=None, steps: int = 50) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", action="store_true", help="also profile our calls (cProfile)")
    args = p.parse_args(argv)
    h, w, t = tiny_inputs()
    compiled = torch.compile(lambda a, b, c: F.cross_entropy((a @ b.t()).float(), c))
    cases = {
        "plain": lambda: F.cross_entropy((h @ w.t()).float(), t),
        "compile": lambda: compiled(h, w, t),
        "ours chunks=1": lambda: vparallel_ce.linear_cross_entropy(h, w, t, chunks=1),
        "ours chunks=1 check=False": lambda: vparallel_ce.linear_cross_entropy(h, w, t, chunks=1, check=False),
        "ours vocab x16": lambda: vparallel_ce.linear_cross_entropy(h, w, t, chunks=16, schedule="vocab"),
    }
    for name, loss in cases.items():
        print(f"host {name}: {host_ms(loss, h, w, steps):.3f} ms per fwd+bwd", flush=True)
        if args.profile and name.startswith("ours"):
            profile(loss, h, w, steps)


if __name__ == "__main__":
    main()
