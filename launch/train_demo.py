"""Train a tiny Llama with vparallel_ce's losses under DP x TP x PP, then check it against one process.

    torchrun --nproc_per_node 8 launch/train_demo.py                       # dp2 x tp2 x pp2, fused loss
    torchrun --nproc_per_node 8 launch/train_demo.py --loss chunked --tp 4 --pp 2 --dp 1 --sp
    torchrun --nproc_per_node 2 launch/train_demo.py --loss naive --dp 2

NCCL, one GPU per local rank, bf16 compute where CUDA is available; else gloo on CPU in fp32. The
ranks form a DeviceMesh (pp, dp, tp): TP is DTensor ``parallelize_module`` (the lm_head's output
left vocab-sharded; ``--sp``: sequence parallel), PP ``torch.distributed.pipelining`` (1F1B, each
rank builds only its stage), DP FSDP2. ``--loss naive`` gathers the logits for ``F.cross_entropy``,
``chunked`` is ``vparallel_ce.cross_entropy`` on the logits shards, ``fused`` (default)
``vparallel_ce.linear_cross_entropy`` on the hidden states and the lm_head shard. Each microbatch
loss is a SUM divided by the valid-token count of the whole step (``vparallel_ce.pipeline``), so
the step loss is the token mean in every layout and FSDP sums gradients over DP.

The verdict: rank 0 builds the whole model in one process (each parameter is drawn from
``(--seed, its name)``, so it equals the sharded one), runs step 1's batch through it with plain
``F.cross_entropy``, compares loss and gradient norm with the parallel step 1 and prints ``OK``, or
``MISMATCH`` and every rank exits 1. Several nodes: launch/cluster/multinode.sh.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

import demo_model as llama  # launch/ is sys.path[0] when this file runs as a script
import vparallel_ce
from vparallel_ce.pipeline import PipelineLoss, count_valid_tokens, sequence_shard, step_loss

IGNORE = -100
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2}  # relative, against the fp32 reference


def positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return int(text)


def parse_args(world: int) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="train_demo.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(llama.CONFIGS), default="tiny")
    p.add_argument("--tp", type=positive, help="tensor parallel degree (default 2 where the ranks allow)")
    p.add_argument("--pp", type=positive, help="pipeline stages (default 2 where the ranks left allow)")
    p.add_argument("--dp", type=positive, help="data parallel degree (default: the ranks left)")
    p.add_argument("--sp", action="store_true", help="sequence parallelism in the TP group")
    p.add_argument("--loss", choices=("naive", "chunked", "fused"), default="fused")
    p.add_argument("--steps", type=positive, default=80)
    p.add_argument("--batch-size", type=positive, default=16, help="global sequences per step")
    p.add_argument("--seq-len", type=positive, default=128)
    p.add_argument("--microbatches", type=positive, help="per DP rank and step (default: --pp)")
    p.add_argument("--lr", type=float, help="AdamW learning rate (default 3e-3 tiny, else 3e-4)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-check", action="store_true", help="skip the one-process reference (large models)")
    a = p.parse_args()
    rest = world // math.prod(x for x in (a.tp, a.pp, a.dp) if x)  # ranks left for the unset degrees
    for name in ("tp", "pp", "dp"):
        if getattr(a, name) is None:
            setattr(a, name, rest if name == "dp" else 2 if rest % 2 == 0 else 1)
            rest //= getattr(a, name) or 1
    if a.tp * a.pp * a.dp != world:
        p.error(f"tp*pp*dp = {a.tp}*{a.pp}*{a.dp} but the world size is {world}")
    a.microbatches, a.sp = a.microbatches or a.pp, a.sp and a.tp > 1
    a.lr = a.lr or (3e-3 if a.model == "tiny" else 3e-4)
    cfg = llama.CONFIGS[a.model]
    for bad, message in ((cfg.n_kv_heads % a.tp, f"--tp {a.tp} does not divide the {cfg.n_kv_heads} kv heads"),
                         (cfg.n_layers < a.pp, f"--pp {a.pp} is more than the {cfg.n_layers} layers"),
                         (a.microbatches < a.pp, f"--microbatches must be >= --pp ({a.pp})"),
                         (a.batch_size % (a.dp * a.microbatches), "--batch-size must split over dp x microbatches"),
                         (a.sp and a.seq_len % a.tp, "--sp needs --seq-len divisible by --tp")):
        if bad:
            p.error(message)
    return a


def global_batch(step: int, args, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s batch, the same in every layout: inputs and labels [B, S] int64 on CPU.

    Seeded Markov text (every token has 4 possible successors, so the loss can fall from ln V
    towards ln 4), each sequence with a random padded tail (labels -100, up to a quarter), so DP
    ranks and microbatches hold different numbers of valid tokens."""
    b, s = args.batch_size, args.seq_len
    successors = torch.randint(vocab, (vocab, 4), generator=torch.Generator().manual_seed(args.seed))
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
    tokens = torch.empty(b, s + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(vocab, (b,), generator=g)
    choice = torch.randint(4, (b, s), generator=g)
    for t in range(s):
        tokens[:, t + 1] = successors[tokens[:, t], choice[:, t]]
    pad = torch.randint(s // 4 + 1, (b, 1), generator=g)
    # contiguous: a pipeline stage checks its inputs' strides against the shapes it was built with
    return tokens[:, :-1].contiguous(), tokens[:, 1:].masked_fill(torch.arange(s) >= s - pad, IGNORE)


def apply_fsdp(stage: llama.Transformer, dp_mesh, dtype: torch.dtype, pp: int) -> None:
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for block in stage.layers.values():  # under PP a block runs once per microbatch: keep it gathered
        fully_shard(block, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=pp == 1)
    # never resharded after forward: the fused loss uses the gathered lm_head weight in backward
    fully_shard(stage, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=False)
    for module in stage.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)  # sum over DP: the loss counts every rank's tokens
            if hasattr(module, "set_force_sum_reduction_for_comms"):
                module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM


def build_stage(args, cfg, mesh, device, dtype) -> llama.Transformer:
    """This rank's pipeline stage, initialised at full size from the seed, then sharded."""
    pp_rank = mesh["pp"].get_local_rank()
    base, extra = divmod(cfg.n_layers, args.pp)  # contiguous layers; earlier stages take the remainder
    start = pp_rank * base + min(pp_rank, extra)
    with torch.device(device):
        stage = llama.Transformer(cfg)
    stage.keep_only(range(start, start + base + (pp_rank < extra)), pp_rank == 0, pp_rank == args.pp - 1)
    llama.init_weights(stage, args.seed)
    if stage.output is not None and args.loss == "fused":
        stage.head_mode = "hidden"  # forward returns (hidden, lm_head weight shard): no logits
    if args.tp > 1:
        llama.apply_tp(stage, mesh["tp"], args.sp)
    apply_fsdp(stage, mesh["dp"], dtype, args.pp)
    return stage


def make_loss_sum(args, tp_mesh):
    """fn(stage output, labels [B, S]) -> SUM of the loss over the valid tokens (vparallel_ce's registry)."""
    group = tp_mesh.get_group() if args.tp > 1 else None
    options = {"group": group, "ignore_index": IGNORE, "reduction": "sum"}
    if args.loss == "fused":
        options["sequence_parallel"] = args.sp
    fn = vparallel_ce.build_loss_fn(args.loss, **options)
    if args.loss != "fused":
        return fn  # logits [B, S, V/tp], this rank's vocab shard

    def fused(output, labels):
        hidden, weight = output  # [B, S, D] (SP: this rank's [B, S/tp, D]), [V/tp, D]
        if options["sequence_parallel"]:
            labels = sequence_shard(hidden, labels, group=group, dim=1)
        return fn(hidden.flatten(0, 1), weight, labels.flatten())

    return fused


def grad_norm(stage, pp_group, device) -> float:
    """L2 norm of the whole model's gradient (every shard, every stage), the same on every rank."""
    sq = torch.zeros((), dtype=torch.float64, device=device)
    for p in stage.parameters():
        norm = torch.linalg.vector_norm(p.grad, dtype=torch.float64)  # a DTensor's: over all its shards
        sq += (norm.full_tensor() if isinstance(norm, DTensor) else norm) ** 2
    dist.all_reduce(sq, group=pp_group)  # the stages
    return sq.sqrt().item()


def reference(args, cfg, device) -> tuple[float, float]:
    """Step 1 in one process: the whole model in fp32, plain F.cross_entropy -> (loss, grad norm)."""
    with torch.device(device):
        model = llama.Transformer(cfg)
    llama.init_weights(model, args.seed)
    inputs, labels = global_batch(1, args, cfg.vocab_size)
    logits = model(inputs.to(device))
    loss = F.cross_entropy(logits.float().flatten(0, 1), labels.to(device).flatten(), ignore_index=IGNORE)
    loss.backward()
    return loss.item(), math.sqrt(sum(p.grad.double().square().sum().item() for p in model.parameters()))


def log(message: str) -> None:
    if dist.get_rank() == 0:
        print(message, flush=True)


def train(args, cfg, mesh, device, dtype) -> tuple[float, float]:
    """Train ``args.steps`` steps, one line each; returns step 1's (loss, gradient norm)."""
    pp_group, dp_group = mesh["pp"].get_group(), mesh["dp"].get_group()
    pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    stage = build_stage(args, cfg, mesh, device, dtype)
    last = stage.output is not None  # the last pipeline stage: the loss is computed there
    optimizer = torch.optim.AdamW(stage.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    loss_fn = PipelineLoss(make_loss_sum(args, mesh["tp"]))
    schedule = None
    if args.pp > 1:  # every stage gets the loss: a schedule without one runs no backward
        # (imported here: the pipelining package imports torch._dynamo, a second or two per rank)
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B

        schedule = Schedule1F1B(PipelineStage(stage, pp_rank, args.pp, device, group=pp_group),
                                n_microbatches=args.microbatches, loss_fn=loss_fn, scale_grads=False)
    rows = slice(dp_rank * args.batch_size // args.dp, (dp_rank + 1) * args.batch_size // args.dp)
    start, first = time.perf_counter(), None
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        inputs, labels = (x[rows].to(device) for x in global_batch(step, args, cfg.vocab_size))
        tokens = count_valid_tokens(labels, ignore_index=IGNORE, group=dp_group)  # the step's, over DP
        optimizer.zero_grad(set_to_none=True)
        losses = []
        if schedule is not None:
            loss_fn.step(schedule, *([inputs] if pp_rank == 0 else []), target=labels if last else None,
                         losses=losses, global_valid_tokens=tokens)
        else:  # microbatches accumulate gradients
            for x, y in zip(inputs.chunk(args.microbatches), labels.chunk(args.microbatches), strict=True):
                mb_loss = loss_fn(stage(x), y, global_valid_tokens=tokens)
                mb_loss.backward()
                losses.append(mb_loss.detach())
        norm = grad_norm(stage, pp_group, device) if step == 1 else None
        optimizer.step()
        loss = step_loss(losses, pp_group=pp_group, dp_group=dp_group).item()  # the step's mean, every rank
        first = first or (loss, norm)
        line = f"step: {step}  loss: {loss:.6f}" + (f"  grad_norm: {norm:.6f}" if norm is not None else "")
        if device.type == "cuda":  # throughput means something on GPUs only
            tps = args.batch_size * args.seq_len / ((time.perf_counter() - t0) * dist.get_world_size())
            line += f"  memory: {torch.cuda.max_memory_reserved(device) / 2**30:.2f}GiB  tps: {round(tps):,}"
        log(line)
    log(f"done: {args.steps} steps in {time.perf_counter() - start:.1f}s, final loss {loss:.4f}")
    return first


def check(args, cfg, device, dtype, got: float, got_norm: float) -> str:
    """Rank 0: step 1 against the one-process reference -> "OK" or "MISMATCH: ..."."""
    want, want_norm = reference(args, cfg, device)
    err, err_norm, tol = abs(got - want) / abs(want), abs(got_norm - want_norm) / want_norm, TOLERANCE[dtype]
    log(f"check, step 1 against one process with F.cross_entropy: loss {got:.6f} vs {want:.6f} (rel {err:.1e}), "
        f"grad norm {got_norm:.6f} vs {want_norm:.6f} (rel {err_norm:.1e}), tolerance {tol:.0e}")
    if err <= tol and err_norm <= tol:  # False for NaN too
        return "OK"
    return f"MISMATCH: relative error {max(err, err_norm):.1e} > {tol:.0e}"


def main() -> int:
    if "RANK" not in os.environ:  # plain `python launch/train_demo.py`: a group of one
        os.environ.update(RANK="0", WORLD_SIZE="1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
    args = parse_args(int(os.environ["WORLD_SIZE"]))
    cfg = llama.CONFIGS[args.model]
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", **({"device_id": device} if cuda else {}))
    mesh = init_device_mesh(device.type, (args.pp, args.dp, args.tp), mesh_dim_names=("pp", "dp", "tp"))
    # FSDP2 warns about views as module outputs; the stage outputs are never modified in place
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    log(f"model {args.model} ({llama.count_params(cfg)[0] / 1e6:.1f}M params)  layout pp{args.pp} x dp{args.dp} "
        f"x tp{args.tp}{' +sp' if args.sp else ''}  loss {args.loss}  {str(dtype)[6:]}  {dist.get_backend()}")
    loss, norm = train(args, cfg, mesh, device, dtype)
    verdict = ["no check (--no-check)"]
    if dist.get_rank() == 0 and not args.no_check:
        verdict = [check(args, cfg, device, dtype, loss, norm)]
    dist.broadcast_object_list(verdict, src=0)
    log(verdict[0])
    dist.destroy_process_group()
    return 1 if verdict[0].startswith("MISMATCH") else 0


if __name__ == "__main__":
    code = main()
    # Exit without interpreter finalisation: gloo's worker threads may still be releasing the last
    # collective's tensors then, and that needs the GIL of an interpreter being torn down (SIGABRT after a
    # successful run). The process group is destroyed already; nothing is left to clean up.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
