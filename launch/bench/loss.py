"""The side-by-side: lm_head + cross-entropy, forward+backward, ours against the usual ways.

For each shape N x H x V (tokens x hidden x vocab; bf16 hidden states and weight, random targets,
mean reduction) and each method it measures

* ``ms``: forward+backward time, median of ``--repeats`` after warm-up (CUDA events; host clock
  on CPU), from an idle GPU; with ``--ahead-ms`` also ``ms_behind``, the same behind that much
  queued GPU work (the training-step case, where host time before the first kernel is hidden),
  the methods taken in turn, one call each per round (``timing.timed_in_rounds``);
* ``peak``: ``max_memory_allocated`` during one forward+backward minus what was allocated before
  it (the resident inputs), so it includes the returned gradients dh and dW (CUDA only);
* ``err``: ``|x - ref| / |ref|`` of the loss, dh and dW against a float64 reference computed in
  token chunks on the same device.

Methods: ``fp32_plain`` (``F.cross_entropy((h @ W.T).float(), t)``), ``bf16_plain``, ``compile``
(fp32_plain under ``torch.compile``), ``torch_lce`` (``F.linear_cross_entropy``, where torch has
it), ``liger`` and ``cce`` (when importable), ``gemm3`` (the three bf16 matmuls alone: the floor of
an exact fused loss), ``kernels`` (our two Triton passes alone over precomputed full logits), and
ours: ``ours:<schedule>:<chunks>`` for the chunk sweep ``--chunks`` x {token, vocab} (the policy
decides where the gradients are made: ``plan`` says ``kept`` / ``fwd`` / ``re``), plus
``ours:token:auto``, ``ours:vocab:auto`` and ``ours:auto:auto`` (the policy's own pick). A suffix
``:unfused`` runs cuBLAS + the row passes where the fused GEMM kernels would run, ``:nocheck``
passes ``check=False`` (no host sync for the target check).

Run from the repository root (the results page's lines: ``launch/bench/results/loss_h200.jsonl``)::

    python -m launch.bench.loss --smoke                          # CPU smoke test
    python -m launch.bench.loss --out loss.jsonl                 # one GPU: the four shapes, every method
    python -m launch.bench.loss --shapes llama3_8b --methods compile,liger,ours:token:1,ours:auto:auto
    python -m launch.bench.report loss.jsonl                     # the tables; launch.bench.plot: the figures
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import time
import traceback

import torch
import torch.nn.functional as F

import vparallel_ce
from launch.bench.timing import sync, time_and_peak, timed_in_rounds
from vparallel_ce import kernels, policy as _policy

SHAPES = {
    "llama3_8b": (8192, 4096, 128256),
    "llama3_8b_tp8": (8192, 4096, 16032),
    "gemma": (8192, 2304, 256000),
    "odd_small": (16384, 768, 32777),
}
SMALL_SHAPES = {"small_a": (512, 256, 8000), "small_odd": (384, 96, 3001)}


def shape_of(name: str) -> tuple[int, int, int]:
    """``(N, H, V)`` of a shape named in SHAPES / SMALL_SHAPES, or given as ``NxHxV``."""
    known = {**SHAPES, **SMALL_SHAPES}
    return known[name] if name in known else tuple(int(x) for x in name.lower().split("x"))


CHUNKS = (1, 2, 4, 8, 16, 32)
PEERS = ("fp32_plain", "bf16_plain", "compile", "torch_lce", "liger", "cce", "gemm3", "kernels")


# ------------------------------------------------------------------------------------------ methods

def _plain_fp32(h, w, t):
    return F.cross_entropy((h @ w.t()).float(), t)


def _plain_bf16(h, w, t):
    return F.cross_entropy(h @ w.t(), t)


def make_method(name: str, device: torch.device):
    """``fn(h, w, t) -> loss`` or None when not available here."""
    if name == "fp32_plain":
        return _plain_fp32
    if name == "bf16_plain":
        return _plain_bf16
    if name == "compile":
        return torch.compile(_plain_fp32, dynamic=False)
    if name == "torch_lce":
        lce = getattr(F, "linear_cross_entropy", None)
        return None if lce is None else (lambda h, w, t: lce(h, w, t))
    if name == "liger":
        if device.type != "cuda":
            return None
        try:
            from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy as liger
        except Exception:
            return None
        return lambda h, w, t: liger(h, w, t)
    if name == "cce":
        if device.type != "cuda":
            return None
        try:
            from cut_cross_entropy import linear_cross_entropy as cce
        except Exception:
            return None
        return lambda h, w, t: cce(h, w, t)
    if name in ("gemm3", "kernels"):
        return name
    if name.startswith("ours:"):
        schedule, chunks, variant = _ours(name)
        check = variant != "nocheck"
        policy = _budget_policy(name)

        def ours(h, w, t):
            return vparallel_ce.linear_cross_entropy(h, w, t, chunks=chunks, schedule=schedule, check=check,
                                                     policy=policy)

        # the kernel settings run_once holds over the forward and its backward alike: unfused is
        # cuBLAS + the row passes where the fused GEMM kernels would run
        ours.kernels = kernels.use(fused=False) if variant == "unfused" else contextlib.nullcontext()
        return ours
    raise ValueError(f"unknown method {name!r}")


def _ours(name: str):
    """``ours:<schedule>:<chunks>[:unfused|:nocheck]`` -> (schedule, chunks, variant);
    ``ours:budget:<MiB>`` is ``chunks="auto"`` with that policy budget (:func:`_budget_policy`)."""
    _, schedule, chunks, *variant = name.split(":")
    if schedule == "budget":
        return "auto", "auto", (variant or [""])[0]
    return schedule, chunks if chunks == "auto" else int(chunks), (variant or [""])[0]


def _budget_policy(name: str):
    """The policy of ``ours:budget:<MiB>`` (the plan the policy picks for that budget), else None."""
    parts = name.split(":")
    return _policy.ChunkPolicy(budget_bytes=int(parts[2]) << 20) if parts[1] == "budget" else None


def ours_plan(name: str, n: int, hdim: int, v: int, device) -> str:
    if not name.startswith("ours:"):
        return ""
    schedule, chunks, variant = _ours(name)
    fused = variant != "unfused" and kernels.fused_applies(device, torch.bfloat16)
    plan = _policy.choose_plan(n, v, 1, hidden_size=hdim, schedule=schedule, chunks=chunks, fused=fused,
                               policy=_budget_policy(name))
    how = "fwd" if plan.grad_in_forward else "kept" if plan.keep_logits else "re"
    return f"{plan.schedule}x{plan.chunks}/{how}"


# ---------------------------------------------------------------------------------------- reference

def reference(h, w, t, dtype=torch.float64, rows=1024):
    """Loss, dh, dW of ``mean CE(h @ w.T, t)`` in ``dtype``, token chunk by token chunk."""
    n = h.shape[0]
    w64 = w.to(dtype)
    dw = torch.zeros_like(w64)
    dh = torch.empty(h.shape, dtype=dtype, device=h.device)
    total = torch.zeros((), dtype=dtype, device=h.device)
    for s in range(0, n, rows):
        hc = h[s : s + rows].to(dtype)
        z = hc @ w64.t()
        lse = torch.logsumexp(z, -1)
        tc = t[s : s + rows]
        total += (lse - z.gather(1, tc[:, None]).squeeze(1)).sum()
        z.sub_(lse[:, None]).exp_()
        z[torch.arange(z.shape[0], device=z.device), tc] -= 1
        z /= n
        dh[s : s + rows] = z @ w64
        dw.addmm_(z.t(), hc)
        del z
    return total / n, dh, dw


def rel(a, ref):
    a = a.to(ref.dtype)
    return float((a - ref).norm() / ref.norm())


# ------------------------------------------------------------------------------------ the timed call

def _gemm3(h, w, t):
    x = h @ w.t()
    dh = x @ w
    dw = x.t() @ h
    return x, dh, dw


_LOGITS = {}


def _kernels(h, w, t):
    """Our two per-chunk kernels alone over the full logits (computed once, outside the timing)."""
    from vparallel_ce import stats

    key = (h.data_ptr(), w.data_ptr())
    if key not in _LOGITS:
        _LOGITS.clear()
        _LOGITS[key] = (h @ w.t()).detach()
    x = _LOGITS[key]
    ops = kernels.ops_for(x)
    spec = stats.LossSpec(w.shape[0])
    lt, owned, valid = stats.local_targets(t, 0, w.shape[0], -100)
    st = ops.local_stats(x, lt, owned, spec)
    coefs = stats.loss_grad_coefs(st.max, torch.log(st.sumexp), valid.float() / t.numel(), spec)
    return ops.grad_logits(x, lt, owned, st.max, coefs, spec)


def run_once(fn, h, w, t):
    h.grad = None
    w.grad = None
    if fn in ("gemm3", "kernels"):
        with torch.no_grad():
            out = (_gemm3 if fn == "gemm3" else _kernels)(h, w, t)
        return None, out
    with getattr(fn, "kernels", contextlib.nullcontext()):  # a method's own kernel settings (ours)
        loss = fn(h, w, t)
        loss.backward()
    return loss, None


def measure(fn, h, w, t, repeats: int, warmup: int, device):
    """``(ms, peak GiB, loss, extra)`` of one method's forward+backward (:func:`time_and_peak`)."""
    ms, peak, (loss, extra) = time_and_peak(lambda: run_once(fn, h, w, t), (h, w), repeats=repeats, warmup=warmup,
                                            device=device)
    return ms, peak, loss, extra


# -------------------------------------------------------------------------------------------- main

def inputs(shape, device):
    """The benchmark's ``h [N, H]`` (unit normal) and ``w [V, H]`` (std ``1/sqrt(H)``, so logits of
    std ~1), bf16 leaves, and uniform targets, from seed 0. GEMM times on the H200 depend on the
    data (its clock follows the power drawn), so every benchmark uses these."""
    n, hdim, v = shape
    g = torch.Generator(device="cpu").manual_seed(0)
    h = torch.randn(n, hdim, generator=g).to(device=device, dtype=torch.bfloat16).requires_grad_()
    w = (torch.randn(v, hdim, generator=g) * (1.0 / math.sqrt(hdim))).to(device=device, dtype=torch.bfloat16)
    w.requires_grad_()
    t = torch.randint(0, v, (n,), generator=g).to(device)
    return h, w, t


def bench_shape(tag, shape, methods, args, device, emit):
    n, hdim, v = shape
    h, w, t = inputs(shape, device)
    sync(device)
    s = time.perf_counter()
    ref_dtype = torch.float64 if not args.ref_fp32 else torch.float32
    ref_loss, ref_dh, ref_dw = reference(h.detach(), w.detach(), t, ref_dtype)
    sync(device)
    print(f"# {tag} N={n} H={hdim} V={v}: {str(ref_dtype).split('.')[-1]} reference in "
          f"{time.perf_counter() - s:.1f}s, loss {float(ref_loss):.5f}", flush=True)
    flops3 = 3 * 2 * n * hdim * v
    made = {}  # name -> the method, None (not available here) or the exception making it raised
    for name in methods:
        try:
            made[name] = make_method(name, device)
        except Exception as e:  # noqa: BLE001 -- recorded with the method's measurement below
            made[name] = e
    ready = {name: fn for name, fn in made.items() if fn is not None and not isinstance(fn, Exception)}
    behind = _behind_in_rounds(ready, h, w, t, args, device) if args.ahead_ms and device.type == "cuda" else {}
    for name in methods:
        rec = dict(shape=tag, N=n, H=hdim, V=v, method=name, plan=ours_plan(name, n, hdim, v, device))
        try:
            fn = made[name]
            if fn is None:
                continue
            if isinstance(fn, Exception):
                raise fn
            ms, peak, loss, _ = measure(fn, h, w, t, args.repeats, args.warmup, device)
            rec.update(ms=ms, peak_gib=peak, tflops=flops3 / (ms * 1e-3) / 1e12)
            if isinstance(behind.get(name), float):  # the training-step case: see timing.timed
                rec.update(ahead_ms=args.ahead_ms, ms_behind=behind[name])
            if loss is not None:
                rec.update(err_loss=abs(float(loss.detach()) - float(ref_loss)) / abs(float(ref_loss)),
                           err_dh=rel(h.grad, ref_dh), err_dw=rel(w.grad, ref_dw))
        except Exception as e:  # OOM, missing kernels, ...: record and go on
            rec.update(error=f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}")
            if args.verbose:
                traceback.print_exc()
        h.grad = None
        w.grad = None
        _LOGITS.clear()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        emit(rec)
    del ref_dh, ref_dw


def _behind_in_rounds(fns: dict, h, w, t, args, device) -> dict:
    """``ms_behind`` of every method (name -> the made method), timed in rounds
    (:func:`launch.bench.timing.timed_in_rounds`): at small shapes a few percent decide the
    comparison, more than the GPU's clock drifts between one method's run and the next one's."""
    steps = {name: (lambda f: lambda: run_once(f, h, w, t))(fn) for name, fn in fns.items()}
    out = timed_in_rounds(steps, (h, w), device, args.repeats, args.warmup, ahead_ms=args.ahead_ms)
    _LOGITS.clear()
    return out


def fmt(x, spec):
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def print_tables(records):
    print("\n## Results (fwd+bwd median ms; peak GiB over resident inputs incl. dh+dW; rel. error vs reference)")
    head = "| shape | method | plan | ms | peak GiB | TFLOP/s (3 GEMMs) | err loss | err dh | err dW |"
    print(head)
    print("|" + "---|" * 9)
    for r in records:
        if "error" in r:
            print(f"| {r['shape']} | {r['method']} | {r['plan']} | {r['error']} | | | | | |")
            continue
        behind = f" ({fmt(r['ms_behind'], '.2f')} behind queued work)" if "ms_behind" in r else ""
        print(f"| {r['shape']} | {r['method']} | {r['plan']} | {fmt(r['ms'], '.2f')}{behind} | "
              f"{fmt(r['peak_gib'], '.3f')} | "
              f"{fmt(r.get('tflops'), '.0f')} | {fmt(r.get('err_loss'), '.1e')} | {fmt(r.get('err_dh'), '.1e')} | "
              f"{fmt(r.get('err_dw'), '.1e')} |")
    # the frontier: chunk count x schedule, per shape
    ours = [r for r in records if r["method"].startswith("ours:") and r["method"].split(":")[2] != "auto"]
    if not ours:
        return
    print("\n## Frontier (ours): ms / peak GiB per chunk count and schedule")
    chunks = sorted({int(r["method"].split(":")[2]) for r in ours})
    print("| shape | schedule | " + " | ".join(f"x{c}" for c in chunks) + " |")
    print("|" + "---|" * (2 + len(chunks)))
    for shape in dict.fromkeys(r["shape"] for r in ours):
        for sched in ("token", "vocab"):
            cells = []
            for c in chunks:
                r = next((r for r in ours if r["shape"] == shape and r["method"] == f"ours:{sched}:{c}"), None)
                if r is None:
                    cells.append("")
                elif "error" in r:
                    cells.append(r["error"].split(":")[0])
                else:
                    cells.append(f"{fmt(r['ms'], '.1f')} / {fmt(r['peak_gib'], '.2f')}")
            print(f"| {shape} | {sched} | " + " | ".join(cells) + " |")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="small shapes (CPU works; a GPU where there is one)")
    p.add_argument("--shapes", default=None, help="comma list of shape names, or NxHxV")
    p.add_argument("--methods", default=None, help="comma list (default: all peers and ours)")
    p.add_argument("--chunks", default=",".join(map(str, CHUNKS)), help="chunk counts of our sweep")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", default=None, help="append one JSON line per measurement to this file")
    p.add_argument("--ahead-ms", type=float, default=0.0,
                   help="also time each method behind this much queued GPU work (ms_behind; see timing.timed)")
    p.add_argument("--ref-fp32", action="store_true", help="fp32 reference instead of fp64")
    p.add_argument("--verbose", action="store_true")
    args = p.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    table = SMALL_SHAPES if args.smoke else SHAPES
    shapes = {s: shape_of(s) for s in args.shapes.split(",")} if args.shapes else table
    chunk_list = [int(c) for c in args.chunks.split(",") if c]
    ours = [f"ours:{s}:{c}" for s in ("token", "vocab") for c in chunk_list]
    ours += ["ours:token:auto", "ours:vocab:auto", "ours:auto:auto"]
    if args.methods:
        methods = []
        for m in args.methods.split(","):
            methods += ours if m == "ours" else [m]
    else:
        methods = [m for m in PEERS if not (device.type == "cpu" and m in ("compile", "gemm3"))] + ours

    fh = open(args.out, "a") if args.out else None
    env = dict(torch=torch.__version__, device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
               kernels=vparallel_ce.kernels.ops_for(torch.empty(1, 1, device=device, dtype=torch.bfloat16)).name)
    try:
        import triton
        env["triton"] = triton.__version__
    except Exception:
        pass
    print("#", json.dumps(env), flush=True)
    records = []

    def emit(rec):
        rec = {**rec, **env}
        records.append(rec)
        msg = rec.get("error") or (f"{rec['ms']:.2f} ms, {rec['peak_gib']:.3f} GiB, err dh "
                                   f"{rec.get('err_dh', float('nan')):.1e} dW {rec.get('err_dw', float('nan')):.1e}")
        print(f"{rec['shape']:>14} {rec['method']:<18} {rec['plan']:<10} {msg}", flush=True)
        if fh:
            fh.write(json.dumps(rec) + "\n")
            fh.flush()

    for tag, shape in shapes.items():
        bench_shape(tag, shape, methods, args, device, emit)
    print_tables(records)
    if fh:
        fh.close()


if __name__ == "__main__":
    main()
