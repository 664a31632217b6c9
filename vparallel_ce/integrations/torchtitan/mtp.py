r"""``VParallelLinearMTPLoss``: DeepSeek-V3's multi-token-prediction loss with the lm_head fused into
:func:`vparallel_ce.linear_mtp_loss`, as a torchtitan 0.3 loss in the place of its ``MTPLoss``.

torchtitan's ``MTPLoss`` takes the logits of the main head and of every MTP depth ``[B, S, V]``
(``D + 1`` vocab-sized tensors). This loss is a ``ChunkedLossWrapper`` (a subclass), so torchtitan's
trainer hands it the model's lm_head (``set_lm_head``) and runs the model with
``_skip_lm_head=True``; with :class:`.deepseek_v3.VParallelDeepSeekV3Model` as the model, ``pred`` is
then the heads' hidden states ``[main, depth 1, ..., depth D]`` and no logits exist. One walk of
``linear_mtp_loss`` over every head's rows makes the loss, each head's hidden-state gradient and the
lm_head's gradient (once), chunked by vparallel_ce's policy; the call flow -- FSDP2 unshard, the
backward inside the call, the hidden gradients handed to the decoder by the trainer's
``backward()`` -- is :func:`.linear.fused_call`'s, on the heads' hidden states stacked.

The loss is torchtitan's ``MTPLoss``::

    loss = (sum_main l_i + mtp_scale * (1 / D) sum_{d=1..D} sum_{depth d} l_i) / global_valid_tokens

(the sum without a count, as in validation): every head divided by the ONE count the trainer
gives, the main labels' valid tokens over the optimizer step -- ``linear_mtp_loss`` with
``num_valid_tokens=global_valid_tokens``. Depth ``d``'s labels are the main labels rolled by ``d``
within each packed document (``positions``), as ``MTPLoss`` rolls them. ``mtp_scale`` and the vocab
size come from ``loss_fn``, an ``MTPLoss.Config``. Under TP see :mod:`.tensor_parallel`; under
``torch.compile`` the op runs eagerly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torchtitan.components.loss import IGNORE_INDEX, ChunkedLossWrapper
from torchtitan.config import CompileConfig
from torchtitan.models.deepseek_v3.mtp import MTPLoss
from torchtitan.tools.logging import logger

import vparallel_ce

from .deepseek_v3 import hidden_states_model
from .linear import FusedConfig, fused_call
from .options import common_options, fused_options, reduction

__all__ = ["VParallelLinearMTPLoss", "fused_mtp"]


class VParallelLinearMTPLoss(ChunkedLossWrapper):
    """The fused lm_head + MTP loss of DeepSeek-V3 (see the module docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(FusedConfig):
        """``loss_fn`` must stay an ``MTPLoss.Config``: its ``mtp_scale`` and ``global_vocab_size``
        are the loss's."""

    def __init__(self, config: Config, *, compile_config: CompileConfig | None = None):
        if not isinstance(config.loss_fn, MTPLoss.Config):
            raise ValueError(
                f"VParallelLinearMTPLoss computes torchtitan's MTP loss: its loss_fn must be an MTPLoss.Config "
                f"(which gives mtp_scale and global_vocab_size), got {type(config.loss_fn).__qualname__}"
            )
        self.mtp_scale = float(config.loss_fn.mtp_scale)
        if not math.isfinite(self.mtp_scale):
            raise ValueError(f"VParallelLinearMTPLoss: mtp_scale must be finite, got {config.loss_fn.mtp_scale!r}")
        super().__init__(config)
        opts = {**common_options(config), **fused_options(config), "ignore_index": IGNORE_INDEX}
        # build_loss_fn checks every option now, so a bad value raises when torchtitan builds the loss
        self.options = vparallel_ce.build_loss_fn("fused", **opts).options
        del compile_config  # linear_mtp_loss is a graph break under torch.compile: it runs eagerly either way
        logger.info(f"vparallel_ce: VParallelLinearMTPLoss with mtp_scale={self.mtp_scale}, {self.options}")

    def __call__(
        self,
        pred: list[torch.Tensor],
        labels: torch.Tensor,
        global_valid_tokens: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        positions = kwargs.pop("positions", None)
        del kwargs
        if not isinstance(pred, (list, tuple)) or len(pred) < 2 or not all(isinstance(p, torch.Tensor) for p in pred):
            raise ValueError(
                "VParallelLinearMTPLoss expects the hidden states of the main head and of each MTP depth (a list of "
                f"D + 1 >= 2 tensors [B, S, H]), got {_describe(pred)}: run it with a DeepSeek-V3 model with MTP "
                "layers selected by vparallel_ce.integrations.torchtitan.fused_mtp (or the "
                "overrides.vparallel_mtp_hidden_states override), which returns them under _skip_lm_head"
            )
        seq = pred[0].shape[1]
        labels = labels[:, :seq]  # as MTPLoss: labels (and positions) may run past the predictions
        positions = None if positions is None else positions[:, :seq]

        def compute(hidden, weight, bias, group):
            return vparallel_ce.linear_mtp_loss(
                list(hidden.unbind(0)), weight, labels, bias, mtp_scale=self.mtp_scale, positions=positions,
                group=group, reduction=reduction(global_valid_tokens), num_valid_tokens=global_valid_tokens,
                **self.options).loss

        # one [D + 1, B, S, H] tensor: the heads' hidden states reach the decoder through one gradient
        return fused_call(self, torch.stack(list(pred)), labels, compute), {}

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in {"mtp_scale": self.mtp_scale, **self.options}.items())


def _describe(pred) -> str:
    if isinstance(pred, torch.Tensor):
        return f"one tensor {tuple(pred.shape)}"
    if isinstance(pred, (list, tuple)):
        return f"{len(pred)} items {[tuple(p.shape) if isinstance(p, torch.Tensor) else type(p).__name__ for p in pred]}"
    return type(pred).__name__


def fused_mtp(config, **fields):
    """A torchtitan ``Trainer.Config`` with DeepSeek-V3 MTP (an ``MTPLoss``) -> the same config with
    the lm_head fused into :class:`VParallelLinearMTPLoss` (its ``fields``) and the model as
    :class:`.deepseek_v3.VParallelDeepSeekV3Model`, which hands the loss the heads' hidden states.
    Changes ``config`` in place and returns it."""
    if not isinstance(config.loss, MTPLoss.Config):
        raise ValueError(f"fused_mtp replaces torchtitan's MTPLoss; this config's loss is "
                         f"{type(config.loss).__qualname__}")
    config.model_spec.model = hidden_states_model(config.model_spec.model)
    config.loss = VParallelLinearMTPLoss.Config(loss_fn=config.loss, **fields)
    return config
