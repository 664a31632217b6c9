r"""vparallel_ce's losses as torchtitan 0.3 losses.

torchtitan 0.3 builds every component from a ``Configurable`` config, the trainer's loss from
``Trainer.Config.loss`` (a ``BaseLoss.Config``). This package adds two losses to that tree:

* :class:`VParallelCrossEntropyLoss` -- in place of torchtitan's ``CrossEntropyLoss`` (a
  subclass): :func:`vparallel_ce.cross_entropy` on the logits, which under TP stay sharded on the
  vocab (:mod:`.cross_entropy`);
* :class:`VParallelLinearCrossEntropyLoss` -- in place of torchtitan's ``ChunkedLossWrapper`` (a
  subclass, which torchtitan's trainer wires the same way): the lm_head fused into
  :func:`vparallel_ce.linear_cross_entropy`, chunked by vparallel_ce's policy instead of a fixed
  count, no logits (:mod:`.linear`);
* :class:`VParallelLinearMTPLoss` -- in place of torchtitan's ``MTPLoss`` for DeepSeek-V3's
  multi-token prediction: the lm_head fused into :func:`vparallel_ce.linear_mtp_loss` for the main
  head and every MTP depth (:mod:`.mtp`), with :class:`VParallelDeepSeekV3Model`, which hands the
  loss the heads' hidden states (:mod:`.deepseek_v3`); :func:`fused_mtp` selects both.

Both honour torchtitan's ``global_valid_tokens`` (the loss is the token sum divided by the step's
global valid-token count), its loss parallelism (TP on: the vocab stays sharded, under the
``spmd_types`` and ``partial_dtensor`` backends, :mod:`.tensor_parallel`), FSDP2, TP with and
without sequence parallelism, pipeline parallelism and ``compile.components`` holding ``"loss"``.

Select them in a config function::

    config.loss = VParallelLinearCrossEntropyLoss.Config(
        loss_fn=CrossEntropyLoss.Config(global_vocab_size=decoder_vocab_size(config.model_spec)),
        chunks="auto")

or on any torchtitan config from the command line (:mod:`.overrides`)::

    --override.imports vparallel_ce.integrations.torchtitan.overrides.vparallel_linear_cross_entropy

Importing ``vparallel_ce`` never imports this package (nor torchtitan). Supported: torchtitan
0.3.0 (``pip install "vparallel_ce[torchtitan]"``); torchtitan 0.2's train-spec system is gone
from 0.3, and this package needs 0.3's config classes.
"""

from importlib import metadata

SUPPORTED_VERSIONS = ("0.3.0",)


def _check_version() -> str:
    try:
        version = metadata.version("torchtitan")
    except metadata.PackageNotFoundError as e:
        raise ImportError('vparallel_ce.integrations.torchtitan needs torchtitan 0.3.0: '
                          'pip install "vparallel_ce[torchtitan]"') from e
    if tuple(version.split(".")[:2]) != ("0", "3"):
        raise ImportError(
            f"vparallel_ce.integrations.torchtitan supports torchtitan {', '.join(SUPPORTED_VERSIONS)} (the "
            f"Configurable losses of the 0.3 series); found torchtitan {version}: "
            'pip install "vparallel_ce[torchtitan]"'
        )
    if version not in SUPPORTED_VERSIONS:
        import warnings

        warnings.warn(f"vparallel_ce.integrations.torchtitan was verified with torchtitan "
                      f"{', '.join(SUPPORTED_VERSIONS)}, not {version}", stacklevel=2)
    return version


TORCHTITAN_VERSION = _check_version()

from .cross_entropy import VParallelCrossEntropyLoss  # noqa: E402  (after the version check)
from .deepseek_v3 import VParallelDeepSeekV3Model  # noqa: E402
from .linear import VParallelLinearCrossEntropyLoss  # noqa: E402
from .mtp import VParallelLinearMTPLoss, fused_mtp  # noqa: E402

__all__ = ["SUPPORTED_VERSIONS", "TORCHTITAN_VERSION", "VParallelCrossEntropyLoss",
           "VParallelLinearCrossEntropyLoss", "VParallelLinearMTPLoss", "VParallelDeepSeekV3Model", "fused_mtp"]
