r"""torchtitan train specs that use vparallel_ce's losses (torchtitan 0.2.2).

Importing this module registers two train specs built from torchtitan's ``llama3`` spec::

    pip install "vparallel_ce[torchtitan]"
    torchrun --nproc_per_node 8 -m torchtitan.train --job.config_file llama3_8b.toml \
        --experimental.custom_import vparallel_ce.integrations.torchtitan \
        --job.custom_config_module vparallel_ce.integrations.torchtitan \
        --model.name llama3_vparallel_fused --vparallel.chunks auto

* ``llama3_vparallel``: the model is unchanged; the loss is :func:`vparallel_ce.cross_entropy` on
  its logits. Under TP with loss parallel (torchtitan's default) the logits arrive as the
  ``Shard(-1)`` DTensor of the ColwiseParallel lm_head and stay sharded on the vocab.
* ``llama3_vparallel_fused``: the lm_head is fused into :func:`vparallel_ce.linear_cross_entropy`,
  so the logits never exist. The model's ``output`` module becomes a :class:`FusedLMHead`: same
  parameter (``output.weight``, so checkpoints are interchangeable with ``llama3``), whose forward
  returns :class:`LMHeadInputs` -- the hidden states and a view of the weight taken INSIDE the
  forward -- instead of the logits; the model returns them as the plain tuple ``(hidden, weight)``. Inside the forward the weight is what the loss needs: the
  ``Shard(0)`` DTensor under TP, the unsharded parameter under FSDP (outside the forward FSDP
  holds only its own shard; FSDP's ``reshard_after_forward`` is turned off for the lm_head's
  group so the view stays valid until the backward).

Both specs keep everything else of ``llama3`` (parallelize, pipelining, data, optimizer, checkpoint
conversion, flavors -- the same ``model_args`` mapping, so a flavor added to it shows up in all
three). Under pipeline parallelism the schedule's loss is a :class:`vparallel_ce.pipeline.PipelineLoss`
normalised by the step's valid-token count inside the schedule (see :class:`TokenNormalisedSchedule`
for what that fixes in torchtitan 0.2.2).

Options, torchtitan style (with ``--job.custom_config_module vparallel_ce.integrations.torchtitan``,
which adds a ``[vparallel]`` section to the job config; without it the defaults apply)::

    --vparallel.chunks auto|K  --vparallel.schedule auto|token|vocab  --vparallel.recompute auto|true|false
    --vparallel.budget_mib M   --vparallel.memory_mib M  --vparallel.label_smoothing S  --vparallel.z_loss Z
    --vparallel.no-check

or in the TOML file: ``[job] custom_config_module = "vparallel_ce.integrations.torchtitan"`` and a
``[vparallel]`` table. Other models: :func:`register_specs` builds the two specs from any train spec
whose model ends in an ``output`` ``nn.Linear`` lm_head.
"""

import contextlib
import dataclasses
import warnings
from dataclasses import dataclass, field
from importlib import metadata
from typing import NamedTuple

import torch
from torch import nn

import vparallel_ce
from vparallel_ce.pipeline import PipelineLoss, count_valid_tokens, microbatches_in_flight
from vparallel_ce.policy import ChunkPolicy

try:
    from torchtitan.protocols import train_spec as _train_spec
    from torchtitan.tools.logging import logger
except ImportError as e:  # pragma: no cover - exercised only without torchtitan
    raise ImportError(
        "vparallel_ce.integrations.torchtitan needs torchtitan 0.2.2: pip install \"vparallel_ce[torchtitan]\""
    ) from e

__all__ = [
    "VERIFIED_VERSIONS",
    "SPEC_SUFFIXES",
    "VParallel",
    "JobConfig",
    "FusedLMHead",
    "LMHeadInputs",
    "LogitsLoss",
    "FusedLoss",
    "TokenNormalisedSchedule",
    "build_loss_fn",
    "vparallel_train_spec",
    "register_specs",
]

VERIFIED_VERSIONS = ("0.2.2",)
SPEC_SUFFIXES = {"_vparallel": False, "_vparallel_fused": True}  # suffix -> fused


def _check_version() -> str:
    try:
        version = metadata.version("torchtitan")
    except metadata.PackageNotFoundError:  # a source checkout without metadata
        return "unknown"
    major_minor = tuple(version.split(".")[:2])
    if major_minor != ("0", "2"):
        raise ImportError(
            f"vparallel_ce.integrations.torchtitan supports torchtitan {', '.join(VERIFIED_VERSIONS)} "
            f"(TrainSpec registry and JobConfig extension of the 0.2 series); found torchtitan {version}"
        )
    if version not in VERIFIED_VERSIONS:
        warnings.warn(f"vparallel_ce.integrations.torchtitan was verified with torchtitan "
                      f"{', '.join(VERIFIED_VERSIONS)}, not {version}", stacklevel=2)
    return version


TORCHTITAN_VERSION = _check_version()


# ---------------------------------------------------------------------------------------------
# Configuration: a [vparallel] job-config section (--job.custom_config_module this module)


@dataclass
class VParallel:
    chunks: str = "auto"
    """Token chunks of the loss ("auto": chosen from the microbatch's tokens, the local vocab and the
    memory budget; or a positive integer). For the fused loss's vocab schedule: vocab blocks."""

    schedule: str = "auto"
    """Fused loss only: "token" (chunks of tokens, 3 matmuls), "vocab" (blocks of the vocab over all
    tokens, memory floor) or "auto" (the policy decides from the budget)."""

    recompute: str = "auto"
    """Fused loss only: "true" recomputes the logits in backward, "false" makes the gradients in
    forward, "auto" lets the policy decide (it recomputes under schedules that hold several
    microbatches' losses at once, e.g. GPipe)."""

    budget_mib: float = 0.0
    """Bound on one chunk's fp32 logits in MiB for chunks="auto"; 0 keeps the library default."""

    memory_mib: float = 0.0
    """Fused loss, chunks="auto": a target in MiB for the loss' whole peak, dh and dW included
    (ChunkPolicy.memory_bytes: one token chunk if it fits, else the fewest vocab blocks that do);
    0: none."""

    label_smoothing: float = 0.0
    """Label smoothing over the global vocab (0: none, like torchtitan's loss)."""

    z_loss: float = 0.0
    """Coefficient of the z-loss (logsumexp**2) term (0: none)."""

    check: bool = True
    """Check shard sizes, options and target ids across the TP group on every call (one host sync)."""


@dataclass
class JobConfig:
    """Merged into torchtitan's JobConfig by ``--job.custom_config_module``."""

    vparallel: VParallel = field(default_factory=VParallel)


def _options(job_config) -> VParallel:
    cfg = getattr(job_config, "vparallel", None)
    if cfg is None:
        return VParallel()
    if isinstance(cfg, dict):  # defensive: a raw TOML table
        cfg = VParallel(**cfg)
    return cfg


def _parse_chunks(value):
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    try:
        k = int(value)
    except (TypeError, ValueError):
        k = 0
    if k < 1 or (isinstance(value, float) and value != k):
        raise ValueError(f"--vparallel.chunks must be 'auto' or a positive integer, got {value!r}")
    return k


def _parse_recompute(value):
    text = str(value).strip().lower()
    table = {"auto": None, "none": None, "true": True, "1": True, "false": False, "0": False}
    if text not in table:
        raise ValueError(f"--vparallel.recompute must be auto, true or false, got {value!r}")
    return table[text]


def _loss_kwargs(cfg: VParallel) -> dict:
    return {"chunks": _parse_chunks(cfg.chunks), "label_smoothing": float(cfg.label_smoothing),
            "z_loss": float(cfg.z_loss), "check": bool(cfg.check)}


def _policy(cfg: VParallel) -> ChunkPolicy:
    for name in ("budget_mib", "memory_mib"):
        if getattr(cfg, name) < 0:
            raise ValueError(f"--vparallel.{name} must be >= 0, got {getattr(cfg, name)}")
    return ChunkPolicy(budget_bytes=int(cfg.budget_mib * 2**20) if cfg.budget_mib else None,
                       memory_bytes=int(cfg.memory_mib * 2**20) if cfg.memory_mib else None)


# ---------------------------------------------------------------------------------------------
# The losses: loss_fn(pred, labels) -> the SUM of the token losses, as torchtitan's trainer expects
# (it divides by the step's global valid-token count itself)


@contextlib.contextmanager
def _autocast_off(t: torch.Tensor):
    # torchtitan runs the loss inside its AMP context (single device / DDP). The ops keep their own
    # fp32 softmax statistics and accumulators; autocast would recast their matmuls.
    with torch.autocast(device_type=t.device.type, enabled=False):
        yield


class LogitsLoss:
    """``vparallel_ce.cross_entropy`` on the model's logits ``[B, S, V]`` -- under TP with loss
    parallel the ``Shard(-1)`` DTensor (its mesh gives the group), else a plain tensor."""

    __name__ = "vparallel_cross_entropy"

    def __init__(self, cfg: VParallel):
        self.kwargs = _loss_kwargs(cfg)

    def __call__(self, pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        with _autocast_off(pred):
            return vparallel_ce.cross_entropy(pred, labels, reduction="sum", **self.kwargs)


class FusedLoss:
    """``vparallel_ce.linear_cross_entropy`` on the :class:`LMHeadInputs` that :class:`FusedLMHead`
    returns: the hidden states and this rank's lm_head weight (shard), no logits."""

    __name__ = "vparallel_linear_cross_entropy"

    def __init__(self, cfg: VParallel):
        self.kwargs = _loss_kwargs(cfg)
        schedule = str(cfg.schedule).strip().lower()
        if schedule not in ("auto", "token", "vocab"):
            raise ValueError(f"--vparallel.schedule must be auto, token or vocab, got {cfg.schedule!r}")
        self.kwargs.update(schedule=schedule, recompute=_parse_recompute(cfg.recompute))
        self.policy = _policy(cfg)

    def __call__(self, pred: tuple, labels: torch.Tensor) -> torch.Tensor:
        if not (isinstance(pred, tuple) and len(pred) == 2 and all(isinstance(t, torch.Tensor) for t in pred)):
            raise TypeError(
                f"the fused vparallel loss takes the (hidden, weight) of a FusedLMHead lm_head, got "
                f"{type(pred).__name__}: use a *_vparallel_fused train spec (its model's output module is a "
                f"FusedLMHead), and keep model converters (float8, ...) off the lm_head"
            )
        hidden, weight = pred
        with _autocast_off(hidden):
            return vparallel_ce.linear_cross_entropy(hidden, weight, labels, reduction="sum", policy=self.policy,
                                                     **self.kwargs)


def build_loss_fn(job_config, *, fused: bool = False, **kwargs):
    """torchtitan ``TrainSpec.build_loss_fn``: the SUM loss of the ``[vparallel]`` options."""
    del kwargs  # parallel_dims: the group comes from the DTensors
    cfg = _options(job_config)
    if job_config.compile.enable and "loss" in job_config.compile.components:
        logger.info("vparallel_ce: the loss is not compiled (it runs its own chunk loop and collectives)")
    loss = FusedLoss(cfg) if fused else LogitsLoss(cfg)
    logger.info(f"vparallel_ce: {loss.__name__} with {loss.kwargs}")
    return loss


# ---------------------------------------------------------------------------------------------
# The fused lm_head


class _AnyPlacements:
    """Equal to every placement tuple (see :attr:`LMHeadInputs.placements`)."""

    def __eq__(self, other):
        return True

    def __ne__(self, other):
        return False

    __hash__ = object.__hash__

    def __repr__(self):
        return "AnyPlacements"


_ANY_PLACEMENTS = _AnyPlacements()


class LMHeadInputs(NamedTuple):
    """What :class:`FusedLMHead` returns in place of the logits: the loss's inputs.

    ``hidden``: ``[B, S, H]`` final hidden states (under TP: the ``Replicate`` DTensor that
    ColwiseParallel's input hook made); ``weight``: a view of the lm_head weight taken inside the
    forward (under TP: its ``Shard(0)`` DTensor; under FSDP: of the unsharded parameter). Tensors
    only (no optional bias member): a pipeline stage's outputs must all be tensors.

    Under TP the lm_head also carries ColwiseParallel's output hook, which moves the module's output
    to the logits' layout (``redistribute``, then maybe ``to_local``). These inputs are not logits and
    must pass through unchanged, so the three members below make that hook a no-op.
    """

    hidden: torch.Tensor
    weight: torch.Tensor

    @property
    def placements(self):
        return _ANY_PLACEMENTS

    def redistribute(self, *args, **kwargs):
        return self

    def to_local(self):
        return self


class FusedLMHead(nn.Linear):
    """An ``nn.Linear`` lm_head whose forward returns :class:`LMHeadInputs` instead of logits.

    The parameters and their names are those of the ``nn.Linear`` (TP, FSDP, checkpoints and the
    HF state-dict adapter see no difference). Under autocast the forward casts hidden states and
    weight to the autocast dtype, as ``F.linear`` would have. The weight is returned as a view: the
    parameter object itself would put FSDP's per-forward output hooks on the persistent parameter.
    """

    def forward(self, x: torch.Tensor) -> LMHeadInputs:  # type: ignore[override]
        w = self.weight
        device_type = x.device.type
        if torch.is_autocast_enabled(device_type):
            dtype = torch.get_autocast_dtype(device_type)
            x, w = x.to(dtype), w.to(dtype)
        return LMHeadInputs(x, w.view_as(w))


def _with_fused_head(model_cls: type) -> type:
    """A subclass of ``model_cls`` whose ``output`` lm_head is a :class:`FusedLMHead` and whose forward
    returns the plain tuple ``(hidden, weight)`` where the base model returned logits."""

    def __init__(self, model_args):
        model_cls.__init__(self, model_args)
        head = getattr(self, "output", None)
        if type(head) is not nn.Linear or head.bias is not None:
            raise TypeError(f"{model_cls.__name__}.output must be an nn.Linear lm_head without bias for the fused "
                            f"vparallel loss, got {head!r}")
        # same parameters, same initialisation; only forward differs
        head.__class__ = FusedLMHead

    def forward(self, *args, **kwargs):
        out = model_cls.forward(self, *args, **kwargs)
        # a plain tuple of tensors: what a pipeline stage may output (torch detaches its members in
        # place after the backward; the weight is a view, which it leaves alone)
        return tuple(out) if isinstance(out, LMHeadInputs) else out

    return type(f"{model_cls.__name__}FusedHead", (model_cls,),
                {"__init__": __init__, "forward": forward, "__module__": __name__})


def _with_unsharded_head(parallelize_fn):
    """torchtitan's parallelize, then keep the FSDP lm_head group unsharded from its forward to its
    backward: the loss runs after the module's forward, on the view of the unsharded weight."""

    def parallelize(model, parallel_dims, job_config):
        model = parallelize_fn(model, parallel_dims, job_config)
        head = getattr(model, "output", None)
        if head is not None and hasattr(head, "set_reshard_after_forward"):  # an FSDPModule
            if job_config.parallelism.fsdp_reshard_after_forward == "always":
                logger.info("vparallel_ce: keeping the lm_head's FSDP group unsharded between its forward and "
                            "the fused loss (fsdp_reshard_after_forward=always applies to the other groups)")
            head.set_reshard_after_forward(False, recurse=False)
        return model

    return parallelize


# ---------------------------------------------------------------------------------------------
# Pipeline parallelism


class TokenNormalisedSchedule:
    """The pipeline schedule torchtitan's trainer drives, with each microbatch's loss divided by the
    step's valid-token count INSIDE the schedule.

    torchtitan 0.2.2 calls ``schedule.step()`` without that count and divides the summed microbatch
    losses by it only after ``step()`` returns: by then the schedule has run the backward of the
    un-normalised sums, so the PP gradients (and grad norm) come out ``N`` times those of the same
    step without PP. Here, on the ranks holding the last stage, ``N`` is counted from the step's
    targets over the data-parallel (and CP) ranks, handed to the :class:`PipelineLoss` through the
    schedule's ``loss_kwargs``, and the microbatch losses put into ``losses`` are multiplied back by
    ``N`` so that the trainer's own division gives the logged token mean it always gave.

    With gradient accumulation (A > 1 ``step()`` calls per optimizer step) each call's count is
    multiplied by A: exact when the accumulation steps hold the same number of valid tokens, as
    torchtitan's packed text datasets always do (no ignored labels).

    ``eval()`` (validation) keeps the SUM losses torchtitan's validator expects.
    """

    def __init__(self, schedule, loss: PipelineLoss, *, count_group=None, accumulation_steps: int = 1):
        self.schedule = schedule
        self.loss = loss
        self.count_group = count_group
        self.accumulation_steps = int(accumulation_steps)

    def step(self, *args, target=None, losses=None, **kwargs):
        if target is None:  # no last stage on this rank: the loss is never called here
            return self.loss.step(self.schedule, *args, target=None, losses=losses, global_valid_tokens=1, **kwargs)
        n = count_valid_tokens(target, group=self.count_group) * self.accumulation_steps
        out = self.loss.step(self.schedule, *args, target=target, losses=losses, global_valid_tokens=n, **kwargs)
        if losses:
            scale = n.clamp(min=1)
            losses[:] = [mb.detach() * scale.to(mb.dtype) for mb in losses]
        return out

    def eval(self, *args, **kwargs):
        with self.loss.step_context(global_valid_tokens=1):
            return self.schedule.eval(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.schedule, name)


def _token_normalised_pipelining(pipelining_fn):
    def pipelining(model, parallel_dims, job_config, device, model_args, parallelize_fn, loss_fn):
        pipe_loss = PipelineLoss(loss_fn, name=getattr(loss_fn, "__name__", "loss"))
        schedule, model_parts, has_first, has_last = pipelining_fn(
            model, parallel_dims, job_config, device, model_args, parallelize_fn, pipe_loss
        )
        policy = getattr(loss_fn, "policy", None)
        if policy is not None:  # the fused loss: size the chunks for the losses alive at once
            loss_fn.policy = dataclasses.replace(policy, microbatches_in_flight=microbatches_in_flight(schedule))
        batch = parallel_dims.dp_replicate * parallel_dims.dp_shard
        global_batch = job_config.training.global_batch_size
        local_batch = job_config.training.local_batch_size
        accumulation = max(1, global_batch // (local_batch * batch)) if global_batch > 0 else 1
        if accumulation > 1:
            logger.warning(f"vparallel_ce: {accumulation} gradient-accumulation steps under PP: each step's loss is "
                           "divided by its own valid-token count x the step count (exact when they hold equal "
                           "valid-token counts)")
        wrapped = TokenNormalisedSchedule(schedule, pipe_loss, count_group=parallel_dims.get_optional_mesh("loss"),
                                          accumulation_steps=accumulation)
        return wrapped, model_parts, has_first, has_last

    return pipelining


# ---------------------------------------------------------------------------------------------
# The specs


def vparallel_train_spec(base, *, fused: bool):
    """A copy of the torchtitan ``TrainSpec`` ``base`` with vparallel_ce's loss (``fused``: the lm_head
    fused into it). Shares ``base.model_args`` (the flavors) with ``base``."""
    changes = {
        "build_loss_fn": _fused_loss_builder if fused else build_loss_fn,
        "pipelining_fn": None if base.pipelining_fn is None else _token_normalised_pipelining(base.pipelining_fn),
    }
    if fused:
        changes["model_cls"] = _with_fused_head(base.model_cls)
        changes["parallelize_fn"] = _with_unsharded_head(base.parallelize_fn)
    return dataclasses.replace(base, **changes)


def _fused_loss_builder(job_config, **kwargs):
    return build_loss_fn(job_config, fused=True, **kwargs)


def register_specs(base_name: str = "llama3") -> dict:
    """Register ``{base_name}_vparallel`` and ``{base_name}_vparallel_fused`` built from torchtitan's
    ``base_name`` spec; registering the same names again is a no-op. Returns {name: TrainSpec}."""
    base = _train_spec.get_train_spec(base_name)
    specs = {}
    for suffix, fused in SPEC_SUFFIXES.items():
        name = base_name + suffix
        try:
            spec = _train_spec.get_train_spec(name)
        except ValueError:  # not registered yet
            spec = vparallel_train_spec(base, fused=fused)
            _train_spec.register_train_spec(name, spec)
        specs[name] = spec
    return specs


register_specs("llama3")
