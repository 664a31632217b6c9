"""Multi-token prediction, forward+backward: a main head and ``D`` MTP depths through one lm_head,
ours against torchtitan 0.3.0's ``MTPLoss`` on full logits.

For each shape ``N x H x V`` (tokens per head, hidden size, vocab; bf16 hidden states and weight,
packed documents of 1024 tokens, 10% ignored labels) and each method it measures

* ``ms``: forward+backward time (every head's hidden states and the lm_head get gradients), median
  of ``--repeats`` after ``--warmup`` (CUDA events; host clock on CPU), the methods taken in turn,
  one call each per round (``timing.timed_in_rounds``);
* ``peak``: ``max_memory_allocated`` during one more forward+backward minus what was allocated
  before it (the resident inputs), so it includes the returned gradients (CUDA only);
* ``err``: ``|x - ref| / |ref|`` of the loss, every head's dh (the largest) and dW against a float64
  reference (each head's full logits from the same bf16 inputs, token chunk by token chunk).

Every method computes torchtitan's normalisation: ``(S_0 + mtp_scale * mean_d S_d) / n_0``, with
``S_d`` head ``d``'s summed cross-entropy and ``n_0`` the main head's valid tokens (ours: that count
passed for every head). Methods, ``D`` the depths:

* ``ours:D`` -- ``vparallel_ce.linear_mtp_loss`` (no logits beyond one chunk), ``chunks="auto"``;
  ``ours:D:K`` the same with ``chunks=K`` token chunks of the stacked ``(D + 1) N`` rows (``K = 1``:
  every head's logits kept for the backward; ``K > 1``: gradients made in forward),
  ``ours:D:vocab:K`` with ``K`` vocab blocks (4 matmuls); the record's ``plan`` names what ran;
* ``lce:D`` / ``lce:D:K`` -- the single-head ``vparallel_ce.linear_cross_entropy`` on the same stacked
  rows (the hiddens concatenated, each head's rolled labels), ``"sum"`` over ``n_0``, with the
  plan of ``ours:D`` (or ``chunks=K``): the chunk walk without the MTP op's own work (per-row
  weights, per-head sums, top-1); every row weighs 1, so it gets no error columns;
* ``titan:D`` -- the lm_head as bf16 matmuls, then torchtitan's ``MTPLoss`` on the ``D + 1`` logits;
  ``titan_compile:D`` the same with torchtitan's loss compile (``compile.components=["loss"]``);
* ``plain:D`` -- the same math written out here (fp32 upcast, ``F.cross_entropy``), for machines
  without torchtitan; ``compile:D`` -- ``plain:D``, lm_head included, under ``torch.compile``.

Run from the repository root::

    python -m launch.bench.mtp --out mtp.jsonl            # one GPU: both shapes, every method
    python -m launch.bench.mtp --smoke --out smoke.jsonl  # CPU, tiny shapes
    python -m launch.bench.mtp --shapes llama3_8b --repeats 5 \
        --methods compile:1,ours:1,ours:1:1,ours:1:4,ours:1:vocab:16,lce:1   # where the time goes
"""

from __future__ import annotations

import math
import sys

import torch
import torch.nn.functional as F

import vparallel_ce
from launch.bench.harness import build_methods, parse_run, record_error, run_shapes
from launch.bench.timing import clear_grads, peak_of, timed_in_rounds
from vparallel_ce import kernels
from vparallel_ce.labels import mtp_labels
from vparallel_ce.policy import choose_plan

SCALE = 0.3
DOC = 1024  # packed document length
SHAPES = {"deepseek_v3": (8192, 7168, 129280), "llama3_8b": (8192, 4096, 128256)}
SMOKE_SHAPES = {"smoke": (96, 32, 500), "smoke_odd": (70, 24, 333)}
METHODS = ("ours:1", "titan:1", "titan_compile:1", "compile:1", "ours:3", "titan:3", "titan_compile:3", "compile:3")
SMOKE_METHODS = ("ours:1", "plain:1", "ours:3", "plain:3", "ours:3:2", "ours:1:vocab:2", "lce:3")


# ------------------------------------------------------------------------------------------ the math

def _plain(hs, w, labels, positions, n_main):
    """torchtitan's MTPLoss math on full fp32 logits (with the lm_head)."""
    heads = mtp_labels(labels, len(hs) - 1, positions=positions)
    sums = [F.cross_entropy((h @ w.t()).float().flatten(0, 1), t.flatten(), reduction="sum") for h, t in zip(hs, heads)]
    return (sums[0] + SCALE * sum(sums[1:]) / (len(hs) - 1)) / n_main


def reference(hs, w, labels, positions, n_main, rows=1024):
    """Loss, every head's dh and dW in float64 from the same (bf16) inputs, token chunk by chunk."""
    w64 = w.detach().double().requires_grad_()
    heads = mtp_labels(labels, len(hs) - 1, positions=positions)
    loss = torch.zeros((), dtype=torch.float64, device=w.device)
    dhs = []
    for d, (h, t) in enumerate(zip(hs, heads)):
        scale = (1.0 if d == 0 else SCALE / (len(hs) - 1)) / float(n_main)
        h2, t2 = h.detach().flatten(0, 1), t.flatten()
        dh = torch.empty(h2.shape, dtype=torch.float64, device=h.device)
        for s in range(0, h2.shape[0], rows):
            h64 = h2[s : s + rows].double().requires_grad_()
            part = F.cross_entropy(h64 @ w64.t(), t2[s : s + rows], reduction="sum") * scale
            part.backward()
            loss += part.detach()
            dh[s : s + rows] = h64.grad
        dhs.append(dh.reshape(h.shape))
    return loss, dhs, w64.grad


# ------------------------------------------------------------------------------------------ methods

def ours_knobs(name: str) -> dict:
    """``chunks`` and ``schedule`` of ``ours:D[:K | :vocab:K]`` and ``lce:D[:K]``."""
    _, _, *rest = name.split(":")
    if not rest:
        return dict(chunks="auto", schedule="auto")
    if rest[0] == "vocab":
        return dict(chunks=int(rest[1]), schedule="vocab")
    return dict(chunks=int(rest[0]), schedule="auto")


def ours_plan(name: str, n: int, h: int, v: int, device) -> str:
    """The plan ``ours...`` / ``lce...`` runs at ``n`` tokens per head, as ``token x2 / fwd``."""
    base, d = name.split(":")[:2]
    if base not in ("ours", "lce"):
        return ""
    fused = kernels.fused_applies(device, torch.bfloat16)
    plan = choose_plan((int(d) + 1) * n, v, 1, hidden_size=h, fused=fused, heads=int(d) + 1, **ours_knobs(name))
    how = "fwd" if plan.grad_in_forward else "kept" if plan.keep_logits else "re"
    return f"{plan.schedule}x{plan.chunks}/{how}"


def make_method(name: str, device: torch.device):
    """``fn(hs, w, labels, positions, n_main) -> loss``, or None when not available here."""
    base = name.split(":")[0]
    if base == "ours":
        knobs = ours_knobs(name)
        return lambda hs, w, labels, positions, n_main: vparallel_ce.linear_mtp_loss(
            hs, w, labels, positions=positions, mtp_scale=SCALE, num_valid_tokens=n_main, **knobs).loss
    if base == "lce":
        return _stacked_lce(ours_knobs(name))
    if base == "plain":
        return _plain
    if base == "compile":
        return torch.compile(_plain, dynamic=False)
    if base in ("titan", "titan_compile"):
        return _titan(compiled=base == "titan_compile")
    raise ValueError(f"unknown method {name!r}")


def _stacked_lce(knobs: dict):
    """``linear_cross_entropy`` over every head's rows stacked, each row weighing 1; the plan of
    ``linear_mtp_loss`` over the same rows (``knobs``: the chunks and schedule; ``"auto"`` plans
    the stacked heads as that op does)."""

    def fn(hs, w, labels, positions, n_main):
        heads = mtp_labels(labels, len(hs) - 1, positions=positions)
        chunks, schedule = knobs["chunks"], knobs["schedule"]
        if chunks == "auto":  # the stacked heads' plan, as linear_mtp_loss takes it
            plan = choose_plan(len(hs) * labels.numel(), w.shape[0], 1, hidden_size=w.shape[1],
                               fused=kernels.fused_applies(w.device, w.dtype), heads=len(hs))
            chunks, schedule = plan.chunks, plan.schedule
        h_all = torch.cat([h.reshape(-1, h.shape[-1]) for h in hs])
        t_all = torch.cat([t.reshape(-1) for t in heads])
        return vparallel_ce.linear_cross_entropy(h_all, w, t_all, reduction="sum", chunks=chunks,
                                                 schedule=schedule) / n_main

    return fn


def _titan(*, compiled: bool):
    """torchtitan 0.3.0's MTPLoss after bf16 lm_head matmuls, or None where not importable."""
    try:
        from torchtitan.config import CompileConfig
        from torchtitan.models.deepseek_v3.mtp import MTPLoss
    except Exception:
        return None
    loss = MTPLoss(MTPLoss.Config(mtp_scale=SCALE),
                   compile_config=CompileConfig(enable=True, components=["loss"]) if compiled else None)
    return lambda hs, w, labels, positions, n_main: loss([h @ w.t() for h in hs], labels, n_main,
                                                         positions=positions)[0]


def rel(a, ref) -> float:
    return float((a.double() - ref).norm() / ref.norm())


# -------------------------------------------------------------------------------------------- main

def bench_shape(tag, shape, args, device, emit):
    n, h, v = shape
    g = torch.Generator(device="cpu").manual_seed(0)
    dt = torch.bfloat16
    w = (torch.randn(v, h, generator=g) * (2.0 / math.sqrt(h))).to(device, dt).requires_grad_()
    labels = torch.randint(0, v, (1, n), generator=g)
    labels[torch.rand(1, n, generator=g) < 0.1] = -100
    labels = labels.to(device)
    positions = (torch.arange(n) % min(DOC, n)).reshape(1, n).to(device)
    n_main = (labels != -100).sum()
    depths = sorted({int(m.split(":")[1]) for m in args.methods})
    hiddens = {d: [torch.randn(1, n, h, generator=g).to(device, dt).requires_grad_() for _ in range(d + 1)]
               for d in depths}
    records, fns = build_methods(args.methods, lambda name: make_method(name, device), lambda name: dict(
        shape=tag, N=n, H=h, V=v, method=name, depths=int(name.split(":")[1]),
        plan=ours_plan(name, n, h, v, device)))
    for name, rec in records.items():
        if rec["plan"]:
            print(f"# {tag}: {name} runs {rec['plan']}", flush=True)
    refs = {}

    def once(name):
        hs = hiddens[records[name]["depths"]]
        loss = fns[name](hs, w, labels, positions, n_main)
        loss.backward()
        return loss

    params = [w, *(x for hs in hiddens.values() for x in hs)]
    steps = {name: (lambda m: lambda: once(m))(name) for name in fns}
    timings = timed_in_rounds(steps, params, device, args.repeats, args.warmup)
    for name, got in timings.items():
        rec = records[name]
        try:
            if isinstance(got, Exception):
                raise got
            peak, loss = peak_of(lambda: once(name), params, device)
            rec.update(ms=got, peak_gib=peak)
            if not args.no_ref and not name.startswith("lce"):  # (lce weighs every row 1: another loss)
                d = rec["depths"]
                hs = hiddens[d]
                if d not in refs:
                    refs[d] = reference(hs, w, labels, positions, n_main)
                r_loss, r_dhs, r_dw = refs[d]
                rec.update(err_loss=rel(loss.detach(), r_loss), err_dh=max(rel(x.grad, r) for x, r in zip(hs, r_dhs)),
                           err_dw=rel(w.grad, r_dw))
        except Exception as e:  # noqa: BLE001 -- OOM, a missing op: recorded, the rest go on
            record_error(rec, e, args.verbose)
        clear_grads(params)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    for rec in records.values():
        emit(rec)
    return list(records.values())


def main(argv=None):
    args, device, shapes, env = parse_run(__doc__, argv, shapes=SHAPES, smoke_shapes=SMOKE_SHAPES, methods=METHODS,
                                          smoke_methods=SMOKE_METHODS)
    print(f"# launch.bench.mtp: {env}, mtp_scale={SCALE}, repeats {args.repeats}, warmup {args.warmup}", flush=True)

    title = ("launch.bench.mtp: fwd+bwd median ms; peak GiB over resident inputs (incl. every dh + dW); "
             "errors vs float64 of the same bf16 inputs")
    return run_shapes(title, shapes, lambda tag, shape, emit: bench_shape(tag, shape, args, device, emit), args.out,
                      env)


if __name__ == "__main__":
    sys.exit(main())
