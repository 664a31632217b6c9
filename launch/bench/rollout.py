"""Log-probs over the rollout's sampling set: ``linear_token_logprobs(..., support=ids)`` forward +
backward at a Qwen3-8B lm_head, against the full-vocabulary op and the plain alternatives.

Methods (each the loss ``-(adv * logp).mean()`` and its backward into hidden and weight):

* ``set:K`` -- ``linear_token_logprobs(h, w, t, support=ids)`` with ``K`` kept ids per token (random
  distinct ids holding the target, as an engine's top-k/top-p set), its mode chosen by the op's rule;
  ``set:K:gather`` / ``set:K:gemm`` force one mode (``--set-modes``; they set
  ``vparallel_ce.sampling_set.GATHER_RATIO`` for the call), to check the rule's boundary;
* ``full`` -- ``linear_token_logprobs(h, w, t)`` over the whole vocabulary (what the set replaces);
* ``compile:K`` -- ``torch.compile`` of the gathered way: logits ``h @ w.T``, the kept ids'
  logits scattered into a ``-inf`` row, ``log_softmax``, gather of the target;
* ``verl`` -- verl's fused linear log-prob kernel (``verl.utils.kernel.linear_cross_entropy``, full
  vocabulary: it has no set), where importable (``--verl-path`` as in ``launch.bench.rl``).

Shapes: ``qwen3-8b`` (N=8192, H=4096, V=151936) and ``qwen3-8b-tp8``, one rank's share of a TP=8
group on one GPU: its vocab shard (V=18992) with ``ceil(K/8)`` of each row's ids in it. Reports
the median ms (CUDA events, rounds), peak GiB and each method's errors of logp and dh on 256 rows
against a float64 reference: of the set's log-probs, or of the whole vocabulary's for ``full``
and ``verl``.

    python -m launch.bench.rollout --out rollout.jsonl     # one GPU, bf16
    python -m launch.bench.rollout --set-modes auto,gather,gemm --methods set,full   # both modes
    python -m launch.bench.rollout --smoke                 # CPU, tiny shapes
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys

import torch

import vparallel_ce
from vparallel_ce import sampling_set
from launch.bench.timing import peak_of, timed_in_rounds

SHAPES = {"qwen3-8b": (8192, 4096, 151936, 1), "qwen3-8b-tp8": (8192, 4096, 18992, 8),
          "smoke": (64, 32, 1000, 1), "smoke-tp4": (64, 32, 250, 4)}
KS = (20, 64, 512)
CHECK_ROWS = 256


def make_support(t: torch.Tensor, v: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """``[N, k]`` distinct random ids per row, the target among them (at a random place)."""
    n = t.numel()
    k = min(k, v)
    ids = torch.argsort(torch.rand(n, v, generator=gen), dim=-1)[:, :k] if v * n <= 2**27 else \
        torch.stack([torch.randperm(v, generator=gen)[:k] for _ in range(n)])
    has = (ids == t[:, None]).any(-1)
    slot = torch.randint(0, k, (n,), generator=gen)
    ids[~has, slot[~has]] = t[~has]
    return ids


def _loss(logp, adv):
    return -(adv * logp).mean()


def _method(logp):
    """The timed step of a method whose log-probs ``logp(h, w, t, ids)`` gives: its loss."""
    def method(h, w, t, ids, adv):
        return _loss(logp(h, w, t, ids), adv)
    return method


def logp_set(h, w, t, ids):
    return vparallel_ce.linear_token_logprobs(h, w, t, support=ids)


# GATHER_RATIO that forces a mode: 0 gathers every chunk, a huge one never does
MODE_RATIOS = {"gather": 0, "gemm": 10**12}


@contextlib.contextmanager
def forced_mode(mode: str):
    """The set op's mode of every chunk forced (``gather``, ``gemm``) or its rule's (``auto``) for
    the block (the forward picks the mode of each chunk; its backward follows it)."""
    ratio = sampling_set.GATHER_RATIO
    sampling_set.GATHER_RATIO = MODE_RATIOS.get(mode, ratio)
    try:
        yield
    finally:
        sampling_set.GATHER_RATIO = ratio


def logp_set_in_mode(mode: str):
    """``logp_set`` in ``mode`` (:func:`forced_mode`)."""
    def logp(h, w, t, ids):
        with forced_mode(mode):
            return logp_set(h, w, t, ids)
    return logp


def set_in_mode(mode: str):
    """``method_set`` in ``mode`` (:func:`forced_mode`)."""
    return _method(logp_set_in_mode(mode))


def logp_full(h, w, t, ids):
    return vparallel_ce.linear_token_logprobs(h, w, t)


def _set_logp(x, t, ids):
    """log-probs of ``t`` over the kept ids of each row of the logits ``x`` (gather, mask, log_softmax)."""
    masked = torch.full_like(x, float("-inf")).scatter(1, ids, x.gather(1, ids))
    return torch.log_softmax(masked, -1).gather(1, t[:, None]).squeeze(-1)


def _gathered_set_logp(h, w, t, ids):
    return _set_logp((h @ w.T).float(), t, ids)


logp_compile = torch.compile(_gathered_set_logp, dynamic=False)
# the timed step compiled whole (the loss with the log-probs), as a user would
method_compile = torch.compile(_method(_gathered_set_logp), dynamic=False)


def logp_verl(h, w, t, ids):
    from launch.bench.rl import _verl_kernel
    return _verl_kernel()(h, w, t, 1.0, "none", None)[0]


method_set, method_full, method_verl = _method(logp_set), _method(logp_full), _method(logp_verl)


def reference(h, w, t, ids, rows: int):
    """float64 log-probs over the set (the whole vocabulary where ``ids`` is None), and
    d(sum logp)/dh, of the first ``rows`` tokens."""
    h64 = h[:rows].detach().double().requires_grad_()
    x = h64 @ w.detach().double().T
    if ids is None:
        logp = torch.log_softmax(x, -1).gather(1, t[:rows, None]).squeeze(-1)
    else:
        logp = _set_logp(x, t[:rows], ids[:rows])
    (dh,) = torch.autograd.grad(logp.sum(), h64)
    return logp.detach(), dh


def errors(logp_fn, h, w, t, ids, rows: int) -> dict:
    """Max relative errors of a method's log-probs and their ``dh`` on the first ``rows`` tokens."""
    want_lp, want_dh = reference(h, w, t, ids, rows)
    hh = h[:rows].detach().clone().requires_grad_()
    lp = logp_fn(hh, w.detach(), t[:rows], None if ids is None else ids[:rows])
    (dh,) = torch.autograd.grad(lp, hh, torch.ones_like(lp))  # a dense upstream gradient (verl's asks for one)
    rel = lambda a, b: ((a.double() - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()  # noqa: E731
    return {"logp_err": rel(lp, want_lp), "dh_err": rel(dh, want_dh)}


def bench_shape(name, args, device, dtype, emit):
    n, hsz, v, tp = SHAPES[name]
    gen = torch.Generator().manual_seed(0)
    h = (torch.randn(n, hsz, generator=gen) / 2).to(device, dtype).requires_grad_()
    w = (torch.randn(v, hsz, generator=gen) / hsz**0.5 * 4).to(device, dtype).requires_grad_()
    t = torch.randint(0, v, (n,), generator=gen)
    adv = torch.randn(n, generator=gen).to(device)
    steps = {}  # label -> (timed step, its log-probs alone for the errors, the sets or None)
    for k in args.ks:
        k_here = -(-k // tp)  # this rank's share of each row's ids
        ids = make_support(t, v, k_here, gen).to(device)
        if "set" in args.methods:
            for mode in args.set_modes:
                logp = logp_set if mode == "auto" else logp_set_in_mode(mode)
                steps[f"set:{k}" if mode == "auto" else f"set:{k}:{mode}"] = (_method(logp), logp, ids)
        if "compile" in args.methods:
            steps[f"compile:{k}"] = (method_compile, logp_compile, ids)
    t = t.to(device)
    if "full" in args.methods:
        steps["full"] = (method_full, logp_full, None)
    if "verl" in args.methods and device.type == "cuda":
        steps["verl"] = (method_verl, logp_verl, None)
    calls = {label: (lambda fn=fn, ids=ids: fn(h, w, t, ids, adv).backward()) for label, (fn, _, ids) in steps.items()}
    times = timed_in_rounds(calls, (h, w), device, args.repeats, args.warmup)
    for label, call in calls.items():
        record = {"shape": name, "N": n, "H": hsz, "V": v, "tp_share_of": tp, "method": label, "dtype": str(dtype)}
        ms = times.get(label)
        if isinstance(ms, BaseException):
            record["error"] = f"{type(ms).__name__}: {ms}"
        else:
            record["ms"] = ms
            try:
                record["peak_gib"] = peak_of(call, (h, w), device)[0]
            except Exception as exc:  # noqa: BLE001 - a method's failure is a row of the report
                record["error"] = f"{type(exc).__name__}: {exc}"
        if "error" not in record:
            _, logp, ids = steps[label]
            try:
                record.update(errors(logp, h, w, t, ids, min(CHECK_ROWS, n)))
            except Exception as exc:  # noqa: BLE001 - as above
                record["error"] = f"errors: {type(exc).__name__}: {exc}"
        emit(record)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (CI), 2 repeats")
    p.add_argument("--shapes", default=None, help="comma list of " + ", ".join(SHAPES))
    p.add_argument("--methods", default="set,full,compile,verl")
    p.add_argument("--ks", default=",".join(map(str, KS)))
    p.add_argument("--set-modes", default="auto", help="comma list of auto (the op's rule), gather, gemm")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--verl-path", default=None, help="an unpacked verl wheel (launch.bench.rl)")
    p.add_argument("--out", default=None, help="append one JSON line per (shape, method)")
    args = p.parse_args(argv)
    args.methods = set(args.methods.split(","))
    args.ks = [int(k) for k in args.ks.split(",")]
    args.set_modes = args.set_modes.split(",")
    if not set(args.set_modes) <= {"auto", *MODE_RATIOS}:
        p.error(f"--set-modes takes auto, gather, gemm; got {args.set_modes}")
    if args.verl_path:
        from launch.bench import rl
        rl.VERL_PATH.append(args.verl_path)
    if args.smoke:
        device, dtype = torch.device("cpu"), torch.float32
        shapes = args.shapes.split(",") if args.shapes else ["smoke", "smoke-tp4"]
        args.repeats, args.warmup = 2, 1
        args.ks = [4, 16] if args.ks == list(KS) else args.ks
        args.methods.discard("compile")  # inductor's CPU compile costs minutes on a small CI machine
    else:
        device, dtype = torch.device("cuda"), torch.bfloat16
        shapes = args.shapes.split(",") if args.shapes else ["qwen3-8b", "qwen3-8b-tp8"]
    records = []

    def emit(record):
        records.append(record)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(record) + "\n")

    for name in shapes:
        bench_shape(name, args, device, dtype, emit)
    print("| shape | method | ms | peak GiB | logp err | dh err |")
    print("|---|---|---|---|---|---|")
    for r in records:
        cells = [r["shape"], r["method"], f"{r['ms']:.3f}" if "ms" in r else r.get("error", "?")[:60],
                 f"{r.get('peak_gib', math.nan):.3f}", f"{r.get('logp_err', math.nan):.2e}",
                 f"{r.get('dh_err', math.nan):.2e}"]
        print("| " + " | ".join(cells) + " |")
    failed = [r for r in records if "error" in r and not r["method"].startswith(("verl", "compile"))]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
