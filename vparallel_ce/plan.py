"""What a plan is and what it costs: :class:`Plan` (schedule, chunks, :class:`GradMode`,
:class:`WeightGrad`, its reasons), and the memory models the chunk policy
(:mod:`vparallel_ce.policy`, which hands these names on) sizes plans with -- :func:`peak_bytes`, the
whole peak of a ``linear_cross_entropy`` call, and :func:`distillation_chunk_bytes`, one token
chunk's working set of a distillation op (:class:`DistillShape`).

Memory model (bytes, per rank, ``V_loc = ceil(V / tp)``; the whole peak of a plan is
:func:`peak_bytes`, which ``explain`` prints):

* one chunk's fp32 logits: ``tokens_per_chunk * V_loc * 4``; the budget bounds this quantity (4
  bytes a logit whatever the matmul dtype, so it holds for ``logits_dtype=torch.float32`` too);
* the token-chunked linear schedule adds an fp32 dW accumulator: ``V_loc * H * 4``;
* with gradients made in forward, the op keeps ``dW`` (+ ``dh``) alive from forward to backward,
  once per microbatch in flight: GPipe holds every microbatch's forward before any backward, 1F1B
  about one. Under GPipe the policy therefore prefers recompute-in-backward.

The distillation ops (``distillation_loss``, ``linear_distillation_loss``) have their own model of
one token chunk's working set, :func:`distillation_chunk_bytes` (the divergence's fp32
``[chunk, V_loc]`` temporaries, and for the linear op both models' logits chunks and hidden rows):
the budget bounds that whole working set, not only one logits chunk.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

import torch

from .layout import aligned_parts, vocab_blocks

__all__ = ["GiB", "WeightGrad", "Plan", "GradMode", "DistillShape", "distillation_chunk_bytes", "local_vocab",
           "peak_bytes"]


GiB = 1024**3


class WeightGrad(enum.Enum):
    """How a linear distillation plan with several token chunks makes the student's ``dW``."""

    #: each chunk's ``dW`` GEMM adds into one fp32 ``[V_loc, H_s]`` sum: every chunk after the
    #: first reads and writes that sum once more (8 V_loc H_s bytes)
    CHUNK_SUM = "summed over the token chunks in fp32"
    #: every chunk writes its logits' gradient into one ``[N, V_loc]`` buffer in the matmul dtype
    #: (which the chunk's ``dh`` GEMM reads, as before), and ONE GEMM over all of it makes ``dW``
    #: at the end: chosen where that buffer is no larger than the fp32 sum it replaces
    ONE_GEMM = "one GEMM over every chunk's kept logits' gradient"


@dataclass(frozen=True)
class Plan:
    """What an op will do: ``schedule`` is ``"token"`` (chunks of tokens) or ``"vocab"`` (blocks of
    the local vocab, linear op only); ``chunks`` counts the token chunks or vocab blocks the call
    will run; ``grad_mode`` where the gradients are made; ``weight_grad`` how a linear
    distillation plan of several chunks makes ``dW``. ``why`` gives the reason for each choice
    (not part of equality)."""

    schedule: str
    chunks: int
    grad_mode: "GradMode"
    why: tuple[str, ...] = field(default=(), compare=False)
    weight_grad: WeightGrad = WeightGrad.CHUNK_SUM

    @property
    def grad_in_forward(self) -> bool:
        return self.grad_mode is GradMode.IN_FORWARD

    @property
    def keep_logits(self) -> bool:
        return self.grad_mode is GradMode.FROM_KEPT_LOGITS


class GradMode(enum.Enum):
    """Where a plan makes the gradients (the value is how ``explain`` says it)."""

    #: mean/sum with token chunks: the forward makes dW/dh (+db) for an upstream gradient of 1 and
    #: keeps only them; the backward scales them (3 matmuls; dW summed over the chunks in fp32)
    IN_FORWARD = "made in forward"
    #: one token chunk: its logits are kept from forward and the backward makes the gradients
    #: from them (3 matmuls)
    FROM_KEPT_LOGITS = "made in backward from the kept logits"
    #: the backward recomputes each chunk's (or block's) logits (4 matmuls, flat forward memory)
    RECOMPUTE = "recomputed in backward"


@dataclass(frozen=True)
class DistillShape:
    """What the distillation memory model (:func:`distillation_chunk_bytes`) needs of a call
    besides its token and vocab counts.

    Attributes:
        divergence: ``"forward_kl"``, ``"reverse_kl"`` or ``"jsd"`` (the JSD holds the mixture's
            log-probabilities besides both softmaxes: more temporaries).
        hidden_sizes: ``(H_s, H_t)``, the student's and the teacher's hidden sizes, for
            ``linear_distillation_loss``; None for ``distillation_loss`` (logits given).
        row_kernels: the local passes over a dense teacher's and the student's logits run as
            Triton kernels (:mod:`vparallel_ce.kernels.triton_distill`), which make no fp32
            temporaries: the only ``[chunk, V_loc]`` array besides the logits is their gradient.
        grad_bytes: bytes per element of the student logits' gradient as the linear op's GEMMs
            take it -- the matmul dtype's (2 for bf16/fp16, the default; 4 for fp32) -- or 0
            where the op cannot keep it for one ``dW`` GEMM (sequence parallelism, a student
            bias); for :class:`WeightGrad`.
    """

    divergence: str = "forward_kl"
    hidden_sizes: tuple[int, int] | None = None
    row_kernels: bool = False
    grad_bytes: int = 2


# The most fp32 [chunk, V_loc] arrays alive at once in vparallel_ce.divergence's statistics or
# gradient pass, counted from its code (not measured): both scaled logits stay referenced while
# they are shifted and exponentiated, and each masked partial sum (_weighted) holds its operands,
# a zeros tensor, the product and the result. The KLs peak in the gradient (11: both scaled logits,
# both log-softmaxes, q, p, their difference, the hard term and the weighting); the JSD in its
# statistics' second pass (15: the mixture's log-probabilities besides both softmaxes).
_DISTILL_TEMPORARIES = {"forward_kl": 11, "reverse_kl": 11, "jsd": 15}


def distillation_chunk_bytes(tokens: int, vocab_size: int, tp_degree: int = 1, *, shape: DistillShape) -> int:
    """The working set of one token chunk of ``tokens`` rows of a distillation op on one rank, in
    bytes, ``V = ceil(vocab_size / tp_degree)``::

        distillation_loss:         tokens * 4 V * D
        linear_distillation_loss:  tokens * (4 V * (D + 2) + 4 (H_s + H_t))

    ``D`` the divergence's fp32 temporaries (11 for the KLs, 15 for the JSD; 1, the logits'
    gradient, where :attr:`DistillShape.row_kernels`); the linear op adds the
    two models' logits chunks (counted at 4 bytes a logit, as the budget counts them) and the
    chunk's hidden rows of both models (gathered with sequence parallelism, cast under autocast).
    Not counted: the inputs, and the linear op's gradients (``dh``, and dW's fp32 accumulator,
    ``4 V H_s``, alive over the whole call)."""
    v = local_vocab(vocab_size, tp_degree)
    arrays = 1 if shape.row_kernels else _DISTILL_TEMPORARIES[str(shape.divergence)]
    if shape.hidden_sizes is None:
        return tokens * 4 * v * arrays
    h_s, h_t = shape.hidden_sizes
    return tokens * (4 * v * (arrays + 2) + 4 * (h_s + h_t))


def local_vocab(vocab_size: int, tp_degree: int) -> int:
    return math.ceil(vocab_size / max(1, tp_degree))


def peak_bytes(plan: Plan, num_tokens: int, vocab_size: int, tp_degree: int = 1, *, hidden_size: int,
               dtype: torch.dtype = torch.bfloat16, grad_dtype: torch.dtype | None = None,
               logits_dtype: torch.dtype | None = None) -> int:
    """The memory model of one ``linear_cross_entropy`` call that runs ``plan`` on one rank: its
    peak allocation over its inputs, the returned ``dh`` and ``dW`` included (what
    ``launch/bench_loss.py`` measures), for matmul operands of ``dtype`` (``e`` bytes) and gradients
    of ``grad_dtype`` (``g`` bytes; default ``dtype``; fp32 for fp32 master weights under autocast)
    and logits of ``logits_dtype`` (default ``dtype``): ``e`` below is the bytes of one logit and
    its gradient -- ``dtype``'s, or with fp32 logits of narrower operands 4 for the logits (their
    gradient written over them) plus ``dtype``'s for that gradient cast to the matmul dtype (the
    fused kernels write neither; the model counts them as unfused). With ``N`` tokens, ``V`` the
    local vocab and ``H`` the hidden size::

        token x1:        max(N V e + dW + dH, dW + dH + dh)     the logits (kept or recomputed), which
                                                                their gradient overwrites
        token x k > 1:   AW + AH + max(N/k V e, dW + dh)       fp32 accumulators AW = 4 V H, AH = 4 N H
        vocab x k:       dW + AH + max(N Vb e, dh)             one block's dx, Vb its width rounded up to 16

    with ``dW = g V H``, ``dh = g N H``, and ``dH = dh`` where one matmul makes ``dh`` (one rank, one
    aligned part), else ``AH`` (``dh`` summed over vocab parts or ranks in fp32). Every plan of the four benchmark shapes
    measured on an H200 is within 1% of it (``tests/test_policy.py``, ``tests/fixtures``).
    Not modelled: sequence parallelism's gathered rows, the fused statistics' partials in forward
    (``8 N ceil(V / 256)`` bytes, below the backward's peak at the benchmark shapes)."""
    e, g = dtype.itemsize, (grad_dtype or dtype).itemsize
    if logits_dtype is not None and logits_dtype.itemsize > e:
        e += logits_dtype.itemsize
    n, v, h = num_tokens, local_vocab(vocab_size, tp_degree), hidden_size
    dw, dh, acc_h = g * v * h, g * n * h, 4 * n * h
    if plan.schedule == "token" and plan.chunks == 1:
        direct = tp_degree == 1 and len(aligned_parts(v)) == 1
        held = dh if direct else acc_h
        return max(n * v * e + dw + held, dw + held + dh)
    if plan.schedule == "token":
        return 4 * v * h + acc_h + max(math.ceil(n / plan.chunks) * v * e, dw + dh)
    blocks = vocab_blocks(v, plan.chunks)
    if len(blocks) == 1 and tp_degree == 1:  # one block on one rank: dh from one matmul
        acc_h = dh
    widest = max(b.stop - b.start for b in blocks)
    return dw + acc_h + max(n * (-(-widest // 16) * 16) * e, dh)
