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
"""

from __future__ import annotations

from torchtitan.components.loss import BaseLoss, ChunkedLossWrapper, CrossEntropyLoss
from torchtitan.config import override

from .cross_entropy import VParallelCrossEntropyLoss
from .linear import VParallelLinearCrossEntropyLoss

__all__ = ["vparallel_cross_entropy", "vparallel_linear_cross_entropy", "cross_entropy_of"]


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
