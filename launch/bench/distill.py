"""Distillation, forward+backward: a student's lm_head + a divergence from a (wider) teacher's lm_head,
ours against the usual ways.

For each shape ``N x H_student x H_teacher x V`` (tokens, the two hidden sizes, vocab; bf16 hidden
states and weights, random targets, ``"mean"`` over the tokens) and each method it measures

* ``ms``: forward+backward time (the student's hidden states and lm_head get gradients; the teacher
  is a constant), median of ``--repeats`` after ``--warmup`` (CUDA events; host clock on CPU),
  the methods taken in turn, one call each per round (``timing.timed_in_rounds``); with
  ``--ahead-ms`` also ``ms_behind``, the same behind that much queued GPU work (a training step,
  where the host time before the first kernel is hidden);
* ``peak``: ``max_memory_allocated`` during one more forward+backward minus what was allocated
  before it (the resident inputs), so it includes the returned dh and dW (CUDA only);
* ``err``: ``|x - ref| / |ref|`` of the loss, dh and dW against a float64 reference (full logits of
  both models from the same bf16 inputs, token chunk by token chunk on the same device).

Methods (``<kind>`` is ``forward_kl``, ``reverse_kl`` or ``jsd``; JSD with ``beta = 0.5``):

* ``ours:<kind>`` -- ``vparallel_ce.linear_distillation_loss`` (neither model's logits exist beyond
  one chunk), ``chunks="auto"``; ``ours:<kind>:<k>`` with ``chunks=k``;
* ``ours_logits:<kind>`` -- both lm_heads as bf16 matmuls, then ``vparallel_ce.distillation_loss``
  on the logits;
* ``compile:<kind>`` -- the plain fp32 loss (``(h @ W.T).float()``, ``log_softmax``, the divergence
  summed over the vocab) under ``torch.compile``; ``plain:<kind>`` the same eagerly;
* ``liger:jsd`` -- Liger-Kernel's ``LigerFusedLinearJSDLoss`` (hard weight 0, soft weight 1), and
  ``liger:forward_kl`` -- its ``LigerFusedLinearKLDivLoss`` (the student's lm_head fused; the teacher
  given as its ``[N, V]`` probabilities, made in fp32 from its logits), when importable on CUDA.

Run from the repository root::

    python -m launch.bench.distill --out distill.jsonl           # one GPU: both shapes, every method
    python -m launch.bench.distill --smoke                       # CPU, tiny shapes
"""

from __future__ import annotations

import math
import sys

import torch

import vparallel_ce
from launch.bench.harness import build_methods, parse_run, record_error, run_shapes
from launch.bench.timing import clear_grads, peak_of, timed_in_rounds

# Llama3-8B student (H=4096) with a Llama3-70B-width teacher (H=8192); full vocab and its TP=8 shard
SHAPES = {"llama3_8b_70b": (8192, 4096, 8192, 128256), "llama3_8b_70b_tp8": (8192, 4096, 8192, 16032)}
SMOKE_SHAPES = {"smoke": (96, 32, 48, 500), "smoke_odd": (70, 24, 40, 333)}
KINDS = ("forward_kl", "reverse_kl", "jsd")
BETA = 0.5
METHODS = ("compile:forward_kl", "liger:forward_kl", "ours:forward_kl", "ours:forward_kl:1", "ours_logits:forward_kl",
           "compile:jsd", "liger:jsd", "ours:jsd", "ours:jsd:1")
SMOKE_METHODS = ("plain:forward_kl", "ours:forward_kl", "ours:forward_kl:3", "ours_logits:forward_kl",
                 "plain:reverse_kl", "ours:reverse_kl", "plain:jsd", "ours:jsd", "ours_logits:jsd")


# ------------------------------------------------------------------------------------------ the math

def divergence(s: torch.Tensor, t: torch.Tensor, kind: str, temperature: float) -> torch.Tensor:
    """Per-token ``T**2 * D(p, q)`` of student logits ``s`` and teacher logits ``t`` (``[n, V]``, any
    float dtype), computed in that dtype; ``p = softmax(t / T)``, ``q = softmax(s / T)``."""
    lp = torch.log_softmax(t / temperature, -1)
    lq = torch.log_softmax(s / temperature, -1)
    if kind == "forward_kl":
        d = (lp.exp() * (lp - lq)).sum(-1)
    elif kind == "reverse_kl":
        d = (lq.exp() * (lq - lp)).sum(-1)
    else:
        lm = torch.logaddexp(lp + math.log(BETA), lq + math.log(1 - BETA))
        d = BETA * (lp.exp() * (lp - lm)).sum(-1) + (1 - BETA) * (lq.exp() * (lq - lm)).sum(-1)
    return temperature**2 * d


def _plain(hs, ws, ht, wt, tgt, kind, temperature):
    with torch.no_grad():
        t = (ht @ wt.t()).float()
    d = divergence((hs @ ws.t()).float(), t, kind, temperature)
    valid = tgt != -100
    return (d * valid).sum() / valid.sum()


def reference(hs, ws, ht, wt, tgt, kind, temperature, rows=1024):
    """Loss, dh, dW in float64 from the same (bf16) inputs, token chunk by token chunk."""
    w64 = ws.detach().double().requires_grad_()
    wt64 = wt.detach().double()
    n_valid = (tgt != -100).sum()
    loss = torch.zeros((), dtype=torch.float64, device=hs.device)
    dh = torch.empty(hs.shape, dtype=torch.float64, device=hs.device)
    for s in range(0, hs.shape[0], rows):
        h64 = hs.detach()[s : s + rows].double().requires_grad_()
        d = divergence(h64 @ w64.t(), ht[s : s + rows].double() @ wt64.t(), kind, temperature)
        part = (d * (tgt[s : s + rows] != -100)).sum() / n_valid
        part.backward()
        loss += part.detach()
        dh[s : s + rows] = h64.grad
    return loss, dh, w64.grad


# ------------------------------------------------------------------------------------------ methods

def make_method(name: str, device: torch.device, temperature: float):
    """``fn(hs, ws, ht, wt, tgt) -> loss``, or None when not available here."""
    parts = name.split(":")
    base, kind = parts[0], parts[1]
    if kind not in KINDS:
        raise ValueError(f"unknown divergence in {name!r}")
    if base == "plain":
        return lambda *a: _plain(*a, kind, temperature)
    if base == "compile":
        compiled = torch.compile(_plain, dynamic=False)
        return lambda *a: compiled(*a, kind, temperature)
    if base == "ours":
        chunks = int(parts[2]) if len(parts) > 2 else "auto"
        return lambda hs, ws, ht, wt, tgt: vparallel_ce.linear_distillation_loss(
            hs, ws, ht, wt, tgt, kind=kind, beta=BETA, temperature=temperature, chunks=chunks)

    if base == "ours_logits":
        def fn(hs, ws, ht, wt, tgt):
            with torch.no_grad():
                t = ht @ wt.t()
            return vparallel_ce.distillation_loss(hs @ ws.t(), t, tgt, kind=kind, beta=BETA, temperature=temperature)
        return fn
    if base == "liger":
        return _liger(kind, device, temperature)
    raise ValueError(f"unknown method {name!r}")


def _liger(kind: str, device: torch.device, temperature: float):
    """Liger-Kernel's fused-linear divergences with its defaults, unscaled by ``T**2`` (scaled here),
    or None where not importable on CUDA."""
    if device.type != "cuda" or kind == "reverse_kl":
        return None
    try:  # each loss its own import: a Liger with the JSD but not yet the fused KL still runs the JSD
        if kind == "jsd":
            from liger_kernel.chunked_loss import LigerFusedLinearJSDLoss
        else:
            from liger_kernel.transformers.fused_linear_kl_div import LigerFusedLinearKLDivLoss
    except Exception:
        return None
    if kind == "jsd":  # beta KL(p||m) + (1 - beta) KL(q||m), m = beta p + (1 - beta) q; both lm_heads fused
        jsd = LigerFusedLinearJSDLoss(weight_hard_loss=0.0, weight_soft_loss=1.0, beta=BETA, temperature=temperature)
        return lambda hs, ws, ht, wt, tgt: temperature**2 * jsd(hs, ws, ht, wt, tgt)
    # forward KL: only the student's lm_head is fused; the teacher comes as its [N, V] probabilities
    # (made here from its bf16 logits in ONE fp32 buffer, in place), the targets as shift_labels (an
    # ignored row counts 0, "batchmean" over the others)
    kl = LigerFusedLinearKLDivLoss(reduction="batchmean", temperature=temperature)

    def fn(hs, ws, ht, wt, tgt):
        with torch.no_grad():
            p = (ht @ wt.t()).float().div_(temperature)
            p.sub_(p.amax(-1, keepdim=True)).exp_()
            p.div_(p.sum(-1, keepdim=True))
        return temperature**2 * kl(hs, ws, p, tgt)
    return fn


def rel(a, ref) -> float:
    return float((a.double() - ref).norm() / ref.norm())


# -------------------------------------------------------------------------------------------- main

def bench_shape(tag, shape, args, device, emit):
    n, h_s, h_t, v = shape
    g = torch.Generator(device="cpu").manual_seed(0)
    dt = torch.bfloat16
    hs = torch.randn(n, h_s, generator=g).to(device, dt).requires_grad_()
    ws = (torch.randn(v, h_s, generator=g) * (2.0 / math.sqrt(h_s))).to(device, dt).requires_grad_()
    ht = torch.randn(n, h_t, generator=g).to(device, dt)
    wt = (torch.randn(v, h_t, generator=g) * (2.0 / math.sqrt(h_t))).to(device, dt)
    tgt = torch.randint(0, v, (n,), generator=g)
    tgt[torch.rand(n, generator=g) < 0.1] = -100  # prompt / padding tokens
    tgt = tgt.to(device)
    records, fns = build_methods(args.methods, lambda name: make_method(name, device, args.temperature),
                                 lambda name: dict(shape=tag, N=n, H_student=h_s, H_teacher=h_t, V=v, method=name,
                                                   temperature=args.temperature))
    refs = {}

    def once(fn):
        loss = fn(hs, ws, ht, wt, tgt)
        loss.backward()
        return loss

    # every method once per round, in turn: the GPU's clock drift falls on all of them alike
    steps = {name: (lambda f: lambda: once(f))(fn) for name, fn in fns.items()}
    timings = timed_in_rounds(steps, (hs, ws), device, args.repeats, args.warmup)
    behind = {}
    if args.ahead_ms and device.type == "cuda":  # the training-step case: see timing.timed
        behind = timed_in_rounds(steps, (hs, ws), device, args.repeats, 0, ahead_ms=args.ahead_ms)
    for name, got in timings.items():
        rec = records[name]
        try:
            if isinstance(got, Exception):
                raise got
            peak, loss = peak_of(lambda: once(fns[name]), (hs, ws), device)
            rec.update(ms=got, peak_gib=peak)
            if isinstance(behind.get(name), float):
                rec.update(ahead_ms=args.ahead_ms, ms_behind=behind[name])
            if not args.no_ref:
                kind = name.split(":")[1]
                if kind not in refs:
                    refs[kind] = reference(hs, ws, ht, wt, tgt, kind, args.temperature)
                r_loss, r_dh, r_dw = refs[kind]
                rec.update(err_loss=rel(loss.detach(), r_loss), err_dh=rel(hs.grad, r_dh), err_dw=rel(ws.grad, r_dw))
        except Exception as e:  # noqa: BLE001 -- OOM, a missing op: recorded, the rest go on
            record_error(rec, e, args.verbose)
        clear_grads((hs, ws))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    for rec in records.values():
        emit(rec)
    return list(records.values())


def main(argv=None):
    def more(p):
        p.add_argument("--temperature", type=float, default=1.0)
        p.add_argument("--ahead-ms", type=float, default=0.0,
                       help="also time each method behind this much queued GPU work (ms_behind; see timing.timed)")

    args, device, shapes, env = parse_run(__doc__, argv, shapes=SHAPES, smoke_shapes=SMOKE_SHAPES, methods=METHODS,
                                          smoke_methods=SMOKE_METHODS, more=more)
    print(f"# launch.bench.distill: {env}, T={args.temperature}, repeats {args.repeats}, warmup {args.warmup}",
          flush=True)

    title = ("launch.bench.distill: fwd+bwd median ms; peak GiB over resident inputs (incl. dh + dW); "
             "errors vs float64 of the same bf16 inputs")
    return run_shapes(title, shapes, lambda tag, shape, emit: bench_shape(tag, shape, args, device, emit), args.out,
                      env)


if __name__ == "__main__":
    sys.exit(main())
