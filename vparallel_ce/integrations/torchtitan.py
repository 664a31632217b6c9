r"""torchtitan train specs that use vparallel_ce's losses (torchtitan 0.2.2).

Importing this module registers two train specs built from torchtitan's ``llama3`` spec, by
calling :func:`register` (idempotent). That is how torchtitan's ``--experimental.custom_import``,
which only imports the module it names, installs them; ``import vparallel_ce`` never imports this
module, so it registers nothing::

    pip install "vparallel_ce[torchtitan]"
    torchrun --nproc_per_node 8 -m torchtitan.train --job.config_file llama3_8b.toml \
        --experimental.custom_import vparallel_ce.integrations.torchtitan \
        --job.custom_config_module vparallel_ce.integrations.torchtitan \
        --model.name llama3_vparallel_fused --vparallel.chunks auto

* ``llama3_vparallel``: the model is unchanged; the loss is :func:`vparallel_ce.cross_entropy` on
  its logits. Under TP with loss parallel (torchtitan's default) the logits arrive as the
  ``Shard(-1)`` DTensor of the ColwiseParallel lm_head and stay sharded on the vocab.
* ``llama3_vparallel_fused``: the lm_head is fused into :func:`vparallel_ce.linear_cross_entropy`,
  so the logits never exist. The model's ``output`` module is a :class:`FusedLMHead`: it holds the
  lm_head weight as its parameter ``weight`` (``output.weight``, as in ``llama3``, so checkpoints
  are interchangeable) and its forward returns the loss's inputs, ``(hidden, weight)``, instead of
  the logits. Under TP its parallel style is :class:`FusedLMHeadParallel` -- the weight sharded
  ``Shard(0)`` over the vocab, the hidden states made ``Replicate``, the output left as it is --
  applied by :func:`parallelize_llama_fused`, torchtitan's ``parallelize_llama`` with that one
  change (torchtitan 0.2.2 writes each model's TP plan into its parallelize function).

Both specs keep everything else of ``llama3`` (pipelining, data, optimizer, checkpoint conversion,
flavors -- the same ``model_args`` mapping, so a flavor added to it shows up in all three). Under
pipeline parallelism the schedule's loss is a :class:`vparallel_ce.pipeline.PipelineLoss`
normalised by the step's valid-token count inside the schedule (see
:class:`TokenNormalisedSchedule` for what that fixes in torchtitan 0.2.2).

Options, torchtitan style (with ``--job.custom_config_module vparallel_ce.integrations.torchtitan``,
which adds a ``[vparallel]`` section to the job config; without it the defaults apply)::

    --vparallel.chunks auto|K  --vparallel.schedule auto|token|vocab  --vparallel.recompute auto|true|false
    --vparallel.budget_mib M   --vparallel.memory_mib M  --vparallel.label_smoothing S  --vparallel.z_loss Z
    --vparallel.no-check

or in the TOML file: ``[job] custom_config_module = "vparallel_ce.integrations.torchtitan"`` and a
``[vparallel]`` table. Other models: :func:`vparallel_train_spec` builds the two specs from another
train spec (the fused one with a parallelize function that gives the lm_head
:class:`FusedLMHeadParallel`).
"""

import contextlib
import dataclasses
import functools
import warnings
from dataclasses import dataclass, field
from importlib import metadata

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel, ParallelStyle, PrepareModuleInput, RowwiseParallel, SequenceParallel, parallelize_module,
)

import vparallel_ce
from vparallel_ce.pipeline import PipelineLoss, count_valid_tokens, microbatches_in_flight
from vparallel_ce.policy import ChunkPolicy

try:
    from torchtitan.config import TORCH_DTYPE_MAP
    from torchtitan.distributed.activation_checkpoint import apply_ac
    from torchtitan.distributed.context_parallel import apply_cp_to_attention_module
    from torchtitan.distributed.tensor_parallel import maybe_enable_async_tp
    from torchtitan.models.llama3.infra import parallelize as _llama3_parallelize
    from torchtitan.protocols import train_spec as _train_spec
    from torchtitan.tools.logging import logger
except ImportError as e:  # pragma: no cover - exercised only without torchtitan
    raise ImportError(
        "vparallel_ce.integrations.torchtitan needs torchtitan 0.2.2: pip install \"vparallel_ce[torchtitan]\""
    ) from e

__all__ = [
    "VERIFIED_VERSIONS",
    "SPEC_NAMES",
    "VParallel",
    "JobConfig",
    "LogitsLoss",
    "FusedLoss",
    "build_torchtitan_loss_fn",
    "FusedLMHead",
    "FusedLMHeadParallel",
    "parallelize_llama_fused",
    "TokenNormalisedSchedule",
    "vparallel_train_spec",
    "register",
]

VERIFIED_VERSIONS = ("0.2.2",)
SPEC_NAMES = {"llama3_vparallel": False, "llama3_vparallel_fused": True}  # name -> fused


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


# The [vparallel] strings become the ops' option values here; whether a value is valid is then
# decided by vparallel_ce.build_loss_fn, which checks every option when the loss is built.


def _parse_chunks(value):
    if isinstance(value, str):
        text = value.strip().lower()
        if text == "auto":
            return "auto"
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"--vparallel.chunks must be 'auto' or a positive integer, got {value!r}") from None
    return value  # an int from a TOML file


def _parse_recompute(value):
    text = str(value).strip().lower()
    table = {"auto": None, "none": None, "true": True, "1": True, "false": False, "0": False}
    if text not in table:
        raise ValueError(f"--vparallel.recompute must be auto, true or false, got {value!r}")
    return table[text]


def _policy(cfg: VParallel) -> ChunkPolicy:
    for name in ("budget_mib", "memory_mib"):
        if getattr(cfg, name) < 0:
            raise ValueError(f"--vparallel.{name} must be >= 0, got {getattr(cfg, name)}")
    return ChunkPolicy(budget_bytes=int(cfg.budget_mib * 2**20) if cfg.budget_mib else None,
                       memory_bytes=int(cfg.memory_mib * 2**20) if cfg.memory_mib else None)


def _common_options(cfg: VParallel) -> dict:
    # reduction="sum": torchtitan's trainer divides by the step's global valid-token count itself
    return {"reduction": "sum", "chunks": _parse_chunks(cfg.chunks), "label_smoothing": float(cfg.label_smoothing),
            "z_loss": float(cfg.z_loss), "check": bool(cfg.check)}


# ---------------------------------------------------------------------------------------------
# The losses, in torchtitan's loss-function signature: loss_fn(pred, labels) -> the SUM of the
# token losses. Each wraps the vparallel_ce.build_loss_fn module of its op.


@contextlib.contextmanager
def _autocast_off(t: torch.Tensor):
    # torchtitan runs the loss inside its AMP context (single device / DDP). The ops keep their own
    # fp32 softmax statistics and accumulators; autocast would recast their matmuls.
    with torch.autocast(device_type=t.device.type, enabled=False):
        yield


def _compile(self, backend: str = "inductor"):
    """Compile the loss's :meth:`forward` with ``torch.compile(backend=backend)``, as torchtitan
    compiles its own loss for ``compile.components`` holding ``"loss"``. On one rank the op is one
    custom op of the graph; under TP (DTensor inputs) it runs eagerly between graphs
    (:mod:`vparallel_ce.compiled`). Returns the loss."""
    self.forward = torch.compile(self.forward, backend=backend)
    return self


class LogitsLoss:
    """``vparallel_ce.cross_entropy`` on the model's logits ``[B, S, V]`` -- under TP with loss
    parallel the ``Shard(-1)`` DTensor (its mesh gives the group), else a plain tensor."""

    __name__ = "vparallel_cross_entropy"

    def __init__(self, cfg: VParallel):
        self.module = vparallel_ce.build_loss_fn("chunked", **_common_options(cfg))

    @property
    def options(self) -> dict:
        return self.module.options

    def __call__(self, pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.forward(pred, labels)

    def forward(self, pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        with _autocast_off(pred):
            return self.module(pred, labels)

    compile = _compile


class FusedLoss:
    """``vparallel_ce.linear_cross_entropy`` on the ``(hidden, weight)`` that :class:`FusedLMHead`
    returns: the hidden states and this rank's lm_head weight (shard), no logits."""

    __name__ = "vparallel_linear_cross_entropy"

    def __init__(self, cfg: VParallel):
        options = _common_options(cfg)
        options.update(schedule=str(cfg.schedule).strip().lower(), recompute=_parse_recompute(cfg.recompute),
                       policy=_policy(cfg))
        self.module = vparallel_ce.build_loss_fn("fused", **options)

    @property
    def options(self) -> dict:
        return self.module.options

    @property
    def policy(self) -> ChunkPolicy:
        return self.module.options["policy"]

    def set_microbatches_in_flight(self, n: int) -> None:
        """Size the chunks for ``n`` microbatch losses alive at once (a pipeline schedule's count)."""
        policy = dataclasses.replace(self.policy, microbatches_in_flight=int(n))
        self.module = vparallel_ce.build_loss_fn("fused", **{**self.module.options, "policy": policy})

    def __call__(self, pred: tuple, labels: torch.Tensor) -> torch.Tensor:
        if not (isinstance(pred, tuple) and len(pred) == 2 and all(isinstance(t, torch.Tensor) for t in pred)):
            raise TypeError(
                f"the fused vparallel loss takes the (hidden, weight) that a FusedLMHead lm_head returns, got "
                f"{type(pred).__name__}: use a *_vparallel_fused train spec, whose model's output module is a "
                f"FusedLMHead"
            )
        return self.forward(*pred, labels)

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        with _autocast_off(hidden):
            return self.module(hidden, weight, labels)

    compile = _compile


def build_torchtitan_loss_fn(job_config, *, fused: bool = False, **kwargs):
    """A ``TrainSpec.build_loss_fn`` (torchtitan calls it as ``(job_config, parallel_dims=...)``):
    the SUM loss of the ``[vparallel]`` options, :class:`FusedLoss` if ``fused`` else
    :class:`LogitsLoss`. Bad options raise here, when torchtitan builds the loss."""
    del kwargs  # parallel_dims: the group comes from the DTensors
    cfg = _options(job_config)
    loss = FusedLoss(cfg) if fused else LogitsLoss(cfg)
    if job_config.compile.enable and "loss" in job_config.compile.components:
        logger.info(f"vparallel_ce: compiling the loss with torch.compile (backend {job_config.compile.backend})")
        loss.compile(job_config.compile.backend)
    logger.info(f"vparallel_ce: {loss.__name__} with {loss.options}")
    return loss


# ---------------------------------------------------------------------------------------------
# The fused lm_head and its tensor-parallel style


class FusedLMHead(nn.Module):
    """An lm_head that returns the inputs of the fused loss, ``(hidden, weight)``, instead of logits.

    It holds the lm_head weight ``[V, H]`` as its own parameter ``weight`` (the nn.Linear's
    parameter object, see :meth:`from_linear`), so state dicts, FSDP and the HF adapter see the
    nn.Linear's names. The forward returns ``hidden`` as it arrives (under TP:
    :class:`FusedLMHeadParallel` has made it ``Replicate``) and a view of the weight taken inside
    the forward, which is what the loss needs: under TP the ``Shard(0)`` DTensor, under FSDP the
    unsharded weight (outside the forward FSDP holds only its own shard; the parameter itself
    would get FSDP's per-forward output hooks). Under autocast both are cast to the autocast
    dtype, as ``F.linear`` would cast them. A plain tuple of tensors: what a pipeline stage may
    output (torch detaches its members in place after the backward; it leaves the view alone).
    """

    def __init__(self, weight: nn.Parameter):
        super().__init__()
        self.weight = weight

    @classmethod
    def from_linear(cls, linear: nn.Module) -> "FusedLMHead":
        if not isinstance(linear, nn.Linear) or linear.bias is not None:
            raise TypeError(f"the fused vparallel loss needs an nn.Linear lm_head without bias, got {linear!r}")
        return cls(linear.weight)

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.weight
        device_type = hidden.device.type
        if torch.is_autocast_enabled(device_type):
            dtype = torch.get_autocast_dtype(device_type)
            hidden, w = hidden.to(dtype), w.to(dtype)
        return hidden, w.view_as(w)

    def extra_repr(self) -> str:
        return f"vocab_size={self.weight.shape[0]}, hidden_size={self.weight.shape[1]}"


class FusedLMHeadParallel(ParallelStyle):
    """Tensor parallelism for a :class:`FusedLMHead` (``parallelize_module(model, tp_mesh,
    {"output": FusedLMHeadParallel(...)})``).

    The weight is sharded as ``ColwiseParallel`` shards an lm_head's: ``Shard(0)``, the vocab
    split over the TP mesh. The input, in ``input_layouts`` (``Shard(1)`` after torchtitan's
    sequence-parallel norm; default ``Replicate()``), is made ``Replicate`` as ColwiseParallel
    would. Unlike ColwiseParallel there is no output step: the module returns the hidden states and
    the weight shard, not logits, and the loss consumes them as they are.
    """

    def __init__(self, *, input_layouts=None):
        super().__init__()
        self.input_layouts = (input_layouts or Replicate(),)

    def _partition(self, name, module, device_mesh):
        if isinstance(module, FusedLMHead):
            weight = distribute_tensor(module.weight, device_mesh, [Shard(0)], src_data_rank=self.src_data_rank)
            module.register_parameter("weight", nn.Parameter(weight, requires_grad=module.weight.requires_grad))

    def _prepare_input(self, module, inputs, device_mesh):
        hidden = inputs[0]
        if not isinstance(hidden, DTensor):
            hidden = DTensor.from_local(hidden, device_mesh, self.input_layouts, run_check=False)
        if hidden.placements != (Replicate(),):
            hidden = hidden.redistribute(placements=(Replicate(),), async_op=True)
        return (hidden, *inputs[1:])

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        if not isinstance(module, FusedLMHead):
            raise TypeError(f"FusedLMHeadParallel applies to a FusedLMHead, got {type(module).__name__}; an lm_head "
                            "that returns logits takes ColwiseParallel")
        return distribute_module(module, device_mesh, self._partition, self._prepare_input)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(input_layouts={self.input_layouts})"


def _with_fused_head(model_cls: type) -> type:
    """A subclass of ``model_cls`` whose ``output`` lm_head is a :class:`FusedLMHead` (built from the
    ``nn.Linear`` that ``model_cls`` makes, same parameter and initialisation), so the model returns
    ``(hidden, weight)`` where ``model_cls`` returned logits."""

    class FusedHeadModel(model_cls):
        def __init__(self, model_args):
            super().__init__(model_args)
            self.output = FusedLMHead.from_linear(self.output)

    FusedHeadModel.__name__ = FusedHeadModel.__qualname__ = f"{model_cls.__name__}FusedHead"
    return FusedHeadModel


def _apply_fused_tp(model: nn.Module, tp_mesh) -> None:
    """torchtitan 0.2.2's llama3 TP plan (its ``apply_tp``: sequence parallelism around every norm,
    column/row-parallel attention and feed-forward), with :class:`FusedLMHeadParallel` for the
    lm_head where torchtitan gives it ColwiseParallel."""
    parallelize_module(model, tp_mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": FusedLMHeadParallel(input_layouts=Shard(1)),
    })
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, {
            "attention_norm": SequenceParallel(),
            # positions (the 4th input) stay plain tensors, as in torchtitan's plan
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None, None),
                                            desired_input_layouts=(Replicate(), None, None, None)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w3": ColwiseParallel(),
        })
    logger.info("vparallel_ce: applied tensor parallelism, the lm_head with FusedLMHeadParallel")


def parallelize_llama_fused(model: nn.Module, parallel_dims, job_config) -> nn.Module:
    """The ``parallelize_fn`` of ``llama3_vparallel_fused``: torchtitan 0.2.2's ``parallelize_llama``
    -- the same steps, through the same torchtitan functions, in its order: TP, context
    parallelism, activation checkpointing, per-block compile, FSDP/HSDP or DDP -- for a model whose
    lm_head is a :class:`FusedLMHead`. Two differences:

    * under TP the lm_head gets :class:`FusedLMHeadParallel`, where torchtitan's plan (written
      into its ``apply_tp``) gives it ColwiseParallel, whose output step would treat the module's
      output as logits;
    * under FSDP the lm_head's group stays unsharded from its forward to its backward: the loss
      runs after the module's forward, on the view of the unsharded weight.
    """
    if job_config.training.seq_len % parallel_dims.seq_len_divisor:
        raise ValueError(f"sequence length {job_config.training.seq_len} must be divisible by "
                         f"{parallel_dims.seq_len_divisor} (the TP degree times 2 x the CP degree)")
    if parallel_dims.tp_enabled:
        float8 = "float8" in job_config.model.converters
        rowwise = job_config.quantize.linear.float8.recipe_name in ("rowwise", "rowwise_with_gw_hp")
        if float8 and not rowwise:
            raise NotImplementedError("llama3_vparallel_fused does not apply float8 tensorwise tensor parallelism; use "
                                      "a rowwise float8 recipe (high-precision all-gathers) or llama3_vparallel")
        tp_mesh = parallel_dims.get_mesh("tp")
        _apply_fused_tp(model, tp_mesh)
        maybe_enable_async_tp(job_config, tp_mesh)
    if parallel_dims.cp_enabled:
        apply_cp_to_attention_module([block.attention.inner_attention for block in model.layers.values()],
                                     parallel_dims.get_mesh("cp"), getattr(model.model_args, "attn_type", "sdpa"))
    compile_model = job_config.compile.enable and "model" in job_config.compile.components
    if job_config.activation_checkpoint.mode != "none":
        # llama3's selective-AC save list (module-level in torchtitan's parallelize), so that the
        # fused spec saves and recomputes the same ops as llama3
        apply_ac(model, job_config.activation_checkpoint, model_compile_enabled=compile_model,
                 op_sac_save_list=_llama3_parallelize._op_sac_save_list, base_folder=job_config.job.dump_folder)
    if compile_model:
        _llama3_parallelize.apply_compile(model, job_config.compile)
    if parallel_dims.fsdp_enabled:
        names = ["dp_replicate", "fsdp"] if parallel_dims.dp_replicate_enabled else ["fsdp"]
        _llama3_parallelize.apply_fsdp(
            model, parallel_dims.get_mesh(names),
            param_dtype=TORCH_DTYPE_MAP[job_config.training.mixed_precision_param],
            reduce_dtype=TORCH_DTYPE_MAP[job_config.training.mixed_precision_reduce],
            pp_enabled=parallel_dims.pp_enabled, cpu_offload=job_config.training.enable_cpu_offload,
            reshard_after_forward_policy=job_config.parallelism.fsdp_reshard_after_forward,
        )
        head = model.output  # None on pipeline stages without the lm_head
        if isinstance(head, FSDPModule):
            if job_config.parallelism.fsdp_reshard_after_forward == "always":
                logger.info("vparallel_ce: keeping the lm_head's FSDP group unsharded between its forward and the "
                            "fused loss (fsdp_reshard_after_forward=always applies to the other groups)")
            head.set_reshard_after_forward(False, recurse=False)
    elif parallel_dims.dp_replicate_enabled:
        dp_mesh = parallel_dims.get_mesh("dp_replicate")
        if parallel_dims.world_size != dp_mesh.size():
            raise RuntimeError("DDP has not supported > 1D parallelism")
        _llama3_parallelize.apply_ddp(model, dp_mesh, enable_compile=compile_model)
    return model


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

    ``eval()`` (validation) keeps the SUM losses torchtitan's validator expects. Every other
    attribute is the wrapped schedule's.
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
    @functools.wraps(pipelining_fn)
    def pipelining(model, parallel_dims, job_config, device, model_args, parallelize_fn, loss_fn):
        pipe_loss = PipelineLoss(loss_fn, name=getattr(loss_fn, "__name__", "loss"))
        schedule, model_parts, has_first, has_last = pipelining_fn(
            model, parallel_dims, job_config, device, model_args, parallelize_fn, pipe_loss
        )
        if isinstance(loss_fn, FusedLoss):  # size the chunks for the losses alive at once
            loss_fn.set_microbatches_in_flight(microbatches_in_flight(schedule))
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


def vparallel_train_spec(base, *, fused: bool, parallelize_fn=None):
    """A copy of the torchtitan ``TrainSpec`` ``base`` with vparallel_ce's loss; shares
    ``base.model_args`` (the flavors) with ``base``.

    ``fused``: the model's ``output`` lm_head becomes a :class:`FusedLMHead` and the loss
    :class:`FusedLoss`. The spec then needs a ``parallelize_fn`` that gives the lm_head
    :class:`FusedLMHeadParallel` under TP: :func:`parallelize_llama_fused` for a base that uses
    torchtitan's ``parallelize_llama``; for other bases pass your own (fused specs only).
    """
    if parallelize_fn is not None and not fused:
        raise TypeError("parallelize_fn= is for fused specs; the logits spec keeps the base's")
    changes = {
        "build_loss_fn": functools.partial(build_torchtitan_loss_fn, fused=fused),
        "pipelining_fn": None if base.pipelining_fn is None else _token_normalised_pipelining(base.pipelining_fn),
    }
    if fused:
        if parallelize_fn is None:
            if base.parallelize_fn is not _llama3_parallelize.parallelize_llama:
                raise ValueError(
                    f"a fused spec from a base whose parallelize_fn is {base.parallelize_fn.__name__} needs "
                    "parallelize_fn=: one that gives the FusedLMHead lm_head FusedLMHeadParallel under TP "
                    "(torchtitan writes each model's TP plan into its parallelize function)"
                )
            parallelize_fn = parallelize_llama_fused
        changes["model_cls"] = _with_fused_head(base.model_cls)
        changes["parallelize_fn"] = parallelize_fn
    return dataclasses.replace(base, **changes)


def register() -> dict:
    """Register the train specs of :data:`SPEC_NAMES` with torchtitan, built from its ``llama3``
    spec. Idempotent: a name already registered keeps its spec. Returns ``{name: TrainSpec}``."""
    base = _train_spec.get_train_spec("llama3")
    specs = {}
    for name, fused in SPEC_NAMES.items():
        try:
            spec = _train_spec.get_train_spec(name)
        except ValueError:  # not registered yet
            spec = vparallel_train_spec(base, fused=fused)
            _train_spec.register_train_spec(name, spec)
        specs[name] = spec
    return specs


register()  # what --experimental.custom_import relies on (see the module docstring)
