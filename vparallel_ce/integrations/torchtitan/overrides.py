"""Select vparallel_ce's losses from the command line: torchtitan 0.3 ``@override`` factories.

torchtitan applies the overrides named in ``--override.imports`` to its config tree before it
builds anything. Each factory here replaces the trainer's ``loss`` -- torchtitan's
``CrossEntropyLoss`` or ``ChunkedLossWrapper`` (over a ``CrossEntropyLoss``), as its configs set
it -- with one of ours, keeping the global vocab size; the override's kwargs are the new config's
fields::

    --override.imports vparallel_ce.integrations.torchtitan.overrides.vparallel_linear_cross_entropy
    --override.imports 'vparallel_ce.integrations.torchtitan.overrides.vparallel_cross_entropy={"chunks": 4}'

Any other loss (MSE, an RL loss, a wrapper around another inner loss) is refused with an error
naming it: these factories only stand in for a cross-entropy.

DeepSeek-V3's multi-token prediction (torchtitan's ``MTPLoss``) takes two, named together: the loss
and the model that hands it the heads' hidden states::

    --override.imports vparallel_ce.integrations.torchtitan.overrides.vparallel_linear_mtp \
    --override.imports vparallel_ce.integrations.torchtitan.overrides.vparallel_mtp_hidden_states
"""

from __future__ import annotations

from torchtitan.components.loss import BaseLoss, ChunkedLossWrapper, CrossEntropyLoss
from torchtitan.config import override

from torchtitan.models.deepseek_v3.model import DeepSeekV3Model
from torchtitan.models.deepseek_v3.mtp import MTPLoss

from .cross_entropy import VParallelCrossEntropyLoss
from .deepseek_v3 import VParallelDeepSeekV3Model, hidden_states_model
from .linear import VParallelLinearCrossEntropyLoss
from .mtp import VParallelLinearMTPLoss

__all__ = ["vparallel_cross_entropy", "vparallel_linear_cross_entropy", "vparallel_linear_mtp",
           "vparallel_mtp_hidden_states", "cross_entropy_of"]


def cross_entropy_of(config: BaseLoss.Config) -> CrossEntropyLoss.Config:
    """The cross-entropy a loss config computes: itself, or a ``ChunkedLossWrapper``'s inner loss."""
    inner = config.loss_fn if isinstance(config, ChunkedLossWrapper.Config) else config
    if not isinstance(inner, CrossEntropyLoss.Config):
        raise ValueError(
            f"the vparallel_ce overrides replace a cross-entropy loss (CrossEntropyLoss, or ChunkedLossWrapper over "
            f"one); this config's loss is {type(config).__qualname__}"
            + (f" over {type(inner).__qualname__}" if inner is not config else "")
        )
    return inner


@override(target=BaseLoss.Config, fqns=["loss"], description="vparallel_ce: vocab-parallel cross-entropy on the logits")
def vparallel_cross_entropy(config: BaseLoss.Config, **fields) -> VParallelCrossEntropyLoss.Config:
    """The trainer's cross-entropy -> :class:`VParallelCrossEntropyLoss` (the model keeps its lm_head)."""
    return VParallelCrossEntropyLoss.Config(global_vocab_size=cross_entropy_of(config).global_vocab_size, **fields)


@override(target=BaseLoss.Config, fqns=["loss"], description="vparallel_ce: lm_head fused into the cross-entropy")
def vparallel_linear_cross_entropy(config: BaseLoss.Config, **fields) -> VParallelLinearCrossEntropyLoss.Config:
    """The trainer's cross-entropy -> :class:`VParallelLinearCrossEntropyLoss` (no logits)."""
    inner = CrossEntropyLoss.Config(global_vocab_size=cross_entropy_of(config).global_vocab_size)
    return VParallelLinearCrossEntropyLoss.Config(loss_fn=inner, **fields)


@override(target=BaseLoss.Config, fqns=["loss"], description="vparallel_ce: lm_head fused into the MTP loss")
def vparallel_linear_mtp(config: BaseLoss.Config, **fields) -> VParallelLinearMTPLoss.Config:
    """torchtitan's ``MTPLoss`` -> :class:`VParallelLinearMTPLoss` (its ``mtp_scale`` and vocab kept);
    name :func:`vparallel_mtp_hidden_states` beside it."""
    if not isinstance(config, MTPLoss.Config):
        raise ValueError(f"vparallel_linear_mtp replaces torchtitan's MTPLoss; this config's loss is "
                         f"{type(config).__qualname__}")
    return VParallelLinearMTPLoss.Config(loss_fn=config, **fields)


@override(target=DeepSeekV3Model.Config, fqns=["model_spec.model"],
          description="vparallel_ce: DeepSeek-V3 handing the fused MTP loss its heads' hidden states")
def vparallel_mtp_hidden_states(config: DeepSeekV3Model.Config) -> VParallelDeepSeekV3Model.Config:
    """torchtitan's DeepSeek-V3 -> :class:`VParallelDeepSeekV3Model` (the same model, every field
    kept), which :func:`vparallel_linear_mtp` needs."""
    return hidden_states_model(config)
