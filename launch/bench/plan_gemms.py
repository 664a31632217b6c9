"""The lean plan's four GEMMs one by one, against cuBLAS's GEMM at the same shape: where the time of
``chunks="auto"``'s vocab-block plan goes, and the floor of any exact plan that runs four GEMMs.

At ``N x H x V`` (bf16 on a GPU; fp32 under the Triton interpreter with ``--smoke``), the vocabulary
split into the blocks the plan uses (``--blocks``; default: what ``chunks="auto"`` picks on one GPU,
``vparallel_ce.layout.vocab_blocks``), each part of the plan is timed alone -- median of
``--repeats`` calls, each behind ``--ahead-ms`` of queued GPU work (``launch.bench.timing.timed``):

* ``cublas``: one ``F.linear(h, w)`` over the whole vocabulary in bf16 -- the GEMM ceiling;
* ``cublas_blocks``: ``F.linear`` per block;
* ``stats``: the forward's fused statistics pass over the whole vocabulary (one launch,
  ``fused_linear.linear_stats``: the logits never written);
* ``recompute_grad``: the backward's fused recompute of each block's logits and their gradient;
* ``dh``: ``dh += dx_blk w_blk``, each block added into the fp32 sum;
* ``dw``: ``dW_blk = dx_blk^T h``, one GEMM per block, written in bf16;
* ``plan``: the sum of ``stats``, ``recompute_grad``, ``dh`` and ``dw``.

TFLOP/s counts one ``2 N H V`` GEMM per part. A plan of four such GEMMs takes at least four times
``cublas``: compare it with a peer's whole call behind the same queued work
(``launch.bench.loss --ahead-ms``).

Run from the repository root::

    python -m launch.bench.plan_gemms --smoke                 # CPU smoke test (interpreter, fp32)
    python -m launch.bench.plan_gemms --shape 8192x5120x100352 --ahead-ms 20 --out plan_gemms.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import sys

if "--smoke" in sys.argv:  # before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from launch.bench import loss  # noqa: E402
from launch.bench.timing import timed  # noqa: E402
from vparallel_ce import policy, stats  # noqa: E402
from vparallel_ce.gemm import mm_into  # noqa: E402
from vparallel_ce.kernels import fused_linear as fl  # noqa: E402
from vparallel_ce.layout import vocab_blocks  # noqa: E402

SMOKE_SHAPE = "64x32x500"
PARTS = ("cublas", "cublas_blocks", "stats", "recompute_grad", "dh", "dw", "plan")


def auto_blocks(n: int, hdim: int, v: int) -> int:
    """The vocab blocks of ``chunks="auto"``'s plan on one GPU with the fused kernels (1 if it
    picks token chunks)."""
    plan = policy.choose_plan(n, v, 1, hidden_size=hdim, schedule="auto", chunks="auto", fused=True)
    return plan.chunks if plan.schedule == "vocab" else 1


def parts(h, w, t, blocks: list[slice]) -> dict:
    """Name -> no-argument call of each part (the blocks' logits' gradients made once, here)."""
    v = w.shape[0]
    spec = stats.LossSpec(v)
    lt, own, valid = stats.local_targets(t, 0, v, -100)
    st = fl.linear_stats(h, w, None, lt, own, spec)
    lse = st.max + torch.log(st.sumexp)
    shift, coefs = st.max, stats.loss_grad_coefs(st.max, lse - st.max, valid.float() / valid.sum(), spec)

    def grad(b):
        return fl.linear_grad_logits(h, w[b], None, lt, own, shift, coefs, spec, col_offset=b.start)

    dx = {b.start: grad(b) for b in blocks}
    dh = torch.zeros(h.shape, dtype=torch.float32, device=h.device)
    dw = torch.empty_like(w)
    return {
        "cublas": lambda: F.linear(h, w),
        "cublas_blocks": lambda: [F.linear(h, w[b]) for b in blocks],
        "stats": lambda: fl.linear_stats(h, w, None, lt, own, spec),
        "recompute_grad": lambda: [grad(b) for b in blocks],
        "dh": lambda: [mm_into(dh, dx[b.start], w[b], accumulate=True) for b in blocks],
        "dw": lambda: [mm_into(dw[b], dx[b.start].t(), h, accumulate=False) for b in blocks],
    }


def bench(shape: tuple[int, int, int], n_blocks: int, args, device, dtype) -> list[dict]:
    n, hdim, v = shape
    # the loss benchmark's inputs (GEMM times depend on the data), as plain tensors of ``dtype``
    h, w, t = loss.inputs(shape, device)
    h, w = h.detach().to(dtype), w.detach().to(dtype)
    blocks = vocab_blocks(v, n_blocks)
    flop = 2.0 * n * hdim * v
    ms = {name: timed(fn, device, args.repeats, args.warmup, ahead_ms=args.ahead_ms)
          for name, fn in parts(h, w, t, blocks).items()}
    ms["plan"] = sum(ms[k] for k in ("stats", "recompute_grad", "dh", "dw"))
    shape_name = "x".join(map(str, shape))
    return [{"shape": shape_name, "blocks": len(blocks), "part": name, "ms": ms[name],
             "tflops": flop * (4 if name == "plan" else 1) / ms[name] / 1e9, "ahead_ms": args.ahead_ms,
             "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
            for name in PARTS]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="8192x5120x100352", help="a name of launch.bench.loss or NxHxV")
    p.add_argument("--blocks", type=int, default=None, help="vocab blocks (default: chunks='auto''s plan)")
    p.add_argument("--ahead-ms", type=float, default=20.0, help="queued GPU work before each call")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--smoke", action="store_true", help="CPU, fp32, a tiny shape, under the Triton interpreter")
    p.add_argument("--out", default=None, help="JSON lines")
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.smoke:
        args.shape, args.repeats, args.warmup, args.blocks = SMOKE_SHAPE, 1, 0, args.blocks or 2
    if device.type != "cuda":
        args.ahead_ms = 0.0
    shape = loss.shape_of(args.shape)
    rows = bench(shape, args.blocks or auto_blocks(*shape), args, device, dtype)
    if args.out:
        with open(args.out, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    print(f"{rows[0]['shape']}, {rows[0]['blocks']} vocab blocks, {rows[0]['device']}, "
          f"behind {args.ahead_ms:g} ms of queued work")
    print("| part | ms | TFLOP/s |\n|---|---|---|")
    for r in rows:
        print(f"| {r['part']} | {r['ms']:.3f} | {r['tflops']:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
