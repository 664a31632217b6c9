"""The fused lm_head GEMM + cross-entropy kernels (``vparallel_ce.kernels.fused_linear``) against
cuBLAS + our Triton row passes, per kernel, at the lm_head shapes of ``launch.bench.loss``.

Per shape N x H x V (bf16 ``h [N, H]``, ``w [V, H]``, uniform targets, 3% ignored, mean reduction's
``gscale``) it times, median of ``--repeats`` after warm-up (CUDA events):

* ``a_cublas``: ``F.linear(h, w)`` alone;
* ``b_cublas+stats``: ``F.linear`` + ``triton_ce.local_stats`` (the current statistics path);
* ``c_fused_stats[cfg]``: ``fused_linear.linear_stats`` (logits never written);
* ``d_fused_keep[cfg]``: ``fused_linear.linear_stats_keep`` (logits written by the same GEMM);
* ``e_cublas+grad``: ``F.linear`` + ``triton_ce.grad_logits`` (the current gradient path);
* ``f_fused_grad[cfg]``: ``fused_linear.linear_grad_logits`` (logits recomputed, never written);

each fused kind for every candidate :class:`TileConfig` of ``--set`` (compiled once: the kernels are
not specialised on the shape, so one binary per candidate serves every shape). Run the sets in
separate processes: a kernel that faults or hangs then costs only its own set.
TFLOP/s counts one ``2 N H V`` GEMM. Errors are ``max |x - ref| / max |ref|`` against an fp32
reference (fp32 GEMM, no TF32; lse and target logit for the statistics, dx for the gradients), and
against the torch path on the bf16 logits (``vs_torch``). ``--options`` adds a check of every loss
option (bias, softcap, label smoothing, z-loss) at a medium shape with the default configs. The
table at the end has the best candidate per kind and shape, and the candidate with the best
geometric-mean time over the shapes.

Run from the repository root (the results page's lines: ``launch/bench/results/fused_h200.jsonl``,
the ``sweep`` set's ``fused_sweep_h200.jsonl``)::

    python -m launch.bench.fused --smoke                                   # CPU smoke test (interpreter, fp32)
    python -m launch.bench.fused --set tiles --options --out tiles.jsonl   # one Hopper GPU
    python -m launch.bench.fused --set persistent --no-baselines --shapes llama3_8b gemma --out pers.jsonl
    python -m launch.bench.fused --set sweep --shapes 8192x4096x8064 llama3_8b 8192x2304x8064 --out sweep.jsonl
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import asdict

if "--smoke" in sys.argv:  # before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from launch.bench.loss import SHAPES, shape_of  # noqa: E402  (the lm_head shapes of the side-by-side)
from launch.bench.timing import timed  # noqa: E402
from vparallel_ce import stats  # noqa: E402
from vparallel_ce.kernels import fused_linear as fl  # noqa: E402
from vparallel_ce.kernels import triton_ce as tc  # noqa: E402

SMALL_SHAPES = {"small_a": (64, 32, 300), "small_odd": (37, 24, 129)}
OPTIONS_SHAPE = (2048, 1024, 50257)
C = fl.TileConfig

# Candidate configs per kind and set (see docs/kernels.md for what each knob does). "tiles" first:
# the persistent and warp-specialised schedules run in their own processes (a hang costs only those).
CANDIDATES = {
    "tiles": {
        "stats": [C(), C(num_stages=4), C(block_n=128, num_warps=4)],
        "keep": [C(), C(split_store=True, num_stages=4)],
        "grad": [C(), C(split_store=True, num_stages=4), C(block_n=128, num_warps=4, split_store=True)],
    },
    "persistent": {
        "stats": [C(schedule="persistent")],
        "keep": [],
        "grad": [C(schedule="persistent", split_store=True, num_stages=4)],
    },
    "ws": {
        "stats": [C(schedule="ws", num_warps=4)],
        "keep": [],
        "grad": [C(schedule="ws", num_warps=4, block_n=128, num_stages=4, tma_store=False)],
    },
    # around the persistent defaults: grouping, stages, tile shape, a deeper K step
    "sweep": {
        "stats": [C(schedule="persistent", **kw) for kw in (
            {}, dict(group_m=4), dict(group_m=16), dict(num_stages=4), dict(block_m=256, block_n=128),
            dict(block_k=128, num_stages=2))],
        "keep": [],
        "grad": [C(schedule="persistent", split_store=True, **kw) for kw in (
            dict(num_stages=4), dict(num_stages=4, group_m=4), dict(num_stages=4, group_m=16), dict(num_stages=3),
            dict(num_stages=4, block_m=256, block_n=128), dict(block_k=128, num_stages=2))],
    },
}
SMALL_CANDIDATES = {k: [C(block_m=16, block_n=32, block_k=16, num_stages=2, num_warps=4, schedule=s)
                        for s in ("tiles", "persistent", "ws")] for k in ("stats", "keep", "grad")}


def cfg_name(cfg: fl.TileConfig) -> str:
    extra = "".join([" split" if cfg.split_store else "", f" x{cfg.ctas_per_sm}/SM" if cfg.ctas_per_sm > 1 else "",
                     "" if cfg.tma_store else " ptrstore",
                     "" if cfg.tma else " ptrload", f" g{cfg.group_m}" if cfg.group_m != 8 else ""])
    return (f"{cfg.schedule} {cfg.block_m}x{cfg.block_n}x{cfg.block_k} s{cfg.num_stages} w{cfg.num_warps}"
            + extra)


# ------------------------------------------------------------------------------------------- timing

def rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.float(), ref.float()
    return float((x - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def lse_of(st: stats.ChunkStats) -> torch.Tensor:
    return st.max + torch.log(st.sumexp)


def stats_err(st, ref) -> float:
    return max(rel(lse_of(st), lse_of(ref)), rel(st.target, ref.target), rel(st.sum, ref.sum) if ref.sum.any() else 0.0)


# ------------------------------------------------------------------------------------------ running

def problem(n, hdim, v, dtype, device, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    h = torch.randn(n, hdim, generator=g).to(device=device, dtype=dtype)
    w = (torch.randn(v, hdim, generator=g) / math.sqrt(hdim)).to(device=device, dtype=dtype)
    t = torch.randint(0, v, (n,), generator=g)
    t[torch.rand(n, generator=g) < 0.03] = -100
    return h, w, t.to(device)


def bench_shape(name, shape, cands, args, device, dtype, out):
    n, hdim, v = shape
    flop = 2.0 * n * hdim * v
    h, w, t = problem(n, hdim, v, dtype, device)
    spec = stats.LossSpec(v)
    lt, own, valid = stats.local_targets(t, 0, v, -100)
    gscale = valid.float() / valid.sum()
    # fp32 reference: exact logits (no TF32), their statistics and gradient
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    x32 = F.linear(h.float(), w.float())
    torch.backends.cuda.matmul.allow_tf32 = tf32
    ref = stats.local_stats(x32, lt, own, spec)
    lse = lse_of(ref)
    # the gradient pass's inputs: the global max as the shift and the loss' coefficients
    shift, coefs = ref.max, stats.loss_grad_coefs(ref.max, lse - ref.max, gscale, spec)
    dref = stats.grad_logits(x32, lt, own, shift, coefs, spec, out_dtype=torch.float32)
    del x32
    xb = F.linear(h, w)
    torch_st = stats.local_stats(xb, lt, own, spec)
    torch_d = stats.grad_logits(xb, lt, own, shift, coefs, spec)
    del xb
    rows = []

    def record(variant, cfg, ms, err, err_torch, kind):
        row = dict(shape=name, n=n, h=hdim, v=v, variant=variant, kind=kind,
                   config=None if cfg is None else asdict(cfg), config_name="" if cfg is None else cfg_name(cfg),
                   ms=ms, tflops=flop / ms / 1e9, err=err, err_vs_torch=err_torch)
        rows.append(row)
        out.write(json.dumps(row) + "\n")
        out.flush()
        print(f"{name:14s} {variant:16s} {row['config_name']:40s} {ms:8.3f} ms {row['tflops']:6.0f} TFLOP/s"
              f"  err {err:.1e} (vs torch {err_torch:.1e})", flush=True)

    def run(variant, kind, cfg, fn, check):
        print(f"{name:14s} {variant:16s} {'' if cfg is None else cfg_name(cfg):40s} ...", flush=True)
        try:
            res = fn()
            err, err_t = check(res)
            del res
            ms = timed(fn, device, args.repeats, args.warmup)
        except Exception as e:
            print(f"{name:14s} {variant:16s} {'' if cfg is None else cfg_name(cfg):40s} FAILED {type(e).__name__}: "
                  f"{str(e)[:200]}", flush=True)
            return
        record(variant, cfg, ms, err, err_t, kind)

    def stats_check(st):
        return stats_err(st, ref), stats_err(st, torch_st)

    def grad_check(d):
        return rel(d, dref), rel(d, torch_d)

    base = not args.no_baselines
    if base:
        run("a_cublas", "gemm", None, lambda: F.linear(h, w), lambda x: (0.0, 0.0))
        run("b_cublas+stats", "stats", None, lambda: tc.local_stats(F.linear(h, w), lt, own, spec), stats_check)
    for cfg in cands["stats"]:
        run("c_fused_stats", "stats", cfg, lambda: fl.linear_stats(h, w, None, lt, own, spec, config=cfg), stats_check)
    xb = F.linear(h, w)
    for cfg in cands["keep"]:
        run("d_fused_keep", "keep", cfg, lambda: fl.linear_stats_keep(h, w, None, lt, own, spec, config=cfg),
            lambda r: (max(stats_err(r[0], ref), rel(r[1], xb)), stats_err(r[0], torch_st)))
    del xb
    if base:
        run("e_cublas+grad", "grad", None, lambda: tc.grad_logits(F.linear(h, w), lt, own, shift, coefs, spec),
            grad_check)
    for cfg in cands["grad"]:
        run("f_fused_grad", "grad", cfg,
            lambda: fl.linear_grad_logits(h, w, None, lt, own, shift, coefs, spec, config=cfg), grad_check)
    del dref, torch_d
    return rows


def options_check(device, dtype, small: bool) -> list[str]:
    """Every loss option with a bias, default configs, against the torch path (bf16 logits) and fp32."""
    n, hdim, v = (45, 24, 301) if small else OPTIONS_SHAPE
    h, w, t = problem(n, hdim, v, dtype, device, seed=1)
    b = (torch.randn(v) * 0.5).to(device=device, dtype=dtype)
    offset, vocab = 3 * v, 8 * v  # a shard in the middle of a larger vocab
    t = torch.where(t >= 0, t + offset, t)
    t[: n // 4] = torch.randint(0, vocab, (n // 4,), device=device)  # some targets on other shards
    spec = stats.LossSpec(vocab, -100, 0.1, 1e-4, 30.0)
    lt, own, valid = stats.local_targets(t, offset, v, -100)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    x32 = F.linear(h.float(), w.float(), b.float())
    torch.backends.cuda.matmul.allow_tf32 = tf32
    ref = stats.local_stats(x32, lt, own, spec)
    lse = lse_of(ref) + 0.7
    gscale = valid.float() * 0.01
    shift, coefs = ref.max, stats.loss_grad_coefs(ref.max, lse - ref.max, gscale, spec)
    dref = stats.grad_logits(x32, lt, own, shift, coefs, spec, out_dtype=torch.float32)
    xb = F.linear(h, w, b)
    lines = []
    st = fl.linear_stats(h, w, b, lt, own, spec)
    torch_err = stats_err(stats.local_stats(xb, lt, own, spec), ref)
    lines.append(f"stats: err {stats_err(st, ref):.1e}, torch path {torch_err:.1e}")
    st, x = fl.linear_stats_keep(h, w, b, lt, own, spec)
    lines.append(f"keep: err {stats_err(st, ref):.1e}, logits vs F.linear {rel(x, xb):.1e}")
    d = fl.linear_grad_logits(h, w, b, lt, own, shift, coefs, spec)
    dt = stats.grad_logits(xb, lt, own, shift, coefs, spec)
    lines.append(f"grad: err {rel(d, dref):.1e}, torch path {rel(dt, dref):.1e}, ignored rows zero: "
                 f"{bool((d[~valid] == 0).all())}")
    return lines


def geomean(xs):
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def summary(rows, shapes):
    print("\n## best candidate per kind and shape (ms / TFLOP/s; speed-up of fused over cuBLAS + pass)")
    print("| shape | a cuBLAS | b cuBLAS+stats | c fused stats | d fused keep | e cuBLAS+grad | f fused grad "
          "| c/b | f/e |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in shapes:
        r = [x for x in rows if x["shape"] == name]
        best = {}
        for x in r:
            if x["variant"] not in best or x["ms"] < best[x["variant"]]["ms"]:
                best[x["variant"]] = x

        def cell(k):
            return f"{best[k]['ms']:.2f} / {best[k]['tflops']:.0f}" if k in best else "-"

        def ratio(a, b):
            return f"{best[b]['ms'] / best[a]['ms']:.2f}x" if a in best and b in best else "-"

        print(f"| {name} | {cell('a_cublas')} | {cell('b_cublas+stats')} | {cell('c_fused_stats')} | "
              f"{cell('d_fused_keep')} | {cell('e_cublas+grad')} | {cell('f_fused_grad')} | "
              f"{ratio('c_fused_stats', 'b_cublas+stats')} | {ratio('f_fused_grad', 'e_cublas+grad')} |")
    for name in shapes:
        r = [x for x in rows if x["shape"] == name]
        print(f"  {name}: " + "; ".join(
            f"{v}: {min((x for x in r if x['variant'] == v), key=lambda x: x['ms'])['config_name']}"
            for v in ("c_fused_stats", "d_fused_keep", "f_fused_grad") if any(x["variant"] == v for x in r)))
    print("\n## one config per kind for every shape (best geometric mean)")
    for v in ("c_fused_stats", "d_fused_keep", "f_fused_grad"):
        by_cfg = {}
        for x in rows:
            if x["variant"] == v:
                by_cfg.setdefault(x["config_name"], {})[x["shape"]] = x
        full = {k: d for k, d in by_cfg.items() if len(d) == len(shapes)}
        if not full:
            continue
        k, d = min(full.items(), key=lambda kv: geomean([x["ms"] for x in kv[1].values()]))
        print(f"  {v}: {k}: " + ", ".join(f"{s} {d[s]['ms']:.2f} ms / {d[s]['tflops']:.0f}" for s in shapes))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="CPU smoke test: tiny shapes, fp32, Triton interpreter")
    p.add_argument("--set", default="tiles", choices=[*CANDIDATES, "all"], help="which candidate configs")
    p.add_argument("--shapes", nargs="*", default=None)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--no-baselines", action="store_true", help="skip the cuBLAS rows (a, b, e)")
    p.add_argument("--options", action="store_true", help="also check every loss option (default configs)")
    p.add_argument("--out", default=None, help="append one JSON line per measurement to this file")
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    shapes = SMALL_SHAPES if args.smoke else SHAPES
    if args.shapes:  # names of launch.bench.loss's shapes, or N x H x V
        shapes = {k: shapes[k] if k in shapes else shape_of(k) for k in args.shapes}
    if args.smoke:
        cands = SMALL_CANDIDATES
        args.repeats, args.warmup = min(args.repeats, 2), 1
    else:
        sets = list(CANDIDATES) if args.set == "all" else [args.set]
        cands = {k: [c for s in sets for c in CANDIDATES[s][k]] for k in ("stats", "keep", "grad")}
    if cuda:
        import triton

        print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}", flush=True)
    out = open(args.out, "a") if args.out else open(os.devnull, "w")
    rows = []
    for name, shape in shapes.items():
        rows += bench_shape(name, shape, cands, args, device, dtype, out)
        if cuda:
            torch.cuda.empty_cache()
    if args.options or args.smoke:
        print("\n## every loss option (bias, softcap 30, smoothing 0.1, z-loss 1e-4), default configs, "
              f"{'small' if args.smoke else 'x'.join(map(str, OPTIONS_SHAPE))}")
        for line in options_check(device, dtype, args.smoke):
            print("  " + line)
            out.write(json.dumps(dict(options_check=line)) + "\n")
    summary(rows, list(shapes))
    out.close()


if __name__ == "__main__":
    main()
