"""Versions of vparallel_ce side by side in ONE process, interleaved with ``torch.compile``.

A difference of a few percent at a host-bound shape (the TP=8 shard: ~5 ms of GPU work, ~2 ms of
host time per call) is below what two separate processes on the same card reproduce, so this
imports this checkout's package and an older copy of it together and measures them in rounds,
rotating the order, against ``torch.compile`` of the plain loss in the same process.

    git archive <old-commit> vparallel_ce | tar -x -C /tmp/old      # here, then carry /tmp/old
    python launch/bench_ab.py --old /tmp/old --shapes llama3_8b_tp8 --timeline
    python launch/bench_ab.py --old base=/tmp/old --old variant=/tmp/variant --ahead-ms 3

Per shape and method: the median over ``--rounds`` rounds of ``bench_loss``'s measure (median of
10 fwd+bwd after 2 warm-ups, from an idle GPU) and the ratio to compile; with ``--ahead-ms``
also the same measure behind that much queued GPU work (``bench_loss.timed``: the training-step
case, where the host is ahead of the GPU when the loss is called). ``--timeline``: a CUDA-only
profile of one step per method (a spin kernel marks the step start): the GPU's idle time before
its first kernel, its busy time, the idle gaps and the largest of them, and when the target
check's span kernel ran against the first kernel. Then the host time per fwd+bwd of tiny inputs
(GPU work nil), interleaved the same way.
"""

from __future__ import annotations

import argparse
import importlib
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import bench_host  # noqa: E402
import bench_loss  # noqa: E402  (puts this checkout first on sys.path and imports vparallel_ce)
import vparallel_ce as new  # noqa: E402


def import_old(path: Path, name: str = "old"):
    """The package at ``path/vparallel_ce`` imported as ``vparallel_ce_<name>`` (its imports are
    relative, so a renamed copy is a second, independent package)."""
    tmp = Path(tempfile.mkdtemp())
    shutil.copytree(path / "vparallel_ce", tmp / f"vparallel_ce_{name}")
    sys.path.insert(0, str(tmp))
    return importlib.import_module(f"vparallel_ce_{name}")


def methods(olds: dict) -> dict:
    """``compile`` and, for this checkout (``new``) and each named older copy, ``auto``,
    ``chunks=1`` and ``chunks=1,check=False``."""
    plain = torch.compile(lambda h, w, t: F.cross_entropy((h @ w.t()).float(), t), dynamic=False)
    found = {"compile": lambda h, w, t: plain(h, w, t)}
    for tag, mod in (("new", new), *olds.items()):
        found[f"{tag}:auto"] = lambda h, w, t, m=mod: m.linear_cross_entropy(h, w, t)
        found[f"{tag}:chunks=1"] = lambda h, w, t, m=mod: m.linear_cross_entropy(h, w, t, chunks=1)
        found[f"{tag}:chunks=1,check=False"] = lambda h, w, t, m=mod: m.linear_cross_entropy(h, w, t, chunks=1,
                                                                                             check=False)
    return found


def timeline(fn, h, w, t, steps: int = 5) -> dict:
    """GPU idle before the first kernel, busy time and idle gaps of one fwd+bwd (median step)."""
    from torch.profiler import ProfilerActivity, profile

    def step():
        h.grad = w.grad = None
        fn(h, w, t).backward()

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            torch.cuda.synchronize()
            torch.cuda._sleep(20000)  # the marker: a spin kernel right before the step
            step()
            torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())["traceEvents"]
    events = sorted((e for e in trace if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")), key=lambda e: e["ts"])
    runs, cur = [], None
    for e in events:
        if "spin" in e["name"]:
            cur = []
            runs.append((e, cur))
        elif cur is not None:
            cur.append(e)
    rows = []
    for marker, body in runs:
        if not body:
            continue
        t0, end = marker["ts"] + marker["dur"], body[-1]["ts"] + body[-1]["dur"]
        busy = sum(e["dur"] for e in body)
        gaps = sorted(((b["ts"] - a["ts"] - a["dur"], a["name"][:32], b["name"][:32]) for a, b in zip(body, body[1:])),
                      reverse=True)
        row = dict(span_us=round(end - t0), before_first_us=round(body[0]["ts"] - t0), busy_us=round(busy),
                   kernels=len(body), largest_gaps=[(round(g), a, b) for g, a, b in gaps[:3]])
        check = [e for e in body if "span_kernel" in e["name"]]
        if check:  # the target check's kernel against the first kernel's run (us from its start)
            first = body[0]
            row["check_kernel"] = dict(start=round(check[0]["ts"] - first["ts"]),
                                       end=round(check[0]["ts"] + check[0]["dur"] - first["ts"]),
                                       first_kernel=first["name"][:32], first_kernel_us=round(first["dur"]))
        rows.append(row)
    rows.sort(key=lambda r: r["span_us"])
    return rows[len(rows) // 2] if rows else {}


def host_ms_median(fn, rounds: int) -> float:
    """``bench_host``'s host ms per fwd+bwd of its tiny inputs, median over ``rounds``."""
    h, w, t = bench_host.tiny_inputs()
    return statistics.median(bench_host.host_ms(lambda: fn(h, w, t), h, w) for _ in range(rounds))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--old", action="append", default=[],
                   help="a folder holding an older vparallel_ce/ package, as PATH or NAME=PATH (repeatable)")
    p.add_argument("--shapes", default="llama3_8b_tp8")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--ahead-ms", type=float, default=0.0,
                   help="also time each method behind this much queued GPU work (bench_loss.timed)")
    p.add_argument("--timeline", action="store_true")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs CUDA")
        return 1
    dev = torch.device("cuda")
    olds = {}
    for spec in args.old:
        name, _, path = spec.rpartition("=")
        olds[name or "old"] = import_old(Path(path), name or "old")
    fns = methods(olds)
    names = list(fns)
    rows = []
    for tag in args.shapes.split(","):
        h, w, t = bench_loss.inputs(bench_loss.shape_of(tag), dev)
        runs, peaks, ahead = ({k: [] for k in names} for _ in range(3))
        for r in range(args.rounds):
            for k in names[r % len(names):] + names[: r % len(names)]:  # rotate the order each round
                ms, peak, _, _ = bench_loss.measure(fns[k], h, w, t, 10, 2, dev)
                runs[k].append(ms)
                peaks[k].append(peak)
                if args.ahead_ms:
                    ahead[k].append(bench_loss.measure(fns[k], h, w, t, 10, 2, dev, ahead_ms=args.ahead_ms)[0])
        for k in names:
            rec = dict(shape=tag, method=k, ms=statistics.median(runs[k]), peak_gib=round(max(peaks[k]), 4),
                       rounds=[round(x, 3) for x in runs[k]])
            if args.ahead_ms:
                rec.update(ahead_ms=args.ahead_ms, ms_behind=statistics.median(ahead[k]),
                           rounds_behind=[round(x, 3) for x in ahead[k]])
            if args.timeline:
                rec["timeline"] = timeline(fns[k], h, w, t)
            rows.append(rec)
            print(json.dumps(rec), flush=True)
    host = {k: host_ms_median(fns[k], args.rounds) for k in names}
    print("\n| shape | method | ms (median of rounds) | vs compile | behind queued work: ms | vs compile | peak GiB |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        base = next(x for x in rows if x["shape"] == r["shape"] and x["method"] == "compile")
        behind = (f"{r['ms_behind']:.3f} | {r['ms_behind'] / base['ms_behind']:.3f}x" if args.ahead_ms
                  else "- | -")
        print(f"| {r['shape']} | {r['method']} | {r['ms']:.3f} | {r['ms'] / base['ms']:.3f}x | {behind} "
              f"| {r['peak_gib']:.3f} |")
    print("\n| method | host ms per fwd+bwd (64 tokens, V=4096) |")
    print("|---|---|")
    for k, ms in host.items():
        print(f"| {k} | {ms:.3f} |")
    if args.json:
        with open(args.json, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
            f.write(json.dumps({"host_ms": host}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
