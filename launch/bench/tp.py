"""The vocab-parallel loss under real tensor parallelism: correctness and per-rank cost.

Run from the repository root under torchrun, one process per GPU (NCCL) -- or on CPU with gloo and
small shapes::

    torchrun --nproc_per_node 8 -m launch.bench.tp --out tp.jsonl    # 8 GPUs: TP 8, 2 x TP 4, 4 x TP 2
    torchrun --nproc_per_node 2 -m launch.bench.tp --smoke           # CPU smoke test (gloo)

TP groups: the whole world (TP = W) and, when W >= 4, its partitions into sub-groups of 4 and 2
ranks (``dist.new_group``, created in the same order on every rank; the sub-groups of one size run
side by side, as DP replicas would).

1. **Correctness** (``--skip-check`` skips it). Uneven vocab (V = 128256 + 5 on GPU, a small odd V
   with ``--smoke``), bf16 and fp32. Every rank builds the FULL tensors from the same seed and
   computes the single-device result (the same op with ``group=None`` on the full logits / weight)
   and, when ``N * V`` is small enough, a float64 autograd reference. Then the TP run on this rank's
   shard: ``cross_entropy`` on the logits shard (plus the two baselines below, reported but not
   gating), ``linear_cross_entropy`` on the weight shard with ``sequence_parallel`` off and on.
   Error = ``max|x - ref| / max|ref|`` per tensor (loss, logits grad shard / dh, dW shard), max over
   ranks. Exit code 1 if one of ours exceeds the tolerance (fp32 1e-4, bf16 2e-2) against either
   reference, or raised.
2. **Per-rank cost** at the Llama3-8B lm_head shape (N=8192, H=4096, V=128256, bf16; ``--smoke``:
   tiny). Forward+backward, median of ``--repeats`` after ``--warmup`` (CUDA events; host clock on
   CPU), peak = ``max_memory_allocated`` during one more step minus what was allocated before it
   (resident inputs; so it includes the returned grads). Methods:

   * ``ours_lce:auto`` -- ``linear_cross_entropy(h, W_shard, t, group=tp)`` with the auto plan;
   * ``ours_lce:token1`` -- the same, ``schedule="token", chunks=1, recompute=False``;
   * ``ours_ce`` -- ``cross_entropy(logits_shard, t, group=tp)`` (auto chunks);
   * ``megatron_ce`` -- an unfused Megatron-style vocab-parallel CE written here: the full local
     logits upcast to fp32, all-reduces of the max, the sum of exps and the target logit, the
     softmax saved for a backward without collectives;
   * ``loss_parallel`` -- PyTorch's: a DTensor ``Shard(-1)`` of the logits on a 1-D TP mesh,
     ``F.cross_entropy(logits.float(), t)`` and its backward inside ``with loss_parallel():``.

   The ``ours_*`` and ``megatron_ce`` rows are also timed with ``group=None`` on the same local
   shard (targets folded into the shard, the same pinned plan/chunk count): ``comm`` = TP time -
   local time, roughly the collectives plus waiting for the slowest rank.

Rank 0 prints the correctness lines, then one table (last), and appends JSON lines to ``--out``.
Every wait is bounded by ``--timeout``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F

import vparallel_ce
from launch.bench.timing import clear_grads, peak_of, sync, timed
from vparallel_ce import policy as _policy
from vparallel_ce.layout import shard_range

PERF_SHAPE = (8192, 4096, 128256)          # Llama3-8B lm_head: tokens, hidden, vocab
CHECK_SHAPE = (4096, 4096, 128256 + 5)     # uneven vocab shards at every TP degree
SMALL_PERF_SHAPE = (512, 64, 4000)
SMALL_CHECK_SHAPE = (67, 32, 1001)         # odd tokens (uneven SP split) and odd vocab
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
REF64_MAX_ELEMS = 1 << 30                  # N * V above this: no float64 reference


# ------------------------------------------------------------------------------------------ setup

def setup(args):
    use_cuda = torch.cuda.is_available() and not args.cpu
    timeout = datetime.timedelta(seconds=args.timeout)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if use_cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        dist.init_process_group("nccl", timeout=timeout, device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timeout)
    return device, timeout


def tp_sizes(world: int, requested: str | None) -> list[int]:
    if requested:
        sizes = [int(s) for s in requested.split(",") if s]
        bad = [s for s in sizes if s < 1 or world % s]
        if bad:
            raise SystemExit(f"--tp-sizes {bad}: each must divide the world size {world}")
        return sorted(set(sizes), reverse=True)
    return [world] + [s for s in (4, 2) if world >= 4 and s < world and world % s == 0]


def make_groups(sizes, world: int, rank: int, timeout):
    """{tp size: this rank's group}. Every rank calls new_group for every partition, same order."""
    groups = {}
    for s in sizes:
        if s == world:
            groups[s] = dist.group.WORLD
            continue
        for start in range(0, world, s):
            ranks = list(range(start, start + s))
            g = dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                groups[s] = g
    return groups


def world_max(values, device) -> list[float]:
    """Max over all ranks of each value (NaN counts as +inf)."""
    x = torch.tensor([v if not math.isnan(v) else math.inf for v in values], dtype=torch.float64, device=device)
    dist.all_reduce(x, op=dist.ReduceOp.MAX)
    return x.tolist()


# ---------------------------------------------------------------------------------- baselines

class _MegatronCE(torch.autograd.Function):
    """Megatron-LM's unfused vocab-parallel CE (own implementation): fp32 local logits, all-reduce
    MAX, all-reduce SUM of the target logit, all-reduce SUM of exp; saves the fp32 softmax of the
    whole local shard; backward = softmax - onehot, no collective. Per-token loss."""

    @staticmethod
    def forward(ctx, logits, target, group, offset):
        x = logits.float()
        if x is logits:
            x = x.clone()  # never modify the caller's fp32 logits
        v_loc = x.shape[-1]
        m = x.max(dim=-1).values
        if group is not None:
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        x.sub_(m.unsqueeze(-1))
        local_t = target - offset
        outside = (local_t < 0) | (local_t >= v_loc)
        local_t = local_t.masked_fill(outside, 0)
        rows = torch.arange(x.shape[0], device=x.device)
        predicted = x[rows, local_t].masked_fill(outside, 0.0)
        if group is not None:
            dist.all_reduce(predicted, group=group)
        x.exp_()
        sum_exp = x.sum(dim=-1)
        if group is not None:
            dist.all_reduce(sum_exp, group=group)
        loss = torch.log(sum_exp) - predicted
        x.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(x, local_t, outside)
        ctx.in_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_t, outside = ctx.saved_tensors
        grad = softmax  # in place, as Megatron does
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, local_t] -= (~outside).to(grad.dtype)
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad.to(ctx.in_dtype), None, None, None


def megatron_ce(logits, target, group=None, offset=0):
    """Mean loss of the Megatron-style op (no ignored tokens here)."""
    return _MegatronCE.apply(logits, target, group, offset).mean()


def loss_parallel_step(mesh, vocab_size: int):
    """fn(x_local, t) -> loss: PyTorch loss_parallel on a DTensor Shard(-1) of the logits;
    forward AND backward run inside the context manager (as the API requires)."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import loss_parallel

    def fn(x, t):
        n = x.shape[0]
        dt = DTensor.from_local(x, mesh, [Shard(1)], run_check=False, shape=(n, vocab_size), stride=(vocab_size, 1))
        with loss_parallel():
            loss = F.cross_entropy(dt.float(), t)
            loss.backward()
        return loss.to_local().detach()  # its backward has run already

    return fn


def make_mesh(group, device):
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(group, device.type)


# -------------------------------------------------------------------------------- correctness

def rel_max(x, ref) -> float:
    """max|x - ref| / max|ref|, in float64."""
    x, ref = x.detach().double(), ref.detach().double()
    den = ref.abs().max().item() if ref.numel() else 0.0
    if not ref.numel():
        return 0.0
    return (x - ref).abs().max().item() / (den if den > 0 else 1.0)


def full_inputs(shape, dtype, device, seed):
    n, hdim, v = shape
    g = torch.Generator(device=device).manual_seed(seed)
    h = torch.randn(n, hdim, generator=g, device=device)
    w = torch.randn(v, hdim, generator=g, device=device) / math.sqrt(hdim)
    logits = 3.0 * torch.randn(n, v, generator=g, device=device)
    t = torch.randint(0, v, (n,), generator=g, device=device)
    return h.to(dtype), w.to(dtype), logits.to(dtype), t


def grads_of(fn, *leaves):
    leaves = [x.detach().clone().requires_grad_() for x in leaves]
    loss = fn(*leaves)
    if loss.requires_grad:  # loss_parallel runs its backward itself
        loss.backward()
    return loss.detach().float(), [x.grad for x in leaves]


def single_device_refs(h, w, logits, t, ref64: bool):
    out = {
        "ce": grads_of(lambda x: vparallel_ce.cross_entropy(x, t), logits),
        "lce": grads_of(lambda a, b: vparallel_ce.linear_cross_entropy(a, b, t), h, w),
    }
    if ref64:
        out["ce64"] = grads_of(lambda x: F.cross_entropy(x, t), logits.double())
        out["lce64"] = grads_of(lambda a, b: F.cross_entropy(a @ b.t(), t), h.double(), w.double())
    return out


def check_all(args, shape, groups, meshes, device, emit) -> int:
    """Run every correctness case; return the number of failures of our ops (same on all ranks)."""
    failures = 0
    for dtype in (torch.float32, torch.bfloat16):
        failures += _check_dtype(args, shape, dtype, groups, meshes, device, emit)
        if device.type == "cuda":
            torch.cuda.empty_cache()  # this dtype's full tensors are gone
    return failures


def _check_dtype(args, shape, dtype, groups, meshes, device, emit) -> int:
    n, hdim, v = shape
    failures = 0
    ref64 = n * v <= args.ref64_max_elems
    h, w, logits, t = full_inputs(shape, dtype, device, args.seed)
    s = time.perf_counter()
    refs = single_device_refs(h, w, logits, t, ref64)
    sync(device)
    if dist.get_rank() == 0:
        print(f"# check {str(dtype)[6:]} N={n} H={hdim} V={v}: single-device"
              f"{' + float64' if ref64 else ''} references in {time.perf_counter() - s:.1f}s", flush=True)
    tol = TOL[dtype]
    for tp, group in groups.items():
        grank = dist.get_rank(group)
        off, size = shard_range(v, tp, grank)
        vs = slice(off, off + size)
        cases = [
            ("cross_entropy", True, lambda x: vparallel_ce.cross_entropy(x, t, group=group)),
            ("megatron_ce", False, lambda x: megatron_ce(x, t, group, off)),
            ("loss_parallel", False,
             (lambda x, lp=loss_parallel_step(meshes[tp], v): lp(x, t)) if meshes.get(tp) else None),
        ]
        for name, gating, fn in cases:
            errs, err64, msg = {}, {}, ""
            try:
                if fn is None:
                    raise RuntimeError("no DeviceMesh")
                loss, (dx,) = grads_of(fn, logits[:, vs])
                rl, (rdx,) = refs["ce"]
                errs = {"loss": rel_max(loss, rl), "dlogits": rel_max(dx, rdx[:, vs])}
                if ref64:
                    rl, (rdx,) = refs["ce64"]
                    err64 = {"loss": rel_max(loss, rl), "dlogits": rel_max(dx, rdx[:, vs])}
            except Exception as e:  # noqa: BLE001 - record, keep the ranks in step
                msg = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
                if args.verbose:
                    traceback.print_exc()
            failures += _report(name, gating, dtype, tp, None, errs, err64, msg, tol, device, emit)
        for sp in (False, True):
            rows = torch.tensor_split(torch.arange(n, device=device), tp)[grank] if sp else slice(None)
            errs, err64, msg = {}, {}, ""
            try:
                fn = lambda a, b: vparallel_ce.linear_cross_entropy(  # noqa: E731
                    a, b, t[rows], group=group, sequence_parallel=sp)
                loss, (dh, dw) = grads_of(fn, h[rows], w[vs])
                for key, tag in (("lce", None), ("lce64", "64")) if ref64 else (("lce", None),):
                    rl, (rdh, rdw) = refs[key]
                    e = {"loss": rel_max(loss, rl), "dh": rel_max(dh, rdh[rows]), "dW": rel_max(dw, rdw[vs])}
                    (err64 if tag else errs).update(e)
            except Exception as e:  # noqa: BLE001
                msg = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
                if args.verbose:
                    traceback.print_exc()
            failures += _report("linear_cross_entropy", True, dtype, tp, sp, errs, err64, msg, tol, device, emit)
    return failures


def _report(op, gating, dtype, tp, sp, errs, err64, msg, tol, device, emit) -> int:
    """Max the errors over all ranks, print/emit on rank 0, return 1 for a gating failure."""
    keys = ["loss", "dlogits"] if op != "linear_cross_entropy" else ["loss", "dh", "dW"]
    local = [errs.get(k, math.nan) for k in keys] + [err64.get(k, math.nan) if err64 else -1.0 for k in keys]
    local.append(1.0 if msg else 0.0)
    vals = world_max(local, device)
    k = len(keys)
    e1, e64, raised = dict(zip(keys, vals[:k])), dict(zip(keys, vals[k:2 * k])), vals[-1] > 0
    have64 = all(x >= 0 for x in e64.values())
    worst = max(list(e1.values()) + (list(e64.values()) if have64 else []))
    ok = not raised and worst <= tol
    messages = [None] * dist.get_world_size()
    dist.all_gather_object(messages, msg)
    rec = dict(kind="check", op=op, dtype=str(dtype)[6:], tp=tp, sequence_parallel=sp, gating=gating,
               err_single={k: _num(x) for k, x in e1.items()},
               err_fp64={k: _num(x) for k, x in e64.items()} if have64 else None,
               tol=tol, ok=ok, error=next((m for m in messages if m), None))
    emit(rec)
    if dist.get_rank() == 0:
        sp_s = "" if sp is None else f" sp={'on' if sp else 'off'}"
        body = rec["error"] or ("vs single " + " ".join(f"{k} {x:.1e}" for k, x in e1.items())
                                + ("; vs fp64 " + " ".join(f"{k} {x:.1e}" for k, x in e64.items()) if have64 else ""))
        status = "ok" if ok else ("FAIL" if gating else "BAD (baseline, not gating)")
        print(f"check {op:<20} {str(dtype)[6:]:<8} tp={tp}{sp_s:<7} {status:<4} {body}", flush=True)
    return int(gating and not ok)


def _num(x):
    return None if x is None or math.isinf(x) or math.isnan(x) else x


# ---------------------------------------------------------------------------------------- timing

def measure(step, params, device, repeats: int, warmup: int):
    """(median ms, peak GiB over resident inputs) of ``step()`` = one forward+backward, ``params``'
    ``.grad`` cleared before each call; every rank starts the timed calls together."""
    for _ in range(warmup):
        clear_grads(params)
        step()
    sync(device)
    dist.barrier()
    ms = timed(step, device, repeats, warmup=0, setup=lambda: clear_grads(params))
    peak, _ = peak_of(step, params, device)
    clear_grads(params)
    return ms, peak


def perf_all(args, shape, groups, meshes, device, emit):
    records = []
    for tp, group in groups.items():
        records += _perf_tp(args, shape, tp, group, meshes, device, emit)
        if device.type == "cuda":
            torch.cuda.empty_cache()  # this TP degree's inputs are gone
    return records


def _perf_tp(args, shape, tp, group, meshes, device, emit):
    n, hdim, v = shape
    records = []
    grank = dist.get_rank(group)
    off, size = shard_range(v, tp, grank)
    g = torch.Generator(device=device).manual_seed(args.seed)
    h = torch.randn(n, hdim, generator=g, device=device).to(torch.bfloat16).requires_grad_()
    t = torch.randint(0, v, (n,), generator=g, device=device)
    gw = torch.Generator(device=device).manual_seed(args.seed + 1 + off)
    w = (torch.randn(size, hdim, generator=gw, device=device) / math.sqrt(hdim)).to(torch.bfloat16)
    w.requires_grad_()
    with torch.no_grad():
        x = F.linear(h, w).requires_grad_()  # this rank's logits shard [N, V_loc]
    t_loc = t % max(size, 1)                 # targets folded into the shard, for group=None runs
    plan = _policy.DEFAULT_POLICY.plan(n, v, tp, hidden_size=hdim)
    pinned = dict(schedule=plan.schedule, chunks=plan.chunks, recompute=not plan.grad_in_forward)
    k_ce = _policy.choose_chunks(n, v, tp, dtype=x.dtype)
    lce, ce = vparallel_ce.linear_cross_entropy, vparallel_ce.cross_entropy

    leaves = (h, w, x)

    def fb(fn):
        def step():
            loss = fn()
            if loss.requires_grad:
                loss.backward()
        return step

    lp = loss_parallel_step(meshes[tp], v) if meshes.get(tp) else None
    methods = [
        ("ours_lce:auto", "h+W_shard", f"{plan.schedule}x{plan.chunks}",
         lambda: lce(h, w, t, group=group), lambda: lce(h, w, t_loc, **pinned)),
        ("ours_lce:token1", "h+W_shard", "tokenx1",
         lambda: lce(h, w, t, group=group, schedule="token", chunks=1, recompute=False),
         lambda: lce(h, w, t_loc, schedule="token", chunks=1, recompute=False)),
        ("ours_ce", "logits_shard", f"x{k_ce}",
         lambda: ce(x, t, group=group), lambda: ce(x, t_loc, chunks=k_ce)),
        ("megatron_ce", "logits_shard", "",
         lambda: megatron_ce(x, t, group, off), lambda: megatron_ce(x, t_loc)),
        ("loss_parallel", "logits_shard", "", (lambda: lp(x, t)) if lp else None, None),
    ]
    for name, inp, plan_s, fn_tp, fn_local in methods:
        rec = dict(kind="perf", tp=tp, method=name, input=inp, plan=plan_s, N=n, H=hdim, V=v, V_local=size)
        mine = {}
        try:
            if fn_tp is None:
                raise RuntimeError("not available")
            mine["ms"], mine["peak_gib"] = measure(fb(fn_tp), leaves, device, args.repeats, args.warmup)
            if fn_local is not None:
                mine["local_ms"], _ = measure(fb(fn_local), leaves, device, args.repeats, args.warmup)
        except Exception as e:  # noqa: BLE001 - e.g. OOM; the other ranks may time out
            mine["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            if args.verbose:
                traceback.print_exc()
            clear_grads(leaves)
        per_rank = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, mine)
        if dist.get_rank() == 0:
            errors = [r["error"] for r in per_rank if "error" in r]
            if errors:
                rec["error"] = errors[0]
            else:
                ms = [r["ms"] for r in per_rank]
                rec.update(ms=max(ms), ms_min=min(ms), ms_per_rank=ms,
                           peak_gib=_num(max(r["peak_gib"] for r in per_rank)),
                           peak_gib_per_rank=[_num(r["peak_gib"]) for r in per_rank])
                if all("local_ms" in r for r in per_rank):
                    local = [r["local_ms"] for r in per_rank]
                    comm = [r["ms"] - r["local_ms"] for r in per_rank]
                    rec.update(local_ms=max(local), local_ms_per_rank=local, comm_ms=max(comm),
                               comm_pct=100.0 * max(c / r["ms"] for c, r in zip(comm, per_rank)))
            records.append(rec)
            emit(rec)
            msg = rec.get("error") or (f"{rec['ms']:.2f} ms (min rank {rec['ms_min']:.2f}), peak "
                                       f"{_fmt(rec['peak_gib'], '.3f')} GiB, local {_fmt(rec.get('local_ms'), '.2f')} ms")
            print(f"perf tp={tp} {name:<16} {plan_s:<8} {msg}", flush=True)
    return records


def _fmt(x, spec):
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def print_table(records, shape, world, backend, n_checks, n_fail):
    n, hdim, v = shape
    print(f"\n## launch.bench.tp: world {world} ({backend}), fwd+bwd per rank, N={n} H={hdim} V={v} bf16; "
          f"correctness {n_checks - n_fail}/{n_checks} ok")
    print("| TP | method | input | plan | ms (max rank) | peak GiB | local ms | comm ms | comm % |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in records:
        if "error" in r:
            print(f"| {r['tp']} | {r['method']} | {r['input']} | {r['plan']} | {r['error']} | | | | |")
            continue
        print(f"| {r['tp']} | {r['method']} | {r['input']} | {r['plan']} | {r['ms']:.2f} | {_fmt(r['peak_gib'], '.3f')} | "
              f"{_fmt(r.get('local_ms'), '.2f')} | {_fmt(r.get('comm_ms'), '.2f')} | {_fmt(r.get('comm_pct'), '.0f')} |")


# ------------------------------------------------------------------------------------------- main

def parse_shape(s):
    return tuple(int(x) for x in s.lower().split("x"))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny shapes (implied on CPU)")
    p.add_argument("--cpu", action="store_true", help="gloo on CPU even where CUDA is available")
    p.add_argument("--shape", type=parse_shape, default=None, help="timing shape NxHxV")
    p.add_argument("--check-shape", type=parse_shape, default=None, help="correctness shape NxHxV")
    p.add_argument("--tp-sizes", default=None, help="comma list of TP degrees (default: W, and 4, 2 when W >= 4)")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ref64-max-elems", type=int, default=REF64_MAX_ELEMS, help="float64 reference only if N*V <= this")
    p.add_argument("--skip-check", action="store_true")
    p.add_argument("--skip-perf", action="store_true")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds before a collective gives up")
    p.add_argument("--out", default=None, help="append one JSON line per measurement to this file (rank 0)")
    p.add_argument("--verbose", action="store_true")
    args = p.parse_args(argv)
    if args.repeats < 1 or args.warmup < 0:
        p.error("--repeats must be >= 1 and --warmup >= 0")

    device, timeout = setup(args)
    rank, world = dist.get_rank(), dist.get_world_size()
    small = args.smoke or device.type == "cpu"
    perf_shape = args.shape or (SMALL_PERF_SHAPE if small else PERF_SHAPE)
    check_shape = args.check_shape or (SMALL_CHECK_SHAPE if small else CHECK_SHAPE)
    sizes = tp_sizes(world, args.tp_sizes)
    groups = make_groups(sizes, world, rank, timeout)
    meshes = {}
    for s, g in groups.items():
        try:
            meshes[s] = make_mesh(g, device)
        except Exception as e:  # noqa: BLE001 - loss_parallel rows then say so
            if rank == 0:
                print(f"# no DeviceMesh for tp={s}: {type(e).__name__}: {e}", flush=True)

    backend = dist.get_backend()
    env = dict(torch=torch.__version__, world=world, backend=backend,
               device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               kernels=vparallel_ce.kernels.ops_for(torch.empty(1, 1, device=device, dtype=torch.bfloat16)).name)
    fh = open(args.out, "a") if (args.out and rank == 0) else None
    if rank == 0:
        print("#", json.dumps({**env, "tp_sizes": sizes, "check_shape": check_shape, "perf_shape": perf_shape}),
              flush=True)
    n_checks = 0

    def emit(rec):
        nonlocal n_checks
        n_checks += rec["kind"] == "check" and rec["gating"]
        if fh:
            fh.write(json.dumps({**rec, **env}) + "\n")
            fh.flush()

    failures = 0
    records = []
    t0 = time.perf_counter()
    try:
        if not args.skip_check:
            failures = check_all(args, check_shape, groups, meshes, device, emit)
        if not args.skip_perf:
            records = perf_all(args, perf_shape, groups, meshes, device, emit)
        if rank == 0:
            print(f"\ncorrectness: {'FAILED ' + str(failures) + ' of ' if failures else 'ok, all '}{n_checks} "
                  f"checks of ours; total {time.perf_counter() - t0:.1f}s", flush=True)
            print_table(records, perf_shape, world, backend, n_checks, failures)
    finally:
        if fh:
            fh.close()
    dist.barrier()
    dist.destroy_process_group()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
