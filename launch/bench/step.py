"""One Llama3-8B training step (forward + backward) on one GPU with each loss, in one process.

The end-to-end setting: the full Llama3-8B (32 layers, H=4096, V=128256) in
bf16, batch 1 x 8192 tokens, per-block activation checkpointing, and every parameter gradient
dropped as soon as it is accumulated (``register_post_accumulate_grad_hook``), as FSDP frees a
gradient once it has reduce-scattered it. No optimizer step (the same for every loss).

Per loss (``--losses``): median step time of ``--steps`` after ``--warmup`` (host clock around a
synchronised step), tokens/s, the step's peak ``max_memory_allocated``, the memory allocated when
the loss is called (``at_loss``), the peak reached by the end of the loss' own backward
(``peak_thru_loss``: read in a hook on the hidden states' gradient, which fires right after the
loss' backward), and the loss value. ``at_loss`` and the step peak give the loss' headroom: a
loss whose own transient memory stays below ``peak - at_loss`` leaves the step's peak unchanged.

Losses: ``plain`` (fp32-upcast ``F.cross_entropy`` over full logits), ``compile`` (the same under
``torch.compile``), ``liger``, ``cce``, ``ours`` (``linear_cross_entropy``, ``chunks="auto"``),
``ours:<schedule>:<chunks>`` for a fixed point.

The model is the demo's (``launch/demo_model.py``). Run from the repository root (the results
page's lines: ``launch/bench/results/step_h200.jsonl``)::

    python -m launch.bench.step --out step.jsonl     # one GPU: every loss, the full 32-layer model
    python -m launch.bench.step --smoke              # CPU smoke test: the tiny model, 64 tokens
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils.checkpoint import checkpoint

import vparallel_ce
from launch.bench import loss as bench_loss
from launch.bench.timing import GiB
from launch.demo_model import Transformer, get_config



class Checkpointed(torch.nn.Module):
    """A transformer block whose activations are recomputed in backward (per-block AC)."""

    def __init__(self, block: torch.nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x):
        return checkpoint(self.block, x, use_reentrant=False)


def make_loss(name: str, device: torch.device):
    """``fn(h [N, H], w [V, H], t [N]) -> mean loss``, or None where the peer is not importable
    (the peers are ``launch.bench.loss``'s: ``plain`` is its ``fp32_plain``)."""
    if name == "ours":
        return lambda h, w, t: vparallel_ce.linear_cross_entropy(h, w, t)
    if name.startswith("ours:"):
        _, schedule, chunks = name.split(":")
        return lambda h, w, t: vparallel_ce.linear_cross_entropy(h, w, t, schedule=schedule, chunks=int(chunks))
    if name in ("plain", "compile", "liger", "cce"):
        return bench_loss.make_method("fp32_plain" if name == "plain" else name, device)
    raise ValueError(f"unknown loss {name!r}")


def build(args, device):
    cfg = get_config(args.model, **({"n_layers": args.layers} if args.layers else {}))
    torch.manual_seed(0)
    with torch.device(device):
        model = Transformer(cfg).to(torch.bfloat16)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():  # same values for every loss; scaled so the logits are O(1)
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02 if "output" not in name else cfg.dim**-0.5, generator=gen)
    for key in list(model.layers.keys()):
        model.layers[key] = Checkpointed(model.layers[key])
    model.head_mode = "hidden"
    for p in model.parameters():  # as FSDP: a gradient is gone once it is complete
        p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
    return cfg, model


def run_loss(name, fn, model, tokens, labels, args, device):
    cuda = device.type == "cuda"
    mark = {}

    def step():
        hidden, weight = model(tokens)
        h = hidden.reshape(-1, hidden.shape[-1])
        if cuda:
            mark["at_loss"] = torch.cuda.memory_allocated()
        h.register_hook(lambda g: mark.__setitem__("thru", torch.cuda.max_memory_allocated() if cuda else 0))
        loss = fn(h, weight, labels.reshape(-1))
        loss.backward()
        return loss

    for _ in range(args.warmup):
        step()
    times, value = [], None
    for i in range(args.steps):
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        s = time.perf_counter()
        value = step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - s)
    step_s = statistics.median(times)
    rec = dict(loss=name, step_ms=step_s * 1e3, tps=tokens.numel() / step_s, loss_value=float(value.detach()),
               steps=args.steps)
    if cuda:
        rec.update(peak_gib=torch.cuda.max_memory_allocated() / GiB, at_loss_gib=mark["at_loss"] / GiB,
                   peak_thru_loss_gib=mark["thru"] / GiB,
                   headroom_gib=(torch.cuda.max_memory_allocated() - mark["at_loss"]) / GiB)
    return rec


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--losses", default="plain,compile,liger,cce,ours,ours:token:1")
    p.add_argument("--model", default="llama3_8b")
    p.add_argument("--layers", type=int, default=0, help="override the layer count (0: the model's)")
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", type=Path, default=None, help="append one JSON line per loss to this file")
    p.add_argument("--smoke", action="store_true", help="CPU smoke test: tiny model, 64 tokens")
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    if args.smoke:
        args.model, args.seq_len, args.steps, args.warmup = "tiny", 64, 2, 1
        args.losses = ",".join(x for x in args.losses.split(",") if x in ("plain", "ours") or x.startswith("ours:"))
    cfg, model = build(args, device)
    gen = torch.Generator(device="cpu").manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (1, args.seq_len + 1), generator=gen).to(device)
    tokens, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    print(f"# {args.model} layers={cfg.n_layers} tokens={args.seq_len} device={device} torch={torch.__version__}",
          flush=True)
    rows = []
    out = open(args.out, "a") if args.out else None
    for name in args.losses.split(","):
        fn = make_loss(name, device)
        if fn is None:
            print(f"# {name}: not importable, skipped", flush=True)
            continue
        try:
            rec = run_loss(name, fn, model, tokens, labels, args, device)
        except Exception as e:  # OOM or a missing kernel: record it and go on
            rec = dict(loss=name, error=f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}")
        if device.type == "cuda":
            torch.cuda.empty_cache()
        rows.append(rec)
        print(json.dumps(rec), flush=True)
        if out:
            out.write(json.dumps(rec) + "\n")
            out.flush()
    print("\n| loss | step ms | tokens/s | peak GiB | at loss GiB | peak through loss GiB | loss |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['loss']} | {r['error']} | | | | | |")
        else:
            print(f"| {r['loss']} | {r['step_ms']:.1f} | {r['tps']:,.0f} | {r.get('peak_gib', float('nan')):.2f} | "
                  f"{r.get('at_loss_gib', float('nan')):.2f} | {r.get('peak_thru_loss_gib', float('nan')):.2f} | "
                  f"{r['loss_value']:.5f} |")
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
