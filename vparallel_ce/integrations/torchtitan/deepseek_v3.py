r"""``VParallelDeepSeekV3Model``: torchtitan 0.3's DeepSeek-V3 whose MTP decoder hands the loss every
head's hidden states when the lm_head is fused into the loss.

torchtitan's trainer fuses the lm_head into a ``ChunkedLossWrapper`` loss by running the model with
``_skip_lm_head=True`` (its ``Decoder`` then returns the root norm's hidden states). Its MTP decoder
(``MTPDecoder``, DeepSeek-V3's base) refuses that flag: its heads' outputs are logits only. This
subclass answers the flag with the list ``[main, depth 1, ..., depth D]`` of ``[B, S, H]`` hidden
states -- the root norm's output, then each MTP block's ``mtp_norm`` output, exactly what
``MTPDecoder`` hands its lm_head -- and otherwise is DeepSeek-V3 unchanged (the same parameters,
state dict, parallelisation and sharding: ``MTPDecoder.Config``'s own; without the flag, or without
MTP layers, its forward is torchtitan's).

It is selected through torchtitan's config tree, where its ``Config`` stands in for
``DeepSeekV3Model.Config`` (:func:`hidden_states_model`; the override
``overrides.vparallel_mtp_hidden_states``), with :class:`.mtp.VParallelLinearMTPLoss` as the loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torchtitan.config import derive
from torchtitan.models.common.attention import AttentionMasksType
from torchtitan.models.deepseek_v3.model import DeepSeekV3Model
from torchtitan.models.deepseek_v3.mtp import roll_mtp_sequence

__all__ = ["VParallelDeepSeekV3Model", "hidden_states_model"]


class VParallelDeepSeekV3Model(DeepSeekV3Model):
    """DeepSeek-V3 with MTP layers that returns every head's hidden states under ``_skip_lm_head``."""

    @dataclass(kw_only=True, slots=True)
    class Config(DeepSeekV3Model.Config):
        """``DeepSeekV3Model.Config``'s fields (build one with :func:`hidden_states_model`)."""

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        attention_masks: AttentionMasksType | None = None,
    ):
        if not self._skip_lm_head or self.mtp_layers is None:
            return super().forward(tokens, positions, attention_masks)
        return self.head_hidden_states(tokens, positions, attention_masks)

    def head_hidden_states(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        attention_masks: AttentionMasksType | None = None,
    ) -> list[torch.Tensor]:
        """``[main, depth 1, ..., depth D]``, each ``[B, S, H]``: what the lm_head would get.

        Depth ``d``'s block reads the previous depth's output (for ``d = 1`` the trunk's last layer
        output, before the root norm) and the embeddings of the tokens ``d`` ahead, which
        ``roll_mtp_sequence`` takes within each packed document (``positions``), token 0 elsewhere."""
        if self.tok_embeddings is None:
            raise ValueError("VParallelDeepSeekV3Model's MTP heads need the token embeddings")
        trunk = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            trunk = layer(trunk, attention_masks, positions)
        heads = [self.norm(trunk) if self.norm is not None else trunk]
        previous = trunk
        for depth, block in enumerate(self.mtp_layers, 1):
            ahead, valid = roll_mtp_sequence(tokens, shift=depth, fill_value=0, positions=positions,
                                             return_valid_mask=True)
            previous = block(self.tok_embeddings(ahead), previous, valid, attention_masks, positions)
            heads.append(previous)  # through the block's mtp_norm already
        return heads


def hidden_states_model(config: DeepSeekV3Model.Config) -> VParallelDeepSeekV3Model.Config:
    """``config`` (a ``DeepSeekV3Model.Config``, MTP layers and all) as this model's config: every
    field copied, so the model is the same one."""
    if not isinstance(config, DeepSeekV3Model.Config):
        raise ValueError(f"the fused MTP loss needs torchtitan's DeepSeek-V3 model (DeepSeekV3Model.Config); this "
                         f"config's model is {type(config).__qualname__}")
    return derive(config, VParallelDeepSeekV3Model.Config)
