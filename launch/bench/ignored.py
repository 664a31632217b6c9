"""Ignored-token compaction (``vparallel_ce.compaction``): the three linear ops with a fraction of
their targets ``ignore_index``, compacted against uncompacted, in one run.

Per shape N x H x V (``launch.bench.loss``'s shapes; bf16 on a GPU, fp32 on CPU), per op

* ``ce``: ``linear_cross_entropy`` (mean);
* ``logprobs``: ``linear_token_logprobs(..., with_entropy=True)``, upstream gradients on both;
* ``distill``: ``linear_distillation_loss`` (forward KL, mean; a teacher of the same hidden size);

and per ignored fraction ``f`` of ``--ignored`` (the first ``f N`` tokens ignored, as a prompt mask
does; ``--spread``: a random ``f`` of them), it times forward+backward of

* ``uncompacted``: ``ChunkPolicy(compact=False)``, every row through the lm_head (the path before
  compaction);
* ``compacted``: ``ChunkPolicy(compact=True)``, the rows whose target counts (one host read of the
  count at world 1);
* ``default``: the default policy (at world 1 compacted only where the call is large enough that the
  host read costs under ~1%, ``ChunkPolicy.reads_valid_count``);

as medians over ``--repeats`` interleaved rounds (every method once per round, all fractions of an
op in the same rounds; ``launch.bench.timing.timed_in_rounds``), from an idle GPU and, for each
value of ``--ahead-ms`` above 0, behind a spin kernel of that many ms (a model's forward queued
before the loss: there a host sync leaves the GPU idle while the host launches the loss). Each row
has its peak memory over the inputs (GiB), its time over the uncompacted call's at the same fraction
(``x_uncompacted``) and over the uncompacted call with nothing ignored (``x_all_valid``), and its
loss' and gradients' (``dh``, ``dW``) largest difference from the uncompacted call's, relative to
that call's largest value (bf16 roundings: the compacted GEMMs sum over other rows).

Goals: at 50% ignored, ``compacted`` at most 0.6x the all-valid call's time at no more memory;
with nothing ignored, ``default`` at most 1.01x ``uncompacted``.

Run from the repository root::

    python -m launch.bench.ignored --smoke                                     # CPU smoke test
    python -m launch.bench.ignored --ignored 0,0.3,0.5,0.7 --ahead-ms 0,5 --out ignored.jsonl
    python -m launch.bench.ignored --shapes llama3_8b_tp8 --ops ce --spread --out spread.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

import vparallel_ce
from launch.bench.loss import SHAPES, SMALL_SHAPES, shape_of
from launch.bench.timing import peak_of, timed_in_rounds
from vparallel_ce.policy import ChunkPolicy

OPS = ("ce", "logprobs", "distill")
METHODS = {"uncompacted": ChunkPolicy(compact=False), "compacted": ChunkPolicy(compact=True), "default": None}
SMOKE_SHAPES = {"smoke": (96, 32, 500), "smoke_odd": (77, 24, 129)}
IGNORE = -100


def _inputs(n, h, v, device, dtype, seed=0):
    """The tensors every fraction shares: hidden, lm_head weight (both with gradients), the
    teacher's hidden and weight, the log-probs' two upstream gradients."""
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(n, h, generator=g) * 0.5).to(device, dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=g) / h**0.5).to(device, dtype).requires_grad_()
    teacher_h = (torch.randn(n, h, generator=g) * 0.5).to(device, dtype)
    teacher_w = (torch.randn(v, h, generator=g) / h**0.5).to(device, dtype)
    up = torch.rand(2, n, generator=g).to(device)
    return hidden, weight, teacher_h, teacher_w, up


def _target(n, v, frac, spread, device, seed=1):
    """Uniform ids with ``frac`` of them ignored: the first ones, or (``spread``) a random set."""
    g = torch.Generator().manual_seed(seed)
    target = torch.randint(0, v, (n,), generator=g)
    k = int(round(frac * n))
    target[torch.randperm(n, generator=g)[:k] if spread else slice(0, k)] = IGNORE
    return target.to(device)


def _step(op, inp, target, policy):
    """One forward+backward; returns the loss (or log-probs and entropy) and the gradients, detached."""
    hidden, weight, teacher_h, teacher_w, up = inp

    def run():
        if op == "ce":
            out = vparallel_ce.linear_cross_entropy(hidden, weight, target, policy=policy)
            out.backward()
        elif op == "logprobs":
            logp, ent = vparallel_ce.linear_token_logprobs(hidden, weight, target, with_entropy=True, policy=policy)
            out = torch.stack([logp, ent])
            torch.autograd.backward([logp, ent], [up[0].to(logp.dtype), up[1].to(ent.dtype)])
        else:
            out = vparallel_ce.linear_distillation_loss(hidden, weight, teacher_h, teacher_w, target, policy=policy)
            out.backward()
        return out.detach(), hidden.grad, weight.grad

    return run


def _rel(a, b) -> float:
    scale = b.double().abs().nan_to_num().max().item()
    diff = (a.double() - b.double()).abs().nan_to_num().max().item()
    return diff / scale if scale > 0 else diff


def bench(shape_name, shape, op, fractions, args, device, dtype) -> list[dict]:
    n, h, v = shape
    inp = _inputs(n, h, v, device, dtype)
    steps = {(f, m): _step(op, inp, _target(n, v, f, args.spread, device), policy)
             for f in fractions for m, policy in METHODS.items()}
    params = list(inp[:2])
    # each call's peak and its differences from the uncompacted call's results (only one fraction's
    # results held at a time), then every call's time in the same rounds
    measured = {}
    for f in fractions:
        ref = None
        for m in METHODS:  # uncompacted first
            try:
                peak, got = peak_of(steps[(f, m)], params, device)
            except Exception as e:  # noqa: BLE001 -- an OOM: recorded, the rest go on
                measured[(f, m)] = e
                continue
            ref = got if m == "uncompacted" else ref
            errs = {} if ref is None else dict(err_loss=_rel(got[0], ref[0]), err_dh=_rel(got[1], ref[1]),
                                               err_dw=_rel(got[2], ref[2]))
            measured[(f, m)] = dict(peak_gib=peak, **errs)
        del ref, got
    rows = []
    for ahead in args.ahead_ms:
        times = timed_in_rounds({f"{f}:{m}": fn for (f, m), fn in steps.items()}, params, device, args.repeats,
                                args.warmup, ahead_ms=ahead)
        all_valid = times.get(f"{fractions[0]}:uncompacted") if fractions[0] == 0 else None
        for f in fractions:
            base = times.get(f"{f}:uncompacted")
            for m in METHODS:
                ms, res = times[f"{f}:{m}"], measured[(f, m)]
                rec = dict(shape=shape_name, n=n, h=h, v=v, op=op, ignored=f, spread=args.spread, method=m,
                           ahead_ms=ahead, dtype=str(dtype).replace("torch.", ""), device=_device_name(device))
                bad = ms if isinstance(ms, Exception) else res if isinstance(res, Exception) else None
                if bad is not None:
                    rec["error"] = f"{type(bad).__name__}: {bad}"[:300]
                else:
                    rec.update(ms=ms, x_uncompacted=ms / base if isinstance(base, float) else None,
                               x_all_valid=ms / all_valid if isinstance(all_valid, float) else None, **res)
                rows.append(rec)
    return rows


def _device_name(device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def _fmt(x, spec):
    return "-" if x is None or (isinstance(x, float) and x != x) else format(x, spec)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=None, help="comma-separated names of launch.bench.loss or NxHxV")
    p.add_argument("--ops", default=",".join(OPS))
    p.add_argument("--ignored", default="0,0.3,0.5,0.7", help="ignored fractions (the first is the baseline)")
    p.add_argument("--spread", action="store_true", help="ignored tokens spread at random (default: a prefix)")
    p.add_argument("--ahead-ms", default="0", help="comma-separated: 0 from idle, >0 behind that much queued work")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--smoke", action="store_true", help="CPU, fp32, tiny shapes, 1 round")
    p.add_argument("--out", default=None, help="JSON lines")
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.smoke:
        args.repeats, args.warmup = 1, 0
    table = SMOKE_SHAPES if args.smoke else SHAPES
    known = {**SHAPES, **SMALL_SHAPES, **SMOKE_SHAPES}
    shapes = ({s: known[s] if s in known else shape_of(s) for s in args.shapes.split(",")} if args.shapes
              else table)
    fractions = [float(f) for f in args.ignored.split(",")]
    args.ahead_ms = [float(a) for a in args.ahead_ms.split(",")] if device.type == "cuda" else [0.0]
    rows = []
    for name, shape in shapes.items():
        for op in args.ops.split(","):
            rows += bench(name, shape, op, fractions, args, device, dtype)
            torch.cuda.empty_cache() if device.type == "cuda" else None
    if args.out:
        with open(args.out, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    print("| shape | op | ignored | ahead ms | method | ms | x uncompacted | x all valid | peak GiB | err loss | "
          "err dh | err dW |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['shape']} | {r['op']} | {r['ignored']} | {r['ahead_ms']:g} | {r['method']} | {r['error']} |")
            continue
        print(f"| {r['shape']} | {r['op']} | {r['ignored']} | {r['ahead_ms']:g} | {r['method']} | {r['ms']:.3f} | "
              f"{_fmt(r['x_uncompacted'], '.3f')} | {_fmt(r['x_all_valid'], '.3f')} | {_fmt(r['peak_gib'], '.3f')} | "
              f"{_fmt(r.get('err_loss'), '.1e')} | {_fmt(r.get('err_dh'), '.1e')} | {_fmt(r.get('err_dw'), '.1e')} |")
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
