"""Where one call's time goes: a method of the benchmarks, profiled over one forward+backward.

Cases (the benchmarks' own methods, on their own inputs):

* ``loss:<method>`` -- a method of ``launch.bench.loss`` (``ours:auto:auto``, ``ours:token:1``,
  ``compile``, ``liger``, ...) at ``--shape`` (a name of that module or ``NxHxV``);
* ``rollout:set:<K>[:gather|:gemm]`` / ``rollout:full`` -- ``launch.bench.rollout``'s set op (random
  kept ids, the target among them) or the full-vocabulary op, at ``--shape`` ``NxHxV``;
* ``mtp:<method>`` -- a method of ``launch.bench.mtp`` (``ours:1``, ``lce:1``, ``compile:1``, ...);
* ``rl:<method>`` -- a method of ``launch.bench.rl`` (``rl_fused``, ``compile``, ``loss_op``, ...): log-probs
  and entropy at T = 1;
* ``ignored:<op>:<compacted|uncompacted>:<fraction>`` -- ``launch.bench.ignored``'s op (``ce``,
  ``logprobs``, ``distill``) with that fraction of its targets ignored.

After ``--warmup`` calls it times ``--repeats`` calls on the host clock (the GPU synchronised
before and after: what the host and the GPU take together), then profiles one more with
``torch.profiler`` and prints the kernels (or CPU ops) with the most self time, their launch count,
and the totals. ``--trace PATH`` also writes the Chrome trace.

Run from the repository root::

    python -m launch.bench.profile rollout:set:20 --shape 8192x4096x151936
    python -m launch.bench.profile loss:ours:auto:auto --shape llama3_8b --trace auto.json
    python -m launch.bench.profile mtp:ours:1 --shape 8192x4096x128256
    python -m launch.bench.profile ignored:logprobs:compacted:0.5 --shape llama3_8b
    python -m launch.bench.profile rl:rl_fused rl:compile --shape 8192x4096x151936
    python -m launch.bench.profile --smoke      # CPU, a tiny shape of every case
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from launch.bench import ignored, loss, mtp, rl, rollout
from launch.bench.timing import sync
from vparallel_ce.policy import ChunkPolicy

SMOKE_CASES = ("loss:ours:auto:auto", "rollout:set:8", "rollout:full", "mtp:ours:1", "ignored:logprobs:compacted:0.5",
               "rl:rl_fused")
SMOKE_SHAPE = "64x32x500"


def make_call(case: str, shape: tuple[int, int, int], device: torch.device):
    """A no-argument function running one forward+backward of ``case`` at ``shape``."""
    kind, _, method = case.partition(":")
    n, hd, v = shape
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator().manual_seed(0)
    if kind == "loss":
        fn = loss.make_method(method, device)
        h, w, t = loss.inputs(shape, device)
        return lambda: loss.run_once(fn, h, w, t)
    if kind == "rollout":
        h = (torch.randn(n, hd, generator=g) / 2).to(device, dtype).requires_grad_()
        w = (torch.randn(v, hd, generator=g) / hd**0.5 * 4).to(device, dtype).requires_grad_()
        t = torch.randint(0, v, (n,), generator=g)
        adv = torch.randn(n, generator=g).to(device)
        parts = method.split(":")
        ids, fn = None, rollout.method_full
        if parts[0] == "set":
            ids = rollout.make_support(t, v, int(parts[1]), g).to(device)
            fn = rollout.set_in_mode(parts[2]) if len(parts) > 2 else rollout.method_set
        t = t.to(device)
        return lambda: fn(h, w, t, ids, adv).backward()
    if kind == "mtp":
        depths = int(method.split(":")[1])
        fn = mtp.make_method(method, device)
        w = (torch.randn(v, hd, generator=g) / hd**0.5).to(device, dtype).requires_grad_()
        labels = torch.randint(0, v, (1, n), generator=g).to(device)
        positions = torch.arange(n).reshape(1, n).to(device)
        hs = [torch.randn(1, n, hd, generator=g).to(device, dtype).requires_grad_() for _ in range(depths + 1)]
        n_main = (labels != -100).sum()
        return lambda: fn(hs, w, labels, positions, n_main).backward()
    if kind == "ignored":
        op, how, frac = method.split(":")
        inp = ignored._inputs(n, hd, v, device, dtype)
        target = ignored._target(n, v, float(frac), False, device)
        return ignored._step(op, inp, target, ChunkPolicy(compact=how == "compacted"))
    if kind == "rl":
        fn, (h, w, t, adv) = rl.FNS[method], rl.inputs(shape, device, dtype)
        return lambda: rl.run_once(fn, h, w, t, adv, 1.0, "auto")
    raise ValueError(f"unknown case {case!r} (loss:, rollout:, mtp:, ignored:, rl:)")


def profile_case(case: str, shape: tuple[int, int, int], device: torch.device, *, repeats: int, warmup: int,
                 top: int, trace: str | None) -> dict:
    """Print the case's table; return its record (host ms a call, GPU busy ms, launches, top ops)."""
    call = make_call(case, shape, device)
    for _ in range(warmup):
        call()
    sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        call()
    sync(device)
    host_ms = (time.perf_counter() - start) / repeats * 1e3
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        call()
        sync(device)
    if trace:
        prof.export_chrome_trace(trace)
    events = prof.key_averages()
    # the device-time field was renamed across torch versions
    key = "self_cpu_time_total"
    if device.type == "cuda":
        key = next(k for k in ("self_device_time_total", "self_cuda_time_total") if hasattr(events[0], k))
    print(f"== {case} at {'x'.join(map(str, shape))} on {device}: {host_ms:.3f} ms a call "
          f"(host clock, mean of {repeats})")
    record = {"case": case, "shape": "x".join(map(str, shape)), "device": str(device), "host_ms": host_ms}
    if device.type == "cuda":
        kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        record["gpu_ms"] = sum(e.self_device_time_total for e in kernels) / 1e3
        record["launches"] = sum(e.count for e in kernels)
        print(f"   GPU busy {record['gpu_ms']:.3f} ms in {record['launches']} kernel launches")
    ranked = sorted(events, key=lambda e: getattr(e, key), reverse=True)[:top]
    record["top"] = [(e.key, getattr(e, key) / 1e3, e.count) for e in ranked]
    print(events.table(sort_by=key, row_limit=top, max_name_column_width=70))
    return record


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("cases", nargs="*", help="loss:<method>, rollout:set:<K>[:mode], mtp:<method>, "
                                            "ignored:<op>:<compacted|uncompacted>:<fraction>, rl:<method>")
    p.add_argument("--shape", default="llama3_8b", help="a name of launch.bench.loss or NxHxV")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--top", type=int, default=15, help="rows of the table")
    p.add_argument("--trace", default=None, help="a Chrome trace of the profiled call (one case)")
    p.add_argument("--smoke", action="store_true", help="CPU, a tiny shape, every kind of case")
    p.add_argument("--out", default=None, help="append one JSON line per case (host ms, GPU ms, top ops)")
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    cases = args.cases or (SMOKE_CASES if args.smoke else ())
    if not cases:
        p.error("name at least one case")
    shape = loss.shape_of(SMOKE_SHAPE if args.smoke else args.shape)
    for case in cases:
        record = profile_case(case, shape, device, repeats=1 if args.smoke else args.repeats,
                              warmup=1 if args.smoke else args.warmup, top=args.top, trace=args.trace)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(record) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
