#!/usr/bin/env python
"""Train a Llama-3 style model with vparallel_ce's losses under any DP x TP x PP layout.

    torchrun --nproc_per_node 8 launch/train_demo.py                 # tiny model, dp2 x tp2 x pp2
    torchrun --nproc_per_node 8 launch/train_demo.py --loss fused --sp --tp 4 --pp 2 --dp 1

Backend: NCCL when CUDA is available (one GPU per local rank), else gloo on CPU.

Layout. A DeviceMesh over (pp, dp, tp):
  * TP: DTensor ``parallelize_module``; attention and MLP colwise/rowwise, embedding
    rowwise, lm_head colwise with its output left vocab-sharded; ``--sp`` adds
    sequence parallelism (norms and the residual stream sharded along the sequence).
  * PP: each rank builds its stage from the full model definition (``keep_only``),
    and runs ``torch.distributed.pipelining`` (1F1B) with ``scale_grads=False``.
  * DP: FSDP2 ``fully_shard`` over the dp mesh dim (also when dp == 1, so that one code
    path handles mixed precision).

Loss. Every loss is a SUM over a microbatch's valid tokens (labels != -100) divided by
the GLOBAL number of valid tokens of the step (all microbatches, all DP ranks), so the
step loss is the mean over the step's tokens whatever the layout. DP gradient
averaging is therefore switched off (FSDP2 divide factor 1): the denominator already
counts every DP rank's tokens.
  --loss naive    gather the vocab-sharded logits, F.cross_entropy (the reference)
  --loss chunked  vparallel_ce.cross_entropy on the vocab-sharded logits
  --loss fused    vparallel_ce.linear_cross_entropy on hidden states + the lm_head shard
                  (no logits are materialised)

Determinism across layouts. Each parameter's full value is drawn from (seed, name)
before it is sharded, and every step reads the same global batch whatever the layout,
so with --deterministic on CPU float32 the loss curves of different layouts and loss
kinds agree to float rounding.

Output, one line per step from global rank 0 (the step loss is broadcast from the last
pipeline stage), in torchtitan's format:
    step: 1  loss: 6.2383  memory: 0.31GiB(1.30%)  tps: 1,234  tflops: 0.00  mfu: 0.00%
memory = peak reserved CUDA memory (CPU: peak RSS of this process) and its % of the
device's (host's) total; tps = tokens / s / device; tflops per device from
6 * non-embedding params + 12 * L * H * Q * T FLOPs per token; mfu against the bf16
dense peak of the GPU (989 TFLOP/s for H100/H200; CPU: a nominal 100 GFLOP/s per
process, so mfu on CPU means nothing).

Checkpoints: torch.distributed.checkpoint of model, optimizer, step and data position
under --checkpoint-dir/step-NNNNNNNN. --resume continues from the newest complete
checkpoint if there is one (and starts fresh if not), so the same command line works
under ``torchrun --max-restarts``.

Several nodes, SLURM, restarts: docs/multinode.md (launch/multinode.sh, launch/slurm_example.sbatch).
"""

from __future__ import annotations

import argparse
import math
import os
import re
import resource
import shutil
import sys
import time
import warnings
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch

import vparallel_ce
from vparallel_ce.pipeline import PipelineLoss, count_valid_tokens, last_stage_rank, sequence_shard, step_loss

sys.path.insert(0, str(Path(__file__).resolve().parent))  # model.py, when run from anywhere
import model as llama  # noqa: E402

IGNORE_INDEX = -100
PROG = "train_demo.py"
CPU_PEAK_FLOPS = 100e9  # nominal 100 GFLOP/s per process; mfu on CPU is not meaningful


# ---------------------------------------------------------------------------------------
# Arguments. Everything that can be checked without a process group is checked here, so
# a bad command line gives one message from rank 0 and the same exit code everywhere,
# instead of one traceback per rank or a hang in a collective.


class UsageError(Exception):
    pass


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def exit_quietly_after_rank0(code: int):
    """Exit with ``code`` on a rank other than 0, after a grace period.

    torchrun stops all workers as soon as one fails; a rank that failed first could get
    rank 0 killed before it has printed the message. Waiting here lets rank 0 print and
    exit first (torchrun then stops this rank, or it exits by itself with the same code).
    """
    time.sleep(5.0)
    sys.exit(code)


class _RankZeroParser(argparse.ArgumentParser):
    """argparse that prints (usage, help, errors) on global rank 0 only."""

    def _print_message(self, message, file=None):
        if _rank() == 0:
            super()._print_message(message, file)

    def exit(self, status=0, message=None):
        if status and _rank() != 0:
            exit_quietly_after_rank0(status)
        super().exit(status, message)


def _chunks_arg(value: str):
    if value == "auto":
        return value
    if value.isdigit() and int(value) >= 1:
        return int(value)
    raise argparse.ArgumentTypeError(f"expected 'auto' or a positive integer, got {value!r}")


def build_parser() -> argparse.ArgumentParser:
    p = _RankZeroParser(prog=PROG, description="Llama-style training demo for vparallel_ce "
                        "(run under torchrun).", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", choices=sorted(llama.CONFIGS), default="tiny")
    p.add_argument("--n-layers", type=int, default=None, help="override the model's layer count")
    p.add_argument("--tp", type=int, default=None,
                   help="tensor-parallel degree (default: 2 if the ranks left allow it, else 1)")
    p.add_argument("--pp", type=int, default=None,
                   help="pipeline-parallel degree (default: 2 if the ranks left allow it, else 1)")
    p.add_argument("--dp", type=int, default=None, help="data-parallel degree (default: world / (tp * pp))")
    p.add_argument("--sp", action="store_true", help="sequence parallelism on the TP group")
    p.add_argument("--loss", choices=("naive", "chunked", "fused"), default="fused")
    p.add_argument("--chunks", type=_chunks_arg, default="auto", help="token chunks of the loss: auto or K")
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--batch-size", type=int, default=16, help="global sequences per step")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--microbatches", type=int, default=None,
                   help="microbatches per DP rank and step (default: pp; with pp=1 they accumulate gradients)")
    p.add_argument("--lr", type=float, default=None, help="AdamW learning rate (default: 3e-3 tiny, 3e-4 else)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--deterministic", action="store_true",
                   help="deterministic algorithms (and cuBLAS workspace config on GPU)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                   help="parameter/compute dtype (FSDP keeps fp32 master weights and reduces in fp32); "
                        "default bfloat16 on GPU, float32 on CPU")
    p.add_argument("--data", type=Path, default=None,
                   help="token file: .txt = raw text as bytes; anything else = flat numpy memmap of "
                        "token ids (nanoGPT/Megatron .bin) of --data-dtype. Default: seeded synthetic tokens")
    p.add_argument("--data-dtype", choices=("uint16", "uint32"), default="uint16")
    p.add_argument("--checkpoint-dir", type=Path, default=None)
    p.add_argument("--checkpoint-every", type=int, default=0,
                   help="save every K steps (0: only after the last step, when --checkpoint-dir is set)")
    p.add_argument("--keep-checkpoints", type=int, default=2, help="newest checkpoints to keep (0: all)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest complete checkpoint in --checkpoint-dir, if any")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds before a collective gives up (so a dead peer cannot hang the job)")
    p.add_argument("--log-digits", type=int, default=4, help="decimals of the printed loss")
    p.add_argument("--fail-at-step", type=int, default=None,
                   help="testing: the last rank dies at this step on the first attempt (torchrun restart 0)")
    return p


def resolve_layout(args, world: int) -> None:
    """Fill in --tp/--pp/--dp left unset: tp, then pp, take 2 when the ranks left are even."""
    given = [v for v in (args.tp, args.pp, args.dp) if v is not None]
    if any(v < 1 for v in given):
        raise UsageError("--tp, --pp and --dp must be >= 1")
    fixed = math.prod(given)
    if world % fixed:
        raise UsageError(f"tp*pp*dp={fixed} (given) does not divide the world size {world}")
    rest = world // fixed
    for name in ("tp", "pp"):
        if getattr(args, name) is None:
            setattr(args, name, 2 if rest % 2 == 0 else 1)
            rest //= getattr(args, name)
    if args.dp is None:
        args.dp = rest
    if args.tp * args.pp * args.dp != world:
        raise UsageError(f"tp*pp*dp = {args.tp}*{args.pp}*{args.dp} = {args.tp * args.pp * args.dp} "
                         f"but the world size is {world}")


def model_config(args) -> llama.ModelArgs:
    overrides = {} if args.n_layers is None else {"n_layers": args.n_layers}
    return llama.get_config(args.model, **overrides)


def validate(args, world: int) -> None:
    """Raise UsageError for any problem that is visible before the process group exists."""
    resolve_layout(args, world)
    if args.n_layers is not None and args.n_layers < 1:
        raise UsageError("--n-layers must be >= 1")
    cfg = model_config(args)
    if args.tp > 1:
        for what, n in (("heads", cfg.n_heads), ("kv heads", cfg.n_kv_heads)):
            if n % args.tp:
                raise UsageError(f"--model {args.model} has {n} {what}, not divisible by --tp {args.tp}")
    if cfg.n_layers < args.pp:
        raise UsageError(f"the model has {cfg.n_layers} layers, fewer than --pp {args.pp} stages")
    if args.sp and args.tp > 1 and args.seq_len % args.tp:
        raise UsageError(f"--sp needs --seq-len ({args.seq_len}) divisible by --tp ({args.tp})")
    for name in ("steps", "batch_size", "seq_len"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1")
    if args.microbatches is None:
        args.microbatches = args.pp
    if args.microbatches < 1:
        raise UsageError("--microbatches must be >= 1")
    if args.pp > 1 and args.microbatches < args.pp:
        raise UsageError(f"the 1F1B pipeline schedule needs --microbatches >= --pp ({args.pp}), "
                         f"got {args.microbatches}")
    if args.batch_size % (args.dp * args.microbatches):
        raise UsageError(f"--batch-size {args.batch_size} must be divisible by dp*microbatches = "
                         f"{args.dp}*{args.microbatches}")
    if args.lr is None:
        args.lr = 3e-3 if args.model == "tiny" else 3e-4
    if args.lr <= 0:
        raise UsageError("--lr must be > 0")
    if args.checkpoint_every < 0 or args.keep_checkpoints < 0:
        raise UsageError("--checkpoint-every and --keep-checkpoints must be >= 0")
    if (args.resume or args.checkpoint_every) and args.checkpoint_dir is None:
        raise UsageError("--resume and --checkpoint-every need --checkpoint-dir")
    if args.timeout <= 0:
        raise UsageError("--timeout must be > 0")
    if args.data is not None:
        if not args.data.is_file():
            raise UsageError(f"--data {args.data}: no such file")
        n_tokens = token_count(args.data, args.data_dtype)
        if n_tokens < args.seq_len + 1:
            raise UsageError(f"--data {args.data} holds {n_tokens} tokens, fewer than --seq-len + 1 "
                             f"= {args.seq_len + 1}")
        top = int(open_tokens(args.data, args.data_dtype)[: 1 << 24].max())
        if top >= cfg.vocab_size:
            raise UsageError(f"--data {args.data} has token id {top} >= vocab size {cfg.vocab_size} of "
                             f"--model {args.model} (wrong --data-dtype?)")
    if torch.cuda.is_available():
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        if local_world > torch.cuda.device_count():
            raise UsageError(f"{local_world} processes on this node but only "
                             f"{torch.cuda.device_count()} GPUs")
    if args.dtype is None:
        args.dtype = "bfloat16" if torch.cuda.is_available() else "float32"


# ---------------------------------------------------------------------------------------
# Data. A step reads the SAME global batch whatever the layout: windows
# [data_pos, data_pos + batch_size) of seq_len + 1 tokens; DP rank d trains on rows
# [d * B/dp, (d+1) * B/dp). data_pos is the checkpointed data position.


def open_tokens(path: Path, dtype: str) -> np.ndarray:
    if path.suffix == ".txt":
        return np.fromfile(path, dtype=np.uint8)  # byte-level "tokenizer": ids 0..255
    return np.memmap(path, dtype=np.dtype(dtype), mode="r")


def token_count(path: Path, dtype: str) -> int:
    itemsize = 1 if path.suffix == ".txt" else np.dtype(dtype).itemsize
    return path.stat().st_size // itemsize


class FileTokens:
    """Non-overlapping windows of seq_len + 1 tokens of a token file (wrapping around)."""

    def __init__(self, path: Path, dtype: str, seq_len: int):
        self.tokens = open_tokens(path, dtype)
        self.seq_len = seq_len
        self.n_windows = max(1, (len(self.tokens) - 1) // seq_len)

    def windows(self, start: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """-> (tokens [count, L+1] int64, label mask [count, L] bool, True = counted)."""
        idx = (start + np.arange(count)) % self.n_windows
        rows = np.stack([self.tokens[i * self.seq_len: i * self.seq_len + self.seq_len + 1] for i in idx])
        return rows.astype(np.int64), np.ones((count, self.seq_len), dtype=bool)


class SyntheticTokens:
    """Seeded, learnable synthetic text: a random Markov chain in which every token has
    4 equally likely successors (so the loss can fall from ln V towards ln 4), and a
    random tail of each sequence (up to a quarter) is padding whose labels are ignored
    (-100), so DP ranks and microbatches see different numbers of valid tokens and the
    global-token normalisation is exercised. Window w depends only on (seed, w)."""

    def __init__(self, vocab_size: int, seq_len: int, seed: int):
        self.seq_len, self.seed, self.vocab = seq_len, seed, vocab_size
        self.successors = np.random.default_rng([seed, 0]).integers(0, vocab_size, size=(vocab_size, 4))

    def windows(self, start: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        n = self.seq_len
        rngs = [np.random.default_rng([self.seed, 1, start + i]) for i in range(count)]
        first = np.array([r.integers(0, self.vocab) for r in rngs])
        choice = np.stack([r.integers(0, 4, size=n) for r in rngs])
        pad = np.array([r.integers(0, n // 4 + 1) for r in rngs])
        tokens = np.empty((count, n + 1), dtype=np.int64)
        tokens[:, 0] = first
        for t in range(n):
            tokens[:, t + 1] = self.successors[tokens[:, t], choice[:, t]]
        mask = np.arange(n)[None, :] < (n - pad)[:, None]
        return tokens, mask


def make_data(args, cfg):
    if args.data is None:
        return SyntheticTokens(cfg.vocab_size, args.seq_len, args.seed)
    return FileTokens(args.data, args.data_dtype, args.seq_len)


def global_batch(data, data_pos: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """-> inputs [B, L] and labels [B, L] (IGNORE_INDEX where masked), int64 on CPU."""
    tokens, mask = data.windows(data_pos, batch_size)
    inputs = torch.from_numpy(tokens[:, :-1].copy())
    labels = torch.from_numpy(np.where(mask, tokens[:, 1:], IGNORE_INDEX))
    return inputs, labels


# ---------------------------------------------------------------------------------------
# The three losses. Each returns a SUM; vparallel_ce.pipeline.PipelineLoss divides it by
# the step's global valid-token count, with or without a pipeline.


def make_loss_sum(kind: str, tp_mesh, sp: bool, chunks):
    """fn(output, labels) -> fp32 SUM of the loss over labels' valid tokens.

    output: logits [B, S, V/tp] (this rank's vocab shard), or for "fused" the pair
    (hidden [B, S, D] (SP: [B, S/tp, D]), lm_head weight shard [V/tp, D]).
    labels: [B, S], the same on every TP rank.
    """
    tp = tp_mesh.size() if tp_mesh is not None else 1
    group = tp_mesh.get_group() if tp > 1 else None
    sp = sp and tp > 1
    # The loss is configured by name (vparallel_ce's registry): "naive" is the reference that
    # gathers the full logits and upcasts them; the other two never gather.
    options = {"group": group, "ignore_index": IGNORE_INDEX, "reduction": "sum"}
    if kind != "naive":
        options["chunks"] = chunks
    if kind == "fused":
        options["sequence_parallel"] = sp
    fn = vparallel_ce.build_loss_fn(kind, **options)
    if kind != "fused":
        return fn

    def loss_sum(output, labels):
        hidden, weight = output
        if sp:
            # The hidden states are this rank's torch.chunk of the sequence: take the
            # matching labels the library's way. Flattening [B, S/tp] pairs row i with label i.
            labels = sequence_shard(hidden, labels, group=group, dim=1)
        return fn(hidden.flatten(0, 1), weight, labels.flatten())

    return loss_sum


# ---------------------------------------------------------------------------------------
# Parallelisation.


def stage_layers(n_layers: int, pp: int, stage: int) -> range:
    """Contiguous layer ids of ``stage``; earlier stages take the remainder (they hold no
    lm_head, which is the largest single matmul)."""
    base, extra = divmod(n_layers, pp)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (1 if stage < extra else 0))


def apply_tp(stage: llama.Transformer, tp_mesh, sp: bool) -> None:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    # Layout of the residual stream between blocks: replicated, or sharded on the sequence.
    seq = Shard(1) if sp else Replicate()
    top = {}
    if stage.tok_embeddings is not None:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
    if stage.output is not None:
        if sp:
            top["norm"] = SequenceParallel()
        # The lm_head's output stays vocab-sharded: the loss works on the shards.
        top["output"] = ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=True)
    if top:
        parallelize_module(stage, tp_mesh, top)
    for block in stage.layers.values():
        plan = {
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=seq),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=seq),
        }
        if sp:
            gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                        use_local_output=True)
            plan.update({"attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel(),
                         "attention": gather, "feed_forward": gather})
        parallelize_module(block, tp_mesh, plan)


def apply_fsdp(stage: llama.Transformer, dp_mesh, dtype: torch.dtype, pp: int) -> None:
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    # Under PP a block runs once per microbatch: keep it gathered between microbatches.
    for block in stage.layers.values():
        fully_shard(block, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=pp == 1)
    # The root (embedding, final norm, lm_head) is never resharded after forward: the fused
    # loss uses the gathered lm_head weight that forward returned, in backward.
    fully_shard(stage, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=False)
    for module in stage.modules():
        if isinstance(module, FSDPModule):
            # Sum, not average, over DP: the loss is already divided by the global token count.
            module.set_gradient_divide_factor(1.0)
            if hasattr(module, "set_force_sum_reduction_for_comms"):
                # plain SUM collectives (gloo has no PREMUL_SUM)
                module.set_force_sum_reduction_for_comms(True)


# ---------------------------------------------------------------------------------------
# Checkpoints (torch.distributed.checkpoint). One directory per saved step; DCP writes
# .metadata last, so a directory without it is an interrupted save and is skipped.


def checkpoint_path(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def latest_checkpoint(root: Path | None) -> Path | None:
    if root is None or not root.is_dir():
        return None
    done = [p for p in root.iterdir() if re.fullmatch(r"step-\d{8}", p.name) and (p / ".metadata").exists()]
    return max(done, key=lambda p: p.name, default=None)


def _state_options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # Optimizer state keyed by parameter name (not by position in param_groups): pipeline
    # stages own different parameters, and position-keyed entries of different stages
    # would collide in the checkpoint.
    return StateDictOptions(flatten_optimizer_state_dict=True)


def _state(stage, optimizer, step: int, data_pos: int) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(stage, optimizer, options=_state_options())
    return {"model": model_sd, "optim": optim_sd, "train": {"step": step, "data_pos": data_pos}}


def save_checkpoint(root: Path, stage, optimizer, step: int, data_pos: int, keep: int, rank: int) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    dcp.save(_state(stage, optimizer, step, data_pos), checkpoint_id=str(checkpoint_path(root, step)))
    dist.barrier()
    if rank == 0 and keep:
        done = sorted(p for p in root.iterdir() if re.fullmatch(r"step-\d{8}", p.name))
        for old in done[:-keep]:
            shutil.rmtree(old, ignore_errors=True)


def load_checkpoint(path: Path, stage, optimizer) -> tuple[int, int]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state = _state(stage, optimizer, 0, 0)
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(stage, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=_state_options())
    return int(state["train"]["step"]), int(state["train"]["data_pos"])


# ---------------------------------------------------------------------------------------
# Metrics.


def peak_flops(device: torch.device) -> float:
    """Dense bf16 peak of one device (FLOP/s); a nominal value on CPU."""
    if device.type != "cuda":
        return CPU_PEAK_FLOPS
    name = torch.cuda.get_device_name(device)
    for key, peak in (("H100", 989e12), ("H200", 989e12), ("H800", 989e12), ("B200", 2250e12),
                      ("A100", 312e12), ("A800", 312e12), ("L40S", 362e12)):
        if key in name:
            return peak
    return 312e12


def memory_stats(device: torch.device) -> tuple[float, float]:
    """(peak GiB, % of total): reserved CUDA memory, or on CPU the peak RSS of this process."""
    if device.type == "cuda":
        peak = torch.cuda.max_memory_reserved(device)
        total = torch.cuda.get_device_properties(device).total_memory
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return peak / 2**30, 100.0 * peak / total


# ---------------------------------------------------------------------------------------
# Training.


def init_distributed(args, rank: int, world: int):
    """Process group (NCCL on GPU, gloo on CPU) and the (pp, dp, tp) DeviceMesh -> (device, mesh)."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    from torch.distributed.device_mesh import init_device_mesh

    use_cuda = torch.cuda.is_available()
    if use_cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    timeout = timedelta(seconds=args.timeout)
    # The mesh's sub-groups take the module default timeout (30 min for gloo), not the one
    # given to init_process_group: shorten the default too, so a dead peer ends the job.
    c10d.default_pg_timeout = timeout
    if use_cuda:
        c10d.default_pg_nccl_timeout = timeout
    init_kwargs = {"device_id": device} if use_cuda else {}
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # Under torchrun the workers talk through the agent's TCPStore, which outlives a
        # restart (--max-restarts). Keys of the previous attempt's groups (peer addresses)
        # would still be there and the new mesh's sub-groups would dial dead peers; a
        # per-attempt prefix gives each attempt a clean namespace.
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                              is_master=False, timeout=timeout)
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        init_kwargs.update(store=dist.PrefixStore(f"train_demo/attempt_{attempt}", store),
                           rank=rank, world_size=world)
    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timeout, **init_kwargs)
    # TP innermost (neighbouring ranks, one node), PP outermost (cheapest across nodes).
    mesh = init_device_mesh(device.type, (args.pp, args.dp, args.tp), mesh_dim_names=("pp", "dp", "tp"))
    return device, mesh


def build_stage(args, cfg: llama.ModelArgs, mesh, device) -> llama.Transformer:
    """This rank's pipeline stage: built at full size from the full model definition,
    initialised from the seed (values depend on (seed, parameter name) only), then
    sharded by TP and FSDP."""
    pp_rank = mesh["pp"].get_local_rank()
    first, last = pp_rank == 0, pp_rank == args.pp - 1
    with torch.device(device):
        stage = llama.Transformer(cfg)
    stage.keep_only(stage_layers(cfg.n_layers, args.pp, pp_rank), first, last)
    llama.init_weights(stage, args.seed)
    if last and args.loss == "fused":
        stage.head_mode = "hidden"
    if args.tp > 1:
        apply_tp(stage, mesh["tp"], args.sp)
    apply_fsdp(stage, mesh["dp"], getattr(torch, args.dtype), args.pp)
    return stage


def train(args, rank: int, world: int) -> None:
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    # FSDP2 warns when a module returns a view (in-place ops on it would skip its hook);
    # the stage outputs here are views of DTensor locals and are never modified in place.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    device, mesh = init_distributed(args, rank, world)
    pp_group, dp_group = mesh["pp"].get_group(), mesh["dp"].get_group()
    pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    first, last = pp_rank == 0, pp_rank == args.pp - 1
    sp = args.sp and args.tp > 1
    cfg = model_config(args)

    stage = build_stage(args, cfg, mesh, device)
    optimizer = torch.optim.AdamW(stage.parameters(), lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
                                  weight_decay=0.1)
    pipeline_loss = PipelineLoss(make_loss_sum(args.loss, mesh["tp"] if args.tp > 1 else None, sp, args.chunks))
    schedule = None
    if args.pp > 1:
        pipe_stage = PipelineStage(stage, pp_rank, args.pp, device, group=pp_group)
        schedule = Schedule1F1B(pipe_stage, n_microbatches=args.microbatches,
                                # every stage gets the loss: a schedule without one runs no backward
                                loss_fn=pipeline_loss, scale_grads=False)

    data = make_data(args, cfg)
    start_step, data_pos = 0, 0
    if args.resume:
        ckpt = latest_checkpoint(args.checkpoint_dir)
        if ckpt is not None:
            start_step, data_pos = load_checkpoint(ckpt, stage, optimizer)
            log(rank, f"resumed from {ckpt} at step {start_step}")
        else:
            log(rank, f"no checkpoint in {args.checkpoint_dir}; starting from step 0")

    flops_token = llama.flops_per_token(cfg, args.seq_len)
    peak = peak_flops(device)
    local_b = args.batch_size // args.dp
    losses_logged, tps_logged, t_start = [], [], time.perf_counter()
    log(rank, f"model {args.model} ({llama.count_params(cfg)[0] / 1e6:.1f}M params)  "
              f"layout pp{args.pp} x dp{args.dp} x tp{args.tp}{' +sp' if sp else ''}  loss {args.loss}  "
              f"dtype {args.dtype}  backend {dist.get_backend()}  world {world}")

    for step in range(start_step + 1, args.steps + 1):
        if args.fail_at_step == step and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" \
                and rank == world - 1:
            print(f"[rank {rank}] simulated failure at step {step}", file=sys.stderr, flush=True)
            os._exit(13)
        t0 = time.perf_counter()
        inputs, labels = global_batch(data, data_pos, args.batch_size)
        data_pos += args.batch_size
        rows = slice(dp_rank * local_b, (dp_rank + 1) * local_b)
        inputs, labels = inputs[rows].to(device), labels[rows].to(device)
        # Valid tokens of the whole step on all DP ranks: the one denominator of every
        # microbatch loss (a device tensor, no host sync).
        global_tokens = count_valid_tokens(labels, ignore_index=IGNORE_INDEX, group=dp_group)

        optimizer.zero_grad(set_to_none=True)
        losses = []
        if schedule is not None:
            # step() hands global_tokens to every microbatch's loss (as loss_kwargs where this
            # torch supports them, else through a context) and runs the backward.
            pipeline_loss.step(schedule, *([inputs] if first else []), target=labels if last else None,
                               losses=losses, global_valid_tokens=global_tokens)
        else:
            for x, y in zip(inputs.chunk(args.microbatches), labels.chunk(args.microbatches), strict=True):
                mb_loss = pipeline_loss(stage(x), y, global_valid_tokens=global_tokens)
                mb_loss.backward()
                losses.append(mb_loss.detach())
        optimizer.step()
        # Sum over microbatches and DP ranks of (loss sum / global valid tokens) = the mean
        # over the step's valid tokens; broadcast from the last stage so rank 0 can print it.
        loss = step_loss(losses, pp_group=pp_group if schedule is not None else None,
                         src=last_stage_rank(schedule) if schedule is not None else None, dp_group=dp_group)
        loss_value = loss.item()
        dt = time.perf_counter() - t0

        tps = args.batch_size * args.seq_len / (dt * world)  # = per-DP-rank tokens / (dt * tp * pp)
        tflops = tps * flops_token / 1e12
        mem_gib, mem_pct = memory_stats(device)
        losses_logged.append(loss_value)
        tps_logged.append(tps)
        log(rank, f"step: {step}  loss: {loss_value:.{args.log_digits}f}  memory: {mem_gib:.2f}GiB({mem_pct:.2f}%)"
                  f"  tps: {round(tps):,}  tflops: {tflops:.2f}  mfu: {100 * tflops * 1e12 / peak:.2f}%")
        if not math.isfinite(loss_value):
            raise FloatingPointError(f"loss is {loss_value} at step {step}")

        if args.checkpoint_dir is not None and (
                (args.checkpoint_every and step % args.checkpoint_every == 0)
                or (not args.checkpoint_every and step == args.steps)):
            save_checkpoint(args.checkpoint_dir, stage, optimizer, step, data_pos, args.keep_checkpoints, rank)

    wall = time.perf_counter() - t_start
    if losses_logged:
        # The median leaves out the first step's warm-up (and the pipeline's shape inference).
        log(rank, f"done: {len(losses_logged)} steps in {wall:.1f}s  final loss: "
                  f"{losses_logged[-1]:.{args.log_digits}f}  median tps: {round(float(np.median(tps_logged))):,}")
    else:
        log(rank, f"done: nothing to do (checkpoint is at step {start_step} >= --steps {args.steps})")
    dist.barrier()
    dist.destroy_process_group()


def log(rank: int, message: str) -> None:
    if rank == 0:
        print(message, flush=True)


def main(argv=None) -> int:
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    args = build_parser().parse_args(argv)
    try:
        validate(args, world)
    except UsageError as e:
        if rank != 0:
            exit_quietly_after_rank0(2)
        print(f"{PROG}: error: {e}", file=sys.stderr, flush=True)
        return 2
    if world == 1:
        # Plain `python train_demo.py`: a one-process group on this host.
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
    if args.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
    torch.manual_seed(args.seed)
    train(args, rank, world)
    return 0


if __name__ == "__main__":
    sys.exit(main())
