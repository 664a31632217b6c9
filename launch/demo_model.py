"""A small Llama-3 style decoder used by ``launch/train_demo.py`` and ``launch.bench.step``.

Not part of the library: the demo needs a real model to show the loss ops under
DP x TP x PP, and this is the least code that has the right shapes.

Architecture (Llama 3): token embedding, ``n_layers`` blocks of
RMSNorm -> grouped-query attention with RoPE -> residual, RMSNorm -> SwiGLU MLP ->
residual, a final RMSNorm and an untied ``output`` projection (the lm_head).

Pipeline stages are the same class with parts removed (``keep_only``): the first
stage keeps ``tok_embeddings``, the last keeps ``norm`` and ``output``, and every
stage keeps its slice of ``layers``. ``layers`` is a ``ModuleDict`` keyed by the
layer's global index so parameter names (``layers.7.attention.wq.weight``) are
the same in every layout; initialisation keys on these names. ``apply_tp`` shards a
stage for tensor parallelism (DTensor).

Shapes: B = batch (microbatch) size, S = sequence length, D = ``dim``,
H = heads, K = kv heads, Q = head dim, F = ``ffn_dim``, V = vocab size. Under
tensor parallelism the projections hold 1/tp of their heads / features, so the
code reads head counts from the tensors (``view(..., -1, Q)``), never from the
config.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class ModelArgs:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    ffn_dim: int
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


CONFIGS: dict[str, ModelArgs] = {
    # Fast on CPU; heads 8 / kv heads 4 allow tp up to 4; 4 layers allow pp up to 4.
    # V = 512 covers byte-level text (.txt data) with room to spare.
    "tiny": ModelArgs(dim=64, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=512,
                      ffn_dim=192, rope_theta=10000.0),
    # Llama 3.2 1B shapes (that model ties embeddings; here lm_head is untied).
    "llama3_1b": ModelArgs(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8,
                           vocab_size=128256, ffn_dim=8192),
    # Llama 3.1 8B shapes.
    "llama3_8b": ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                           vocab_size=128256, ffn_dim=14336),
}


def get_config(name: str, **overrides) -> ModelArgs:
    return replace(CONFIGS[name], **overrides)


def _local(x):
    """Plain tensor view of ``x``; DTensors are unwrapped (differentiably).

    Stage boundaries and the loss take plain tensors: pipelining sends plain
    tensors between ranks, and the loss is told its process group explicitly.
    """
    to_local = getattr(x, "to_local", None)
    return to_local() if to_local is not None else x


class RMSNorm(nn.Module):
    """x: [..., D] -> [..., D]; normalised in fp32, scaled by a learned weight."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Written with elementwise ops (not F.rms_norm) so a sequence-sharded
        # DTensor input propagates its sharding through every op.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.type_as(x) * self.weight


def rope_cos_sin(seq_len: int, head_dim: int, theta: float, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [S, Q/2] fp32 rotation angles pos * theta^(-2i/Q)."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, S, H, Q]; rotates consecutive pairs (x[2i], x[2i+1]) by the angle of (pos, i)."""
    x1, x2 = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2).type_as(x)


class Attention(nn.Module):
    """Grouped-query causal self-attention. x: [B, S, D] -> [B, S, D]."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.head_dim = args.head_dim
        self.rope_theta = args.rope_theta
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seq_len, _ = x.shape
        # -1: under TP each rank holds H/tp query heads and K/tp kv heads.
        q = self.wq(x).view(bsz, seq_len, -1, self.head_dim)
        k = self.wk(x).view(bsz, seq_len, -1, self.head_dim)
        v = self.wv(x).view(bsz, seq_len, -1, self.head_dim)
        # Angles are recomputed per call (S x Q/2, negligible) so the model has no
        # buffers to rebuild after meta-device construction or pipeline slicing.
        cos, sin = rope_cos_sin(seq_len, self.head_dim, self.rope_theta, x.device)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # Query head j uses kv head j // rep; the colwise TP split of wq and wk/wv
        # keeps that pairing inside each rank's shard.
        rep = q.shape[2] // k.shape[2]
        if rep > 1:
            k = k.repeat_interleave(rep, dim=2)
            v = v.repeat_interleave(rep, dim=2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(bsz, seq_len, -1))


class FeedForward(nn.Module):
    """SwiGLU MLP: w2(silu(w1 x) * w3 x). x: [B, S, D] -> [B, S, D]."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.ffn_dim, bias=False)
        self.w3 = nn.Linear(args.dim, args.ffn_dim, bias=False)
        self.w2 = nn.Linear(args.ffn_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """x: [B, S, D] -> [B, S, D] (under sequence parallel: [B, S/tp, D] local shards)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """The full model, or one pipeline stage of it after ``keep_only``.

    forward(x):
      x: token ids [B, S] int64 on the first stage, else hidden states [B, S, D]
         (sequence parallel: this rank's [B, S/tp, D] shard).
      returns, by stage and ``head_mode``:
        not last stage          -> hidden states, same shape as a hidden input
        last, head_mode="logits" -> logits [B, S, V] (TP: this rank's [B, S, V/tp] vocab shard)
        last, head_mode="hidden" -> (hidden [B, S, D] after the final norm (SP: [B, S/tp, D]),
                                     lm_head weight [V, D] (TP: this rank's [V/tp, D] shard))
    "hidden" is for the fused loss: the logits are never formed; the loss takes the
    normalised hidden states and the weight. Returning the weight from forward (rather
    than reading ``model.output.weight`` later) hands the loss the tensor FSDP
    gathered for this forward, whatever FSDP does with its sharded parameters.
    """

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.head_mode = "logits"
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args) for i in range(args.n_layers)})
        self.norm: RMSNorm | None = RMSNorm(args.dim, args.norm_eps)
        self.output: nn.Linear | None = nn.Linear(args.dim, args.vocab_size, bias=False)

    def keep_only(self, layer_ids: range, first: bool, last: bool) -> "Transformer":
        """Turn this module into one pipeline stage, in place: keep ``layer_ids``
        (global indices), the embedding only if ``first``, norm + lm_head only if ``last``."""
        for key in list(self.layers.keys()):
            if int(key) not in layer_ids:
                del self.layers[key]
        if not first:
            self.tok_embeddings = None
        if not last:
            self.norm = None
            self.output = None
        return self

    def forward(self, x: torch.Tensor):
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        for layer in self.layers.values():
            h = layer(h)
        if self.output is None:
            return _local(h)
        h = self.norm(h)
        if self.head_mode == "hidden":
            # A view, not the Parameter object: returned as is, the parameter itself became a
            # stage output, and under FSDP2 + pipelining (tp=1, pp=2) the lm_head gradient came
            # out wrong -- FSDP attaches per-forward hooks to every output tensor, which for a
            # leaf lands on the (persistent) unsharded parameter.
            w = _local(self.output.weight)
            return _local(h), w.view_as(w)
        return _local(self.output(h))


# ---------------------------------------------------------------------------------------
# Initialisation that does not depend on the layout.
#
# Every parameter's FULL value is drawn from its own generator seeded by (seed, name),
# so a rank can initialise just the parameters of its pipeline stage and still get
# exactly the values that the full model would have: the result is a function of the
# seed and the parameter name alone, never of pp/tp/dp. Sharding (TP, FSDP) happens
# after this, by slicing these full tensors.


def _name_seed(seed: int, name: str) -> int:
    # crc32, not hash(): Python's str hash is salted per process.
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


def init_std(name: str, args: ModelArgs) -> float | None:
    """Std of the truncated normal for parameter ``name``; None = ones (norm weights)."""
    if name.endswith("norm.weight"):
        return None
    if name.startswith("tok_embeddings."):
        return 1.0
    if name.startswith("output."):
        return args.dim ** -0.5
    if name.endswith(("wo.weight", "w2.weight")):
        # Projections into the residual stream: scaled down with depth (GPT-2 style)
        # so the residual's variance does not grow with the number of layers.
        return 0.02 / math.sqrt(2 * args.n_layers)
    return 0.02


@torch.no_grad()
def init_weights(module: Transformer, seed: int) -> None:
    """Initialise every parameter of ``module`` (a full model or a stage) in place.

    Must run before TP/FSDP sharding: parameters are plain full-size tensors here.
    """
    for name, param in module.named_parameters():
        std = init_std(name, module.args)
        if std is None:
            param.fill_(1.0)
            continue
        gen = torch.Generator(device=param.device)
        gen.manual_seed(_name_seed(seed, name))
        nn.init.trunc_normal_(param, mean=0.0, std=std, a=-3 * std, b=3 * std, generator=gen)


def count_params(args: ModelArgs) -> tuple[int, int]:
    """(all parameters, parameters without the token embedding) of the full model."""
    d, f, q = args.dim, args.ffn_dim, args.head_dim
    attn = d * args.n_heads * q * 2 + d * args.n_kv_heads * q * 2
    block = attn + 3 * d * f + 2 * d
    non_embedding = args.n_layers * block + d + args.vocab_size * d
    return non_embedding + args.vocab_size * d, non_embedding


def apply_tp(stage: Transformer, tp_mesh, sp: bool) -> None:
    """Tensor parallelism over ``tp_mesh``, in place: attention and MLP colwise/rowwise, the embedding
    rowwise, the lm_head colwise with its output left vocab-sharded (the losses work on the shards);
    ``sp``: sequence parallelism (norms and the residual stream split along the sequence)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    seq = Shard(1) if sp else Replicate()  # the residual stream between blocks
    top = {}
    if stage.tok_embeddings is not None:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
    if stage.output is not None:
        if sp:
            top["norm"] = SequenceParallel()
        # the lm_head's output stays vocab-sharded: the losses work on the shards
        top["output"] = ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=True)
    if top:
        parallelize_module(stage, tp_mesh, top)
    for block in stage.layers.values():
        plan = {f"attention.{w}": ColwiseParallel() for w in ("wq", "wk", "wv")}
        plan.update({"feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
                     "attention.wo": RowwiseParallel(output_layouts=seq),
                     "feed_forward.w2": RowwiseParallel(output_layouts=seq)})
        if sp:
            gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                        use_local_output=True)
            plan.update({"attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel(),
                         "attention": gather, "feed_forward": gather})
        parallelize_module(block, tp_mesh, plan)
