"""``VParallelLinearCrossEntropyLoss``: the lm_head fused into :func:`vparallel_ce.linear_cross_entropy`,
as a torchtitan 0.3 loss in the place of its ``ChunkedLossWrapper``.

It is a ``ChunkedLossWrapper`` (a subclass), so torchtitan's trainer wires it as it wires its own:
it hands the loss the model's lm_head (``set_lm_head``; under PP on the last stage) and runs the
model with ``_skip_lm_head=True``, so ``pred`` is the root norm's hidden states ``[B, S, H]``. Where
``ChunkedLossWrapper`` runs the lm_head on a fixed number of sequence chunks and materialises each
chunk's logits, this loss gives the hidden states and the lm_head's weight (this rank's vocab rows
under TP) to ``linear_cross_entropy``, which sizes its token chunks -- or vocab blocks -- from the
tokens, the local vocab and a memory budget (``chunks="auto"``), with softmax statistics in fp32
and gradient sums in fp32.

The flow, per call (one microbatch):

1. Under FSDP2 the lm_head's parameter group is unsharded (``unshard()``: a no-op where its root
   norm's forward left it unsharded, torchtitan's default) and stays so until the norm's backward,
   whose post-backward hook reduce-scatters the lm_head's gradient with the norm's.
2. The loss and its gradients run at once on a detached leaf of the hidden states: the weight's
   gradient accumulates into the lm_head's ``.grad``, the hidden states' is kept (in their dtype).
3. The returned loss is torchtitan's ``_DecoderOutputGradientBackProp`` of the kept gradient: the
   trainer's (or the pipeline schedule's) ``backward()`` hands it to the decoder. Nothing
   vocab-sized outlives the call, whatever the pipeline schedule holds in flight.

With ``global_valid_tokens`` the loss is the sum of the token losses divided by it (torchtitan's
contract); without it (validation) the sum, forward only when the hidden states need no gradient.
Under TP see :mod:`.tensor_parallel` for the backends; with ``compile.components`` holding ``"loss"``
the op is compiled (one custom op on one rank; under TP it runs eagerly between graphs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.fsdp import FSDPModule
from torchtitan.components.loss import IGNORE_INDEX, ChunkedLossWrapper, CrossEntropyLoss
from torchtitan.config import CompileConfig
from torchtitan.tools.logging import logger

import vparallel_ce
from vparallel_ce.policy import ChunkPolicy

from .options import common_options, fused_options, reduction, smoothing_options
from .tensor_parallel import check_backend, hidden_grad_for_decoder, tp_group

__all__ = ["VParallelLinearCrossEntropyLoss", "FusedConfig", "fused_call"]


@dataclass(kw_only=True, slots=True)
class FusedConfig(ChunkedLossWrapper.Config):
    """The fields of a fused loss in ``ChunkedLossWrapper``'s place. ``loss_fn`` is the loss the
    fused op computes (it gives ``global_vocab_size``); ``num_chunks`` (``ChunkedLossWrapper``'s
    fixed count) is not read: ``chunks`` is."""

    chunks: int | str = "auto"
    """Token chunks (vocab blocks for schedule="vocab"): "auto" (the policy sizes them from the
    tokens, the local vocab and the budget, and may pick the vocab schedule) or an int."""

    schedule: str = "auto"
    """"token" (chunks of tokens x the whole shard), "vocab" (blocks of the vocab over all tokens,
    the memory floor) or "auto"."""

    recompute: bool | str = "auto"
    """True recomputes the logits in the gradient pass, False keeps them from the statistics
    pass where it can, "auto" lets the policy decide."""

    budget_mib: float = 0.0
    """chunks="auto": bound on one chunk's fp32 logits in MiB (0: the library default)."""

    memory_mib: float = 0.0
    """chunks="auto": a target in MiB for the loss's whole peak, the hidden and weight
    gradients included (ChunkPolicy.memory_bytes); 0: none."""

    check: bool = True
    """Check shard sizes, options and target ids across the TP group on every call (one host sync)."""

    @property
    def global_vocab_size(self) -> int | None:
        return self.loss_fn.global_vocab_size


class VParallelLinearCrossEntropyLoss(ChunkedLossWrapper):
    """The fused lm_head + cross-entropy (see the module docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(FusedConfig):
        """``loss_fn`` must stay a ``CrossEntropyLoss.Config``; its ``global_vocab_size`` is the vocab's."""

        label_smoothing: float = 0.0
        """Label smoothing over the global vocab (0: none, as torchtitan's loss)."""

        z_loss: float = 0.0
        """Coefficient of the z-loss (logsumexp**2) term (0: none)."""

    def __init__(self, config: Config, *, compile_config: CompileConfig | None = None):
        if not isinstance(config.loss_fn, CrossEntropyLoss.Config):
            raise ValueError(
                f"VParallelLinearCrossEntropyLoss computes a cross-entropy: its loss_fn must be a "
                f"CrossEntropyLoss.Config (which gives global_vocab_size), got {type(config.loss_fn).__qualname__}"
            )
        super().__init__(config)
        opts = {**common_options(config), **smoothing_options(config), **fused_options(config),
                "ignore_index": IGNORE_INDEX}
        # build_loss_fn checks every option now, so a bad value raises when torchtitan builds the loss
        self.options = vparallel_ce.build_loss_fn("fused", **opts).options
        self.fn = self._loss
        if compile_config is not None and compile_config.enable and "loss" in compile_config.components:
            logger.info(f"vparallel_ce: compiling the fused loss with torch.compile (backend {compile_config.backend})")
            self.fn = torch.compile(self._loss, backend=compile_config.backend)
        logger.info(f"vparallel_ce: VParallelLinearCrossEntropyLoss with {self.options}")

    @property
    def policy(self) -> ChunkPolicy:
        return self.options["policy"]

    def _loss(self, hidden, weight, bias, labels, global_valid_tokens, group) -> torch.Tensor:
        return vparallel_ce.linear_cross_entropy(hidden, weight, labels, bias, group=group,
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

        def compute(hidden, weight, bias, group):
            return self.fn(hidden, weight, bias, labels, global_valid_tokens, group)

        return fused_call(self, pred, labels, compute), {}

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.options.items())


def fused_call(loss: ChunkedLossWrapper, pred: torch.Tensor, labels: torch.Tensor, compute) -> torch.Tensor:
    """One call of a fused loss in ``ChunkedLossWrapper``'s place (steps 1-3 of the module docstring).

    ``compute(hidden, weight, bias, group)`` is the op on the lm_head's hidden states ``pred``
    (``[B, S, H]``, or any stack of them: the MTP heads') and its weight. Returns the loss torchtitan's
    trainer (or the pipeline schedule) calls ``backward()`` on; without a gradient (validation) the
    op's value, forward only."""
    lm_head = loss.lm_head
    name = type(loss).__name__
    if lm_head is None:
        raise RuntimeError(f"{name} needs set_lm_head(model.lm_head) before its first call (torchtitan's trainer "
                           "calls it for a ChunkedLossWrapper loss)")
    check_backend(labels, name)
    fsdp = isinstance(lm_head, FSDPModule)
    if fsdp:
        lm_head.unshard()  # the unsharded weight; resharded by the group's post-backward
    weight, bias = lm_head.weight, getattr(lm_head, "bias", None)
    group = tp_group(pred, weight)
    if not pred.requires_grad:  # validation: forward only
        with torch.no_grad():
            return compute(pred, weight, bias, group)
    hidden = pred.detach().requires_grad_()
    value = compute(hidden, weight, bias, group)
    value.backward()
    grad = hidden_grad_for_decoder(hidden.grad, group)
    return loss._gradient_backprop(pred, grad, value.detach(), lm_head, fsdp)
