"""What the ranks of a group must agree on before a call's first collective, as one row of int64
codes (:class:`Facts`), and how each code reads back in an error message. The exchange that
gathers and compares the rows is :mod:`vparallel_ce.agreement`.
"""

from __future__ import annotations

import dataclasses
import struct
import zlib
from dataclasses import dataclass, field

import torch

from .checksums import target_checksum
from .checksums import target_checksum as _ids_checksum
from .divergence import DIVERGENCES
from .options import Options
from .policy import DEFAULT_POLICY
from .replication import hidden_checksum
from .stats import REDUCTIONS
from .topk import TAIL_MODES
from .validate import SCHEDULES

__all__ = ["Facts", "OPS"]


_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.int16,
           torch.int8, torch.uint8, torch.bool)


OPS = ("cross_entropy", "linear_cross_entropy", "token_logprobs", "linear_token_logprobs", "distillation_loss",
       "linear_distillation_loss", "topk_logprobs", "linear_topk_logprobs", "linear_mtp_loss")


_INPUT_NAMES = ("grad mode", "input", "weight", "bias")


def _dtype_code(dtype) -> int:
    if dtype is None:
        return -1
    return _DTYPES.index(dtype) if dtype in _DTYPES else len(_DTYPES)


def _show_dtype(code: int) -> str:
    return "None" if code < 0 else str(_DTYPES[code]) if code < len(_DTYPES) else "another dtype"


def _float_code(x) -> int:
    """A float as the int64 of its bits: compared exactly and shown back as the float."""
    return int.from_bytes(struct.pack("<d", float(x)), "little", signed=True)


def _show_float(code: int) -> str:
    return repr(struct.unpack("<d", code.to_bytes(8, "little", signed=True))[0])


def _show_choice(choices):
    return lambda code: repr(choices[code]) if 0 <= code < len(choices) else "?"


def _show_chunks(code: int) -> str:
    return "'auto'" if code == -1 else str(code)


def _show_softcap(code: int) -> str:
    return "None" if code == _NO_SOFTCAP else _show_float(code)


def _show_grads(code: int) -> str:
    if not code & 1:
        return "grad mode off"
    names = [n for i, n in enumerate(_INPUT_NAMES) if i and code >> i & 1]
    return "requires grad: " + (", ".join(names) if names else "none")


_NO_SOFTCAP = _float_code(float("nan")) ^ 1  # no float has these bits


_NO_FACT = 0  # a fact that does not apply to the op, or that a rank with bad input cannot make


def _show_optional_float(code: int) -> str:
    return "None" if code == _NO_SOFTCAP else _show_float(code)


def _shown(show, *, per_rank: bool = False):
    """A field's metadata: how its code reads in a message; ``per_rank``: with sequence
    parallelism each rank holds other tokens, so the value is not compared."""
    return field(metadata=dict(show=show, per_rank=per_rank))


@dataclass(frozen=True)
class Facts:
    """What every rank of a group must agree on before the op's first collective, as integer codes:
    one int64 row per rank, the same length whatever the op, its options and inputs, so that ranks
    that disagree on any of them still gather rows that match up and raise the same error. Fields
    are checked in their order here (a rank holding other tokens is reported as that, not as a
    checksum that differs). Build with :meth:`of`."""

    op: int = _shown(_show_choice(OPS))
    sequence_parallel: int = _shown(lambda c: str(bool(c)))
    input_dtype: int = _shown(_show_dtype)
    weight_dtype: int = _shown(_show_dtype)
    bias_dtype: int = _shown(_show_dtype)
    target_dtype: int = _shown(_show_dtype)
    hidden_size: int = _shown(str)
    # the backward's collectives (dh over the group, rows with sequence parallelism) run where an
    # input needs a gradient: ranks that differ would leave one waiting for the others
    grads: int = _shown(_show_grads)
    reduction: int = _shown(_show_choice(REDUCTIONS))
    chunks: int = _shown(_show_chunks)
    schedule: int = _shown(_show_choice(SCHEDULES))
    recompute: int = _shown(lambda c: {-1: "None", 0: "False", 1: "True"}.get(c, "?"))
    fused_kernels: int = _shown(lambda c: str(bool(c)))
    ignore_index: int = _shown(str)
    # the mean's divisor, if given (_NO_COUNT: none); a tensor count rides on the exchange as it is
    num_valid_tokens: object = _shown(lambda c: "None" if c == _NO_COUNT else str(c))
    label_smoothing: int = _shown(_show_float)
    z_loss: int = _shown(_show_float)
    softcap: int = _shown(_show_softcap)
    temperature: int = _shown(_show_float)
    # the statistics carry the entropy (one more value per token in the all-reduces)
    entropy: int = _shown(lambda c: str(bool(c)))
    # the distillation's math: each decides what the per-chunk all-reduces carry, and the loss
    divergence: int = _shown(_show_choice(DIVERGENCES))
    beta: int = _shown(_show_float)
    hard_weight: int = _shown(_show_float)
    # distillation without a target counts every token; with one, ignore_index decides
    target_given: int = _shown(lambda c: str(bool(c)))
    # the distillation's teacher: its logits' (or top-k log-probs') dtype -- it may differ from the
    # student's, but not from rank to rank -- and for a top-k teacher its k, tail mode and values,
    # which decide the per-chunk all-reduce's size and every rank's loss (-1 / 0: dense or no teacher)
    teacher_dtype: int = _shown(_show_dtype)
    teacher_k: int = _shown(lambda c: "dense logits" if c < 0 else str(c))
    teacher_tail: int = _shown(lambda c: "None" if c < 0 else _show_choice(TAIL_MODES)(c))
    # (with sequence parallelism a sparse teacher's rows are each rank's own tokens', as the hidden states)
    teacher_ids_checksum: object = _shown(lambda c: f"{c:#x}", per_rank=True)
    teacher_logprobs_checksum: object = _shown(lambda c: f"{c:#x}", per_rank=True)
    # the log-prob ops' sampling set: its width K (-1: none) and ids (position-sensitive, each
    # rank's own rows with sequence parallelism), or the sampling masks that rebuild it
    support_k: int = _shown(lambda c: "None" if c < 0 else str(c))
    support_checksum: object = _shown(lambda c: f"{c:#x}", per_rank=True)
    top_k: int = _shown(lambda c: "None" if c < 0 else str(c))
    top_p: int = _shown(_show_optional_float)
    min_p: int = _shown(_show_optional_float)
    # the lm_head matmuls' dtype (torch.autocast's inside it): it decides the plan and the kernels
    matmul_dtype: int = _shown(_show_dtype)
    # the logits' dtype as asked (None: the matmul dtype): it decides their precision and the plan's memory
    logits_dtype: int = _shown(_show_dtype)
    chunk_policy: int = _shown(lambda c: f"a ChunkPolicy with CRC {c}")
    # the order of every sum (tiles, rank-ordered SUM): ranks that differ would run other collectives
    batch_invariant: int = _shown(lambda c: str(bool(c)))
    # a multi-token-prediction loss: its heads (rows of its target), the depths' weight, and the
    # heads' divisors as given (a position-weighted sum on the device: no host read)
    mtp_heads: int = _shown(str)
    mtp_scale: int = _shown(_show_float)
    mtp_num_valid_tokens: object = _shown(lambda c: "None" if c == _NO_COUNT else f"per-head counts with checksum {c}")
    token_count: int = _shown(str, per_rank=True)
    # position-sensitive (target_checksum): a permutation of the ids, or ids shifted by one, is a
    # different checksum
    target_checksum: object = _shown(lambda c: f"{c:#x}", per_rank=True)
    # hidden states must be replicated over the group (hidden_checksum: position-sensitive, exact)
    hidden_checksum: object = _shown(lambda c: f"{c:#x}", per_rank=True)

    @classmethod
    def of(cls, *, op: str, options: Options, inputs: tuple, target: torch.Tensor, target_checksum,
           hidden_checksum=_NO_FACT, fused: bool = False, matmul_dtype: torch.dtype | None = None,
           target_given: bool = True, teacher=None, support: torch.Tensor | None = None) -> "Facts":
        """``inputs``: the op's float inputs, ``(logits,)`` or ``(hidden, weight, bias)``;
        ``fused``, ``matmul_dtype``: the linear ops' kernels and lm_head matmul dtype (False and
        None for the logits ops); ``target_given``: False for a distillation without a target
        (``target`` is then a stand-in of zeros); ``teacher``: the distillation's (checked) teacher,
        its logits or a :class:`~vparallel_ce.topk.TopKTeacher`, else None; ``support``: the
        log-prob ops' ``[N, K]`` sampling set, else None."""
        o = options
        first, weight, bias = (*inputs, None, None)[:3]
        grads = int(torch.is_grad_enabled())
        for i, t in enumerate((first, weight, bias)):
            grads |= int(t is not None and t.requires_grad) << (i + 1)
        return cls(
            OPS.index(op), int(bool(o.sequence_parallel)), _dtype_code(first.dtype),
            _dtype_code(None if weight is None else weight.dtype), _dtype_code(None if bias is None else bias.dtype),
            _dtype_code(target.dtype), -1 if weight is None else weight.shape[-1], grads,
            REDUCTIONS.index(o.reduction), -1 if o.chunks == "auto" else int(o.chunks), SCHEDULES.index(o.schedule),
            {None: -1, False: 0, True: 1}[o.recompute], int(bool(fused)), int(o.ignore_index),
            _count_code(o.num_valid_tokens, target.device),
            _float_code(o.label_smoothing), _float_code(o.z_loss),
            _NO_SOFTCAP if o.softcap is None else _float_code(o.softcap), _float_code(o.temperature),
            int(o.with_entropy), DIVERGENCES.index(o.divergence), _float_code(o.beta), _float_code(o.hard_weight),
            int(target_given), *_teacher_codes(teacher),
            -1 if support is None else support.shape[-1],
            _NO_FACT if support is None else _ids_checksum(support.reshape(-1).to(torch.int64)),
            -1 if o.top_k is None else int(o.top_k), _optional_float_code(o.top_p), _optional_float_code(o.min_p),
            _dtype_code(matmul_dtype), _dtype_code(o.logits_dtype),
            _policy_code(o.policy), int(o.batch_invariant), int(o.mtp_heads), _float_code(o.mtp_scale),
            _counts_code(o.mtp_counts, target.device), target.numel(), target_checksum, hidden_checksum)

    def row(self) -> list:
        return [getattr(self, f.name) for f in dataclasses.fields(self)]


def _optional_float_code(x) -> int:
    return _NO_SOFTCAP if x is None else _float_code(x)


def _teacher_codes(teacher) -> tuple:
    """``(dtype, k, tail, ids checksum, logprobs checksum)`` of a distillation's teacher."""
    if teacher is None:
        return -1, -1, -1, _NO_FACT, _NO_FACT
    if isinstance(teacher, torch.Tensor):
        return _dtype_code(teacher.dtype), -1, -1, _NO_FACT, _NO_FACT
    ids, logprobs = teacher.ids, teacher.logprobs
    return (_dtype_code(logprobs.dtype), ids.shape[-1], TAIL_MODES.index(teacher.tail),
            target_checksum(ids.reshape(-1).to(torch.int64)), hidden_checksum(logprobs))


_NO_COUNT = -(2**63)  # num_valid_tokens=None: no count, negative or not, has this code


def _count_code(count, device):
    """``num_valid_tokens`` as a fact: :data:`_NO_COUNT` for None, an int as it is, a tensor as an
    int64 on the exchange's device (no host read; a negative one is refused after the exchange)."""
    if count is None:
        return _NO_COUNT
    if isinstance(count, torch.Tensor):
        return count.reshape(()).to(device, torch.int64)
    return int(count)


def _counts_code(counts, device):
    """Per-head counts as one fact: ``sum_d counts_d * 1000003^d`` in int64 on the exchange's device
    (wrapping; position-sensitive, no host read)."""
    if counts is None:
        return _NO_COUNT
    c = counts.to(device, torch.int64)
    return (c * torch.tensor(1000003, dtype=torch.int64, device=device).pow(
        torch.arange(c.numel(), device=device))).sum()


_FACT_FIELDS = dataclasses.fields(Facts)


def _policy_code(policy) -> int:
    """The chunk policy as one integer (a CRC of its fields): ranks whose policies differ (say, a
    budget from each rank's free memory) would plan different chunk counts and deadlock in the
    per-chunk collectives."""
    return zlib.crc32(repr(dataclasses.astuple(policy or DEFAULT_POLICY)).encode())
