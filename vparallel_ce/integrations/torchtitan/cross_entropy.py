"""``VParallelCrossEntropyLoss``: :func:`vparallel_ce.cross_entropy` as a torchtitan 0.3 loss.

A drop-in for torchtitan's ``CrossEntropyLoss`` (a subclass of it, with the same
``global_vocab_size`` field): the model keeps its lm_head, and the loss takes the logits as
torchtitan hands them over -- under TP this rank's vocab shard (a plain tensor under the default
``spmd_types`` backend, a ``Shard(-1)`` DTensor under ``partial_dtensor``), so the logits are never
gathered -- chunked over the tokens, softmax statistics in fp32, each chunk's statistics joined by
one all-reduce MAX and one SUM.

``__call__(pred [B, S, V_local], labels [B, S], global_valid_tokens)`` returns
``(sum of the token losses / global_valid_tokens, {})``, or the sum without a count: torchtitan's
contract, which its trainer and pipeline schedules rely on (the count covers the whole optimizer
step, over the data-parallel ranks and the microbatches).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torchtitan.components.loss import IGNORE_INDEX, CrossEntropyLoss
from torchtitan.config import CompileConfig
from torchtitan.tools.logging import logger

import vparallel_ce

from .options import common_options, policy, reduction, smoothing_options
from .tensor_parallel import check_backend, tp_group

__all__ = ["VParallelCrossEntropyLoss"]


class VParallelCrossEntropyLoss(CrossEntropyLoss):
    """Vocab-parallel cross-entropy on the logits (see the module docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(CrossEntropyLoss.Config):
        chunks: int | str = "auto"
        """Token chunks: "auto" (sized from the tokens, the local vocab and the budget) or an int."""

        budget_mib: float = 0.0
        """chunks="auto": bound on one chunk's fp32 logits in MiB (0: the library default)."""

        label_smoothing: float = 0.0
        """Label smoothing over the global vocab (0: none, as torchtitan's loss)."""

        z_loss: float = 0.0
        """Coefficient of the z-loss (logsumexp**2) term (0: none)."""

        check: bool = True
        """Check shard sizes, options and target ids across the TP group on every call (one host sync)."""

    def __init__(self, config: Config, *, compile_config: CompileConfig | None = None):
        super().__init__(config, compile_config=None)
        opts = {**common_options(config), **smoothing_options(config), "policy": policy(budget_mib=config.budget_mib),
                "ignore_index": IGNORE_INDEX}
        # build_loss_fn checks every option now, so a bad value raises when torchtitan builds the loss
        self.options = vparallel_ce.build_loss_fn("chunked", **opts).options
        self.fn = self._loss
        self._maybe_compile(compile_config)
        logger.info(f"vparallel_ce: VParallelCrossEntropyLoss with {self.options}")

    def _loss(self, pred: torch.Tensor, labels: torch.Tensor, global_valid_tokens) -> torch.Tensor:
        check_backend(labels, type(self).__name__)
        return vparallel_ce.cross_entropy(pred, labels, group=tp_group(pred),
                                          reduction=reduction(global_valid_tokens),
                                          num_valid_tokens=global_valid_tokens, **self.options)

    def __call__(
        self,
        pred: torch.Tensor,
        labels: torch.Tensor,
        global_valid_tokens: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        del kwargs  # per-token extras (positions) that a cross-entropy does not use
        return self.fn(pred, labels, global_valid_tokens), {}
