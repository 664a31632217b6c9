"""Integrations of vparallel_ce's losses into training frameworks.

Each framework lives in its own submodule and is imported only when asked for, so that importing
``vparallel_ce`` (or this package) never imports a framework:

* :mod:`vparallel_ce.integrations.torchtitan` -- torchtitan 0.3 losses ``VParallelCrossEntropyLoss`` and
  ``VParallelLinearCrossEntropyLoss`` for its own trainer (``pip install "vparallel_ce[torchtitan]"``;
  see docs/integrations.md).
* :mod:`vparallel_ce.integrations.transformers` -- ``apply(model)``: a Hugging Face causal LM's
  loss by ``linear_cross_entropy``, without logits (``pip install "vparallel_ce[transformers]"``).

The Megatron-LM drop-in is :mod:`vparallel_ce.megatron`.
"""
