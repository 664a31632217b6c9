"""vparallel_ce: vocab-parallel, chunked and fused cross-entropy for tensor- and pipeline-parallel
LLM training.

Public API:

* :func:`cross_entropy` -- logits sharded along the vocab over a TP group;
* :func:`linear_cross_entropy` -- hidden states + the lm_head weight shard, no full logits;
* :func:`token_logprobs`, :func:`linear_token_logprobs` -- per-token log-probs and entropy for RL,
  from sharded logits or hidden states, with gradients; over the rollout's sampling set
  (``support=``) or its top-k/top-p/min-p masks;
* :func:`topk_logprobs`, :func:`linear_topk_logprobs` -- the global top-k ids and log-probs of a
  vocab-sharded softmax (a :class:`TopKTeacher` record);
* :func:`distillation_loss` -- forward/reverse KL or JSD between a student's and a teacher's
  vocab-sharded logits (plus an optional hard cross-entropy term), with the student's gradient;
* :func:`linear_distillation_loss` -- the same from both models' hidden states and lm_head shards,
  no logits beyond one token chunk;
  the teacher may be sparse, its top-k ids and log-probs (:class:`TopKTeacher`, :class:`TailMode`);
* :func:`linear_mtp_loss` -- multi-token prediction (a main head and D MTP depths through one
  lm_head shard) in one fused walk, with each head's loss and top-1 acceptance (:class:`MTPOutput`);
  :mod:`vparallel_ce.labels` -- the heads' labels over packed documents and context-parallel
  shards, and their valid-token counts;
* :func:`count_valid_tokens` -- the valid tokens of a step over its data-parallel ranks, the
  ``num_valid_tokens`` of the ops for exact gradient accumulation;
* :func:`build_loss_fn` and the ``nn.Module`` wrappers -- string-configurable losses;
* :mod:`vparallel_ce.policy` -- ``choose_chunks``, ``ChunkPolicy``, ``explain``;
* :mod:`vparallel_ce.pipeline` -- exact loss normalisation under ``torch.distributed.pipelining``;
* :mod:`vparallel_ce.megatron` -- a Megatron-signature drop-in.
"""

from .cross_entropy import cross_entropy
from .distillation import distillation_loss
from .linear import linear_cross_entropy
from .linear_distillation import linear_distillation_loss
from .mtp import MTPOutput, linear_mtp_loss
from .logprobs import linear_token_logprobs, token_logprobs
from .pipeline import count_valid_tokens
from .policy import ChunkPolicy, choose_chunks
from .registry import LinearCrossEntropy, PlainCrossEntropy, VocabParallelCrossEntropy, build_loss_fn
from .second_order import SecondDerivativeError
from .topk import TailMode, TopKTeacher
from .topk_logprobs import TopKLogprobs, linear_topk_logprobs, topk_logprobs
from .validate import InvalidInputError
from . import labels, megatron, pipeline, policy  # noqa: E402  (submodules of the public API)

__all__ = [
    "cross_entropy",
    "distillation_loss",
    "linear_distillation_loss",
    "TopKTeacher",
    "TailMode",
    "linear_cross_entropy",
    "linear_mtp_loss",
    "MTPOutput",
    "token_logprobs",
    "linear_token_logprobs",
    "topk_logprobs",
    "linear_topk_logprobs",
    "TopKLogprobs",
    "count_valid_tokens",
    "build_loss_fn",
    "VocabParallelCrossEntropy",
    "LinearCrossEntropy",
    "PlainCrossEntropy",
    "ChunkPolicy",
    "choose_chunks",
    "InvalidInputError",
    "SecondDerivativeError",
]
__version__ = "0.1.0"
