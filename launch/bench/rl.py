"""RL token log-probs + entropy, forward+backward: ``linear_token_logprobs`` against the loss op and the
gathered computation, on one device (TP=1). The results page's lines: ``launch/bench/results/rl_h200.jsonl``.

For each shape N x H x V (tokens x hidden x vocab; bf16 hidden states and weight, random targets and
advantages) and each method it measures

* ``ms``: forward+backward time, median of ``--repeats`` after ``--warmup`` (CUDA events; host clock
  on CPU), the methods taken in turn, one call each per round (``timing.timed_in_rounds``);
* ``peak``: ``max_memory_allocated`` during one more forward+backward minus what was allocated
  before it (the resident inputs), so it includes the returned dh and dW (CUDA only);
* ``err``: max |x - ref| / max |ref| of logp, entropy, dh and dW against the gathered computation in
  float64 (``--ref-dtype``), token chunk by token chunk on the same device.

Methods:

* ``rl_fused`` -- ``logp, ent = vparallel_ce.linear_token_logprobs(h, W, t, with_entropy=True)``,
  loss ``-(adv * logp).mean() - 0.01 * ent.mean()``;
* ``rl_fused:fp32`` -- the same with ``logits_dtype=torch.float32`` (the lm_head GEMM's fp32 result,
  never rounded to bf16); ``rl_fused:invariant`` -- the same with ``batch_invariant=True``;
* ``loss_op`` -- ``vparallel_ce.linear_cross_entropy(h, W, t)`` (mean), the op the target is set
  against: ``rl_fused`` should take <= 1.1x its time at the same peak memory; ``loss_op:invariant``
  -- the same with ``batch_invariant=True``. A ``:invariant`` method's record also has
  ``x_default_time``, its time over the same method's without the option;
* ``gathered`` -- the full logits: ``(h @ W.T).float() / T``, ``log_softmax``, gather, entropy
  ``-(p * log p).sum(-1)``, the same loss (what an RL trainer does without a fused op);
  ``compile`` -- that under ``torch.compile``;
* ``verl`` -- verl's fused linear log-prob/entropy Triton kernel
  (``verl.utils.kernel.linear_cross_entropy``, CUDA only), the same loss. With verl installed it is
  imported as usual; ``--verl-path DIR`` loads just its two kernel files from an unpacked wheel
  (``unzip verl-*.whl 'verl/utils/kernel/*' -d DIR``), without verl's other dependencies.

Run from the repository root (the second line: ``batch_invariant=True`` against the default at
Qwen3-8B's lm_head and its TP=8 shard)::

    python -m launch.bench.rl --out rl.jsonl   # one GPU, bf16: 8192x4096x128256 and 8192x4096x16032
    python -m launch.bench.rl --shapes qwen3_8b,qwen3_8b_tp8 \
        --methods rl_fused,rl_fused:invariant,loss_op,loss_op:invariant --out invariant.jsonl
    python -m launch.bench.rl --smoke          # CPU, tiny shapes (tests/test_bench_rl.py)
    python -m launch.bench.rl --shapes qwen3_8b,qwen3_8b_tp8,qwen3_8b_32k,qwen3_8b_tp8_32k \
        --methods rl_fused,rl_fused:fp32,rl_fused:invariant,verl,compile,gathered --verl-path /tmp/verl
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import traceback

import torch

import vparallel_ce
from launch.bench.timing import peak_of, sync, timed_in_rounds

SHAPES = {"llama3_8b": (8192, 4096, 128256), "llama3_8b_tp8": (8192, 4096, 16032)}
# Qwen3-8B: vocab 151936, its TP=8 shard 18992; 8k and 32k tokens
MORE_SHAPES = {"qwen3_8b": (8192, 4096, 151936), "qwen3_8b_tp8": (8192, 4096, 18992),
               "qwen3_8b_32k": (32768, 4096, 151936), "qwen3_8b_tp8_32k": (32768, 4096, 18992)}
SMOKE_SHAPES = {"smoke": (256, 64, 1000), "smoke_odd": (192, 32, 333)}
METHODS = ("rl_fused", "loss_op", "gathered")
ENTROPY_COEF = 0.01
TIME_TARGET = 1.1  # rl_fused / loss_op


# ------------------------------------------------------------------------------------------ methods

def _rl_loss(logp, ent, adv):
    return -(adv * logp).mean() - ENTROPY_COEF * ent.mean(), (logp, ent)


def _rl_fused_with(**options):
    def fn(h, w, t, adv, temperature, chunks):
        logp, ent = vparallel_ce.linear_token_logprobs(h, w, t, temperature=temperature, with_entropy=True,
                                                       chunks=chunks, **options)
        return _rl_loss(logp, ent, adv)
    return fn


def _loss_op_with(**options):
    def fn(h, w, t, adv, temperature, chunks):
        # at T != 1 the loss op sees W / T (one extra [V, H] tensor in the timing); the default is T = 1
        w_t = w if temperature == 1.0 else w / temperature
        return vparallel_ce.linear_cross_entropy(h, w_t, t, chunks=chunks, **options), None
    return fn


_loss_op = _loss_op_with()


def gathered_logprobs(h, w, t, temperature, dtype=torch.float32):
    """Full logits in ``dtype``: (log softmax(z / T)[t], entropy). Differentiable."""
    logits = (h @ w.t()).to(dtype) / temperature
    logsm = torch.log_softmax(logits, dim=-1)
    logp = logsm.gather(-1, t.unsqueeze(-1)).squeeze(-1)
    ent = -(logsm.exp() * logsm).sum(-1)
    return logp, ent


def _gathered(h, w, t, adv, temperature, chunks):
    logp, ent = gathered_logprobs(h, w, t, temperature)
    return _rl_loss(logp, ent, adv)


_COMPILED = []


def _compiled(h, w, t, adv, temperature, chunks):
    if not _COMPILED:
        _COMPILED.append(torch.compile(gathered_logprobs, dynamic=False))
    logp, ent = _COMPILED[0](h, w, t, temperature)
    return _rl_loss(logp, ent, adv)


VERL_PATH = []  # --verl-path


def _verl_kernel():
    """verl's ``linear_cross_entropy`` (hidden, weight, labels, temperature, reduction, group) ->
    (logprobs, entropy): imported from verl, or from its two kernel files under ``--verl-path``."""
    if not VERL_PATH:
        from verl.utils.kernel.linear_cross_entropy import linear_cross_entropy
        return linear_cross_entropy
    import importlib.util
    import types
    root = VERL_PATH[0]
    # the kernel files import only these helpers of verl.utils.device (which pulls in verl's
    # platform plugins): stand-ins for a CUDA device
    device = types.ModuleType("verl.utils.device")
    device.is_cuda_available = torch.cuda.is_available()
    device.get_device_name = lambda: "cuda"
    device.get_torch_device = lambda: torch.cuda
    device.get_device_capability = lambda *a: torch.cuda.get_device_capability()
    for name in ("verl", "verl.utils", "verl.utils.kernel"):
        mod = sys.modules.setdefault(name, types.ModuleType(name))
        mod.__path__ = [f"{root}/{name.replace('.', '/')}"]
    sys.modules["verl.utils.device"] = device
    mods = {}
    for name in ("kernels", "linear_cross_entropy"):
        full = f"verl.utils.kernel.{name}"
        spec = importlib.util.spec_from_file_location(full, f"{root}/verl/utils/kernel/{name}.py")
        mods[name] = sys.modules[full] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mods[name])
    return mods["linear_cross_entropy"].linear_cross_entropy


def _verl(h, w, t, adv, temperature, chunks):
    logp, ent = _verl_kernel()(h, w, t, float(temperature), "none", None)
    return _rl_loss(logp, ent, adv)


FNS = {"rl_fused": _rl_fused_with(), "rl_fused:fp32": _rl_fused_with(logits_dtype=torch.float32),
       "rl_fused:invariant": _rl_fused_with(batch_invariant=True), "loss_op": _loss_op,
       "loss_op:invariant": _loss_op_with(batch_invariant=True), "gathered": _gathered,
       "compile": _compiled, "verl": _verl}


# ---------------------------------------------------------------------------------------- reference

def reference(h, w, t, adv, temperature, dtype=torch.float64, rows=1024):
    """logp, entropy, dh, dW of the RL loss in ``dtype``, token chunk by token chunk (no [N, V]
    tensor in ``dtype`` at once)."""
    n = h.shape[0]
    w64 = w.detach().to(dtype).requires_grad_()
    logps, ents, dhs = [], [], []
    dw = torch.zeros(w.shape, dtype=dtype, device=w.device)
    for s in range(0, n, rows):
        hc = h.detach()[s : s + rows].to(dtype).requires_grad_()
        logp, ent = gathered_logprobs(hc, w64, t[s : s + rows], temperature, dtype)
        loss = (-(adv[s : s + rows].to(dtype) * logp).sum() - ENTROPY_COEF * ent.sum()) / n
        gh, gw = torch.autograd.grad(loss, (hc, w64))
        logps.append(logp.detach())
        ents.append(ent.detach())
        dhs.append(gh)
        dw += gw
    return torch.cat(logps), torch.cat(ents), torch.cat(dhs), dw


def max_rel(x, ref) -> float:
    scale = ref.abs().max().item()
    return (x.to(ref.dtype) - ref).abs().max().item() / (scale if scale > 0 else 1.0)


# ------------------------------------------------------------------------------------------ timing

def run_once(fn, h, w, t, adv, temperature, chunks):
    h.grad = None
    w.grad = None
    loss, outs = fn(h, w, t, adv, temperature, chunks)
    loss.backward()
    return loss, outs


# -------------------------------------------------------------------------------------------- main

def inputs(shape, device, dtype):
    """The benchmark's ``(h [N, H], w [V, H], targets, advantages)`` (seed 0; ``h`` and ``w`` leaves)."""
    n, hdim, v = shape
    g = torch.Generator(device="cpu").manual_seed(0)
    h = torch.randn(n, hdim, generator=g).to(device=device, dtype=dtype).requires_grad_()
    w = (torch.randn(v, hdim, generator=g) * (2.0 / math.sqrt(hdim))).to(device=device, dtype=dtype)
    w.requires_grad_()
    t = torch.randint(0, v, (n,), generator=g).to(device)
    adv = torch.randn(n, generator=g).to(device)
    return h, w, t, adv


def bench_shape(tag, shape, args, device, dtype, emit):
    n, hdim, v = shape
    h, w, t, adv = inputs(shape, device, dtype)
    ref = None
    if not args.no_ref:
        sync(device)
        s = time.perf_counter()
        ref = reference(h, w, t, adv, args.temperature, getattr(torch, args.ref_dtype))
        sync(device)
        print(f"# {tag} N={n} H={hdim} V={v}: {args.ref_dtype} reference in {time.perf_counter() - s:.1f}s",
              flush=True)
    records = []
    steps = {name: (lambda f: lambda: run_once(f, h, w, t, adv, args.temperature, args.chunks))(FNS[name])
             for name in args.methods}
    # every method once per round, in turn: the GPU's clock drift falls on all of them alike
    timings = timed_in_rounds(steps, (h, w), device, args.repeats, args.warmup)
    for name in args.methods:
        rec = dict(shape=tag, N=n, H=hdim, V=v, method=name, dtype=str(dtype).replace("torch.", ""),
                   temperature=args.temperature, chunks=args.chunks, device=device.type)
        try:
            if isinstance(timings[name], Exception):
                raise timings[name]
            peak, (_, outs) = peak_of(steps[name], (h, w), device)
            rec.update(ms=timings[name], peak_gib=peak)
            if ref is not None and outs is not None:
                rec.update(err_logp=max_rel(outs[0].detach(), ref[0]), err_entropy=max_rel(outs[1].detach(), ref[1]),
                           err_dh=max_rel(h.grad, ref[2]), err_dw=max_rel(w.grad, ref[3]))
        except Exception as e:  # OOM, missing op, ...: record and go on
            rec.update(error=f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}")
            if args.verbose:
                traceback.print_exc()
        h.grad = None
        w.grad = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
        records.append(rec)
    base = next((r for r in records if r["method"] == "loss_op" and "ms" in r), None)
    by_method = {r["method"]: r for r in records if "ms" in r}
    for r in records:
        default = by_method.get(r["method"].removesuffix(":invariant"))
        if r["method"].endswith(":invariant") and "ms" in r and default is not None:
            r["x_default_time"] = r["ms"] / default["ms"]
        if base is not None and "ms" in r:
            r["x_loss_op_time"] = r["ms"] / base["ms"]
            if not math.isnan(r["peak_gib"]):
                r["peak_gib_minus_loss_op"] = r["peak_gib"] - base["peak_gib"]
        if r["method"] == "rl_fused" and "x_loss_op_time" in r:
            r["meets_time_target"] = r["x_loss_op_time"] <= TIME_TARGET
        emit(r)
    return records


def fmt(x, spec):
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def print_table(records):
    print(f"\n## launch.bench.rl: fwd+bwd median ms; peak GiB over resident inputs (incl. dh + dW); "
          f"errors vs the float64 gathered computation; target rl_fused <= {TIME_TARGET}x loss_op time, same memory")
    print("| shape | method | ms | x loss_op | peak GiB | +GiB vs loss_op | err logp | err entropy | err dh | err dW |")
    print("|" + "---|" * 10)
    for r in records:
        if "error" in r:
            print(f"| {r['shape']} | {r['method']} | {r['error']} | | | | | | | |")
            continue
        print(f"| {r['shape']} | {r['method']} | {fmt(r['ms'], '.2f')} | {fmt(r.get('x_loss_op_time'), '.3f')} | "
              f"{fmt(r['peak_gib'], '.3f')} | {fmt(r.get('peak_gib_minus_loss_op'), '+.3f')} | "
              f"{fmt(r.get('err_logp'), '.1e')} | {fmt(r.get('err_entropy'), '.1e')} | "
              f"{fmt(r.get('err_dh'), '.1e')} | {fmt(r.get('err_dw'), '.1e')} |")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (CI), 2 repeats")
    p.add_argument("--shapes", default=None, help="comma list of shape names or NxHxV")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--chunks", default="auto", help="chunks option of both fused ops (int or auto)")
    p.add_argument("--repeats", type=int, default=None, help="timed runs (default 10; 2 with --smoke)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up runs (default 2; 1 with --smoke)")
    p.add_argument("--ref-dtype", default="float64")
    p.add_argument("--no-ref", action="store_true", help="skip the reference (no error columns)")
    p.add_argument("--out", default=None, help="append one JSON line per measurement to this file")
    p.add_argument("--verl-path", default=None, help="load verl's kernel files from this unpacked wheel")
    p.add_argument("--verbose", action="store_true")
    args = p.parse_args(argv)
    if args.verl_path:
        VERL_PATH[:] = [args.verl_path]

    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    dtype = getattr(torch, args.dtype)
    args.chunks = args.chunks if args.chunks == "auto" else int(args.chunks)
    args.methods = [m for m in args.methods.split(",") if m]
    unknown = [m for m in args.methods if m not in FNS]
    if unknown:
        p.error(f"unknown methods {unknown}; known: {list(FNS)}")
    args.repeats = args.repeats if args.repeats is not None else (2 if args.smoke else 10)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.smoke else 2)
    table = SMOKE_SHAPES if args.smoke else SHAPES
    if args.shapes:
        shapes = {}
        for s in args.shapes.split(","):
            shapes[s] = {**SHAPES, **MORE_SHAPES, **SMOKE_SHAPES}.get(s) or tuple(int(x) for x in s.lower().split("x"))
    else:
        shapes = table
    fh = open(args.out, "a") if args.out else None
    env = dict(torch=torch.__version__, device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu")
    print(f"# launch.bench.rl: {env}, dtype {args.dtype}, T={args.temperature}, chunks={args.chunks}, "
          f"repeats {args.repeats}, warmup {args.warmup}", flush=True)

    def emit(rec):
        rec = {**rec, **env}
        print(json.dumps(rec), flush=True)
        if fh is not None:
            fh.write(json.dumps(rec) + "\n")
            fh.flush()

    records = []
    try:
        for tag, shape in shapes.items():
            records += bench_shape(tag, shape, args, device, dtype, emit)
    finally:
        if fh is not None:
            fh.close()
    print_table(records)
    # the peers (gathered: OOM at large shapes; verl: not installed) may fail; ours may not
    return 1 if any("error" in r for r in records if r["method"].startswith(("rl_fused", "loss_op"))) else 0


if __name__ == "__main__":
    sys.exit(main())
