"""ChunkPolicy: the knobs of the chunk decision beyond the shapes and the call's own, and the decision
itself -- a call's :class:`~vparallel_ce.plan.Plan` (schedule, chunk count, where the gradients are
made) with its reasons, sized by :mod:`vparallel_ce.plan`'s memory models -- and ignored-token
compaction's rows. The precedence of the knobs and the speed model are :mod:`vparallel_ce.policy`'s
docstring; the default policy and ``explain`` live there.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field, replace

import torch

from .layout import vocab_blocks
from .plan import GiB, DistillShape, GradMode, Plan, WeightGrad, distillation_chunk_bytes, local_vocab, peak_bytes

__all__ = ["ChunkPolicy", "DEFAULT_BUDGET_BYTES", "COMPACT_ROW_ALIGN", "COMPACT_MIN_DROP", "COMPACT_READ_MIN_WORK"]


@dataclass(frozen=True)
class ChunkPolicy:
    """The inputs of the chunk decision beyond the shapes and the call's own knobs.

    Attributes:
        budget_bytes: bound on one chunk's fp32 logits (``tokens/chunk * V_loc * 4``), or for the
            distillation ops on one chunk's working set (:func:`distillation_chunk_bytes`); None =
            the default (``DEFAULT_BUDGET_BYTES``, soft: the ``min_chunk_tokens`` floor applies).
        min_chunk_tokens: with the default budget, chunks are never made smaller than this.
        block_columns: the vocab schedule's preferred block width: its time is flat while blocks
            stay this wide, so it uses at least ``ceil(V_loc / block_columns)`` blocks.
        microbatches_in_flight: forward passes whose saved state is alive at once on this stage
            (1 without PP or under 1F1B; the microbatch count under GPipe). With ``recompute=None``
            more than one turns gradients-in-forward off.
        memory_bytes: a target for ``linear_cross_entropy``'s whole peak over its inputs, dh and
            dW included (the model :func:`peak_bytes`, for bf16 operands and gradients): with
            ``chunks="auto"`` the call takes one token chunk if that fits, else the fewest vocab
            blocks that do, else blocks ``H`` wide (the floor: narrower ones lower nothing). Takes
            precedence over ``budget_bytes`` there.
        compact: the linear ops' ignored-token compaction (:meth:`kept_rows`: the lm_head runs over
            the rows whose target counts, rounded up to ``COMPACT_ROW_ALIGN`` with ignored ones).
            ``None`` (default): where the valid count is on the host already (a group's exchange,
            sequence parallelism's gathered counts), or where reading it costs under ~1% of the
            call (:meth:`reads_valid_count`); ``True``: always, reading the count where it is not
            (one host sync); ``False``: never.
    """

    budget_bytes: int | None = None
    min_chunk_tokens: int = 1024
    block_columns: int = 8192
    microbatches_in_flight: int = 1
    memory_bytes: int | None = None
    compact: bool | None = None
    # the fields' problem, found once at construction and part of equality: a policy holding
    # ``microbatches_in_flight=True`` equals one holding 1 field by field, and must not find that
    # one's cached plan or its front-door check passed
    _problem: str | None = field(default=None, init=False, repr=False)

    def __post_init__(self):
        for name, (ok, wanted) in _FIELD_RULES.items():
            value = getattr(self, name)
            if not ok(value):
                object.__setattr__(self, "_problem", f"ChunkPolicy.{name} must be {wanted}, got {value!r}")
                break

    def problem(self) -> str | None:
        """What is wrong with the fields, as a message naming the field, or None. Not raised at
        construction: the ops check it at their front door, so that a bad policy on one rank
        raises on every rank of the group; :meth:`plan` and ``explain`` raise it too."""
        return self._problem

    def reads_valid_count(self, num_tokens: int, hidden_size: int, local_vocab_size: int) -> bool:
        """Whether a call whose valid-token count is not on the host reads it there for compaction
        (a host sync: from behind queued work the GPU idles while the host then launches the
        call, ~0.1 ms): with ``compact=True``, or by default where one lm_head GEMM
        (``N * H * V_loc`` multiply-adds) is at least ``COMPACT_READ_MIN_WORK``, a call of ~10 ms
        or more on an H100, so that the sync costs under ~1% when nothing is ignored."""
        if self.compact is not None:
            return self.compact
        return num_tokens * hidden_size * local_vocab_size >= COMPACT_READ_MIN_WORK

    def kept_rows(self, counts: tuple[int, ...], valid_counts: tuple[int, ...]) -> tuple[int, ...] | None:
        """The rows each rank's lm_head runs over after compaction, from every rank's token and
        valid-token counts (a pure function of them: every rank finds the same), or None: no
        compaction. A rank keeps its valid rows rounded up to a multiple of ``COMPACT_ROW_ALIGN``
        (at least one such group; ignored rows fill them, and an all-ignored call runs as it would
        uncompacted, over a few rows) and never more than it holds. Only worth it where that
        drops at least ``1 / COMPACT_MIN_DROP`` of the rows: fewer, and the rows' gather and
        scatter cost about what the GEMMs save."""
        if self.compact is False:
            return None
        kept = tuple(min(n, -(-max(v, 1) // COMPACT_ROW_ALIGN) * COMPACT_ROW_ALIGN)
                     for n, v in zip(counts, valid_counts))
        dropped = sum(counts) - sum(kept)
        return kept if dropped > 0 and dropped * COMPACT_MIN_DROP >= sum(counts) else None

    @staticmethod
    def compacted_plan(plan: Plan, num_tokens: int, uncompacted: Plan, all_tokens: int, vocab_size: int,
                       tp_degree: int, *, hidden_size: int, dtype: torch.dtype, grad_dtype: torch.dtype | None = None,
                       logits_dtype: torch.dtype | None = None) -> Plan:
        """The plan a compacted ``linear_cross_entropy`` / ``linear_token_logprobs`` call runs over
        its ``num_tokens`` kept rows: ``plan`` (the policy's for them), unless its peak
        (:func:`peak_bytes`) is above the ``uncompacted`` plan's over ``all_tokens`` -- fewer rows
        can make one token chunk fit the budget, whose logits then outweigh the vocab blocks'
        floor -- and then ``uncompacted`` itself, whose peak over fewer rows is no larger: a
        compacted call never takes more memory than the uncompacted one."""
        if plan == uncompacted:
            return plan
        kw = dict(hidden_size=hidden_size, dtype=dtype, grad_dtype=grad_dtype, logits_dtype=logits_dtype)
        if peak_bytes(plan, num_tokens, vocab_size, tp_degree, **kw) > \
                peak_bytes(uncompacted, all_tokens, vocab_size, tp_degree, **kw):
            return uncompacted
        return plan

    @property
    def budget(self) -> int:
        return DEFAULT_BUDGET_BYTES if self.budget_bytes is None else int(self.budget_bytes)

    def chunks(self, num_tokens: int, vocab_size: int, tp_degree: int = 1) -> int:
        """Token chunks for ``num_tokens`` tokens of one microbatch on this rank."""
        return self._chunks_of_rows(num_tokens, local_vocab(vocab_size, tp_degree) * 4)

    def _chunks_of_rows(self, num_tokens: int, row: int) -> int:
        """The fewest token chunks whose ``row`` bytes per token fit the budget (capped by
        ``min_chunk_tokens`` under the default budget)."""
        if num_tokens <= 0 or row == 0:
            return 1
        if self.budget < row:  # not even one token's row fits: one token per chunk
            return num_tokens
        k = math.ceil(num_tokens / (self.budget // row))  # whole rows per chunk, so the bound holds
        if self.budget_bytes is None:
            k = min(k, math.ceil(num_tokens / self.min_chunk_tokens))
        return max(1, min(k, num_tokens))

    def plan(self, num_tokens: int, vocab_size: int, tp_degree: int = 1, *, hidden_size: int | None = None,
             reduction: str = "mean", chunks: int | str = "auto", schedule: str = "auto",
             recompute: bool | None = None, fused: bool = False, logits_dtype: torch.dtype | None = None,
             distillation: "DistillShape | None" = None, heads: int = 1) -> Plan:
        """The plan of one call. ``hidden_size=None`` plans ``cross_entropy`` (logits given: token
        chunks, gradients in backward); otherwise ``linear_cross_entropy`` with the call's
        ``chunks``, ``schedule`` and ``recompute`` (precedence in :mod:`vparallel_ce.policy`'s
        docstring). ``fused``: the call's recomputed logits run through the fused GEMM kernels
        (:func:`vparallel_ce.kernels.fused_applies`: bf16/fp16 on a GPU with Triton).
        ``logits_dtype``: the logits' dtype where wider than the matmul dtype
        (:attr:`vparallel_ce.call.Call.logits_dtype`), for the memory target's model (:func:`peak_bytes`).
        ``distillation``: plans a distillation op instead (:meth:`_distill_plan`; ``hidden_size``,
        ``schedule``, ``recompute``, ``fused`` and ``logits_dtype`` are then not read).
        ``heads``: the call stacks the rows of this many heads of ``num_tokens / heads`` rows each
        (``linear_mtp_loss``: the main head and ``D`` depths; :meth:`_heads_plan`).

        Memoised: the plan is a pure function of these arguments, and every call asks for it on
        the host path before its first GEMM (a plain dict, which ``torch.compile`` traces
        without warnings, unlike ``functools`` caches)."""
        key = (self, num_tokens, vocab_size, tp_degree, hidden_size, reduction, chunks, schedule, recompute, fused,
               logits_dtype, distillation, heads)
        try:
            found = _PLANS.get(key)
        except TypeError:  # an unhashable argument: plan it uncached (its check will name it)
            key, found = None, None
        if found is None:
            problem = self.problem()
            if problem is not None:
                raise ValueError(problem)
            if distillation is not None:
                found = self._distill_plan(num_tokens, vocab_size, tp_degree, distillation, reduction=reduction,
                                           chunks=chunks)
            else:
                found = self._plan(num_tokens, vocab_size, tp_degree, hidden_size=hidden_size, reduction=reduction,
                                   chunks=chunks, schedule=schedule, recompute=recompute, fused=fused,
                                   logits_dtype=logits_dtype)
                # stacked heads (_heads_plan), unless the caller bounds memory or wants gradients in backward
                if heads > 1 and hidden_size is not None and recompute is not True and reduction != "none" and (
                        chunks, schedule, self.budget_bytes, self.memory_bytes, self.microbatches_in_flight) == (
                        "auto", "auto", None, None, 1) and (found.schedule, found.chunks) != ("token", 1):
                    found = self._heads_plan(found, num_tokens, local_vocab(vocab_size, tp_degree), hidden_size, heads,
                                             logits_dtype)
            if key is not None:
                if len(_PLANS) >= 1024:
                    _PLANS.clear()
                _PLANS[key] = found
        return found

    def _plan(self, num_tokens: int, vocab_size: int, tp_degree: int, *, hidden_size: int | None, reduction: str,
              chunks: int | str, schedule: str, recompute: bool | None, fused: bool,
              logits_dtype: torch.dtype | None) -> Plan:
        v_loc = local_vocab(vocab_size, tp_degree)
        why = []
        if hidden_size is None:
            k = self.chunks(num_tokens, vocab_size, tp_degree) if chunks == "auto" else int(chunks)
            why.append(_budget_reason(self, num_tokens, v_loc, k) if chunks == "auto" else f"chunks={k} as given")
            return Plan("token", _token_chunks(k, num_tokens), GradMode.RECOMPUTE, why=tuple(why))
        k0 = min(self.chunks(num_tokens, vocab_size, tp_degree), max(v_loc, 1))
        sized = False  # whether a reason for the count is given yet
        k_fit = None  # the count a memory target chose
        if schedule != "auto":
            why.append(f"schedule={schedule!r} as given")
        elif chunks != "auto":
            schedule = "token"
            why.append(f"chunks={chunks} with schedule='auto' means token chunks")
            sized = True
        elif self.memory_bytes is not None:
            schedule, k_fit, reason = self._fit_memory(num_tokens, vocab_size, tp_degree, hidden_size, logits_dtype)
            why.append(reason)
            sized = True
        else:
            # one chunk: 3 matmuls, no accumulator (dW comes out of one matmul) -- the fastest point.
            # Several: the token schedule's fp32 dW accumulator (4 V_loc H bytes) does not shrink
            # with more chunks; past the budget walk the vocab instead (4 matmuls, memory at the floor)
            accumulator = v_loc * hidden_size * 4
            if k0 == 1 or (accumulator <= self.budget and not fused):
                schedule, sized = "token", True
                why.append(_budget_reason(self, num_tokens, v_loc, k0) + (
                    "" if k0 == 1 else f"; the fp32 dW accumulator ({accumulator / GiB:.2f} GiB) fits too"))
            elif fused:
                # fused, the vocab schedule's statistics pass writes no logits and its gradient pass
                # none but one dx block: memory at the floor at about the time of token chunks
                # (measured on an H200 at the odd vocab: vocab x8 6.5 ms / 0.22 GiB, token x3 7.4 / 0.48)
                schedule = "vocab"
                why.append(_budget_reason(self, num_tokens, v_loc, k0) + "; so vocab blocks, whose logits the fused "
                           "GEMM kernels never write (dW of each block from one matmul)")
            else:
                schedule = "vocab"
                why.append(f"token chunks would need an fp32 dW accumulator of {accumulator / GiB:.2f} GiB, over "
                           f"the {self.budget / GiB:.2f} GiB budget, so vocab blocks (dW of each from one matmul)")
        if k_fit is not None:
            k = k_fit
        elif chunks != "auto":
            k = _token_chunks(chunks, num_tokens) if schedule == "token" else int(chunks)
            if not sized:
                why.append(f"chunks={chunks} as given")
        elif schedule == "token":
            k = k0
            if not sized:
                why.append(_budget_reason(self, num_tokens, v_loc, k))
        else:
            # blocks of the local vocab over all tokens: the budget bounds one block's fp32 logits,
            # and blocks of ~block_columns cost no time over one block (docs/policy.md)
            fp32 = num_tokens * v_loc * 4
            k = max(math.ceil(fp32 / max(self.budget, 1)), math.ceil(v_loc / self.block_columns), 1)
            why.append(f"{k} blocks: one block's fp32 logits within the budget and blocks of at most "
                       f"~{self.block_columns} columns")
        if schedule == "vocab":
            k = len(vocab_blocks(v_loc, k))  # the count the 128-column rounding realises
        # One token chunk and one microbatch in flight: keep that chunk's logits from forward and
        # make the gradients in backward, where the upstream gradient is known (3 matmuls, and no
        # pass that rescales dW by it). The peak is the same as making them in forward: the
        # logits exist then too, and the gradient is written over them.
        keep = (recompute is None and schedule == "token" and k == 1 and self.microbatches_in_flight <= 1)
        if recompute is not None:
            gif = not recompute
            why.append(f"recompute={recompute} as given")
        elif keep:
            gif = False
            why.append("one token chunk: its logits are kept from forward and the gradients made from them in "
                       "backward, scaled by the upstream gradient there (3 matmuls)" + (
                           "; with the whole vocab on this rank the statistics' kernel already turns them into "
                           "the gradient for an upstream gradient of 1, and the backward scales h and dh"
                           if tp_degree == 1 else ""))
        elif reduction == "none":
            gif = False
            why.append("reduction='none': the upstream gradient is known only in backward, so recompute")
        elif schedule == "token" and self.microbatches_in_flight <= 1:
            gif = True
            why.append("gradients made in forward (3 matmuls; dW summed over the chunks in fp32): at most one "
                       "microbatch in flight holds them")
        elif schedule == "token":
            gif = False
            why.append(f"{self.microbatches_in_flight} microbatches in flight would each hold dW from forward to "
                       "backward, so recompute")
        else:
            gif = False
            why.append("vocab blocks recompute their logits in backward (memory at the floor)")
        mode = GradMode.IN_FORWARD if gif else GradMode.FROM_KEPT_LOGITS if keep else GradMode.RECOMPUTE
        return Plan(schedule, k, mode, tuple(why))

    def _heads_plan(self, plan: Plan, num_tokens: int, v_loc: int, hidden_size: int, heads: int,
                    logits_dtype: torch.dtype | None) -> Plan:
        """``heads`` heads' rows stacked in one call (``linear_mtp_loss``), which :meth:`_plan` gave
        ``plan`` as one head's: token chunks of at most one head's rows, gradients made in forward
        (3 matmuls; one head's logits beside the fp32 dW accumulator, ``4 V_loc H``, however many
        heads), each no larger in logits than it (``2 H`` rows at 2 bytes a logit, ``H`` for fp32
        logits; >= ``min_chunk_tokens``), or the budget's chunks if fewer where the sum fits it."""
        per_head, logit = math.ceil(num_tokens / heads), 4 if logits_dtype is not None else 2
        k = heads * math.ceil(per_head / max(1, min(per_head, max(self.min_chunk_tokens, 4 * hidden_size // logit))))
        accumulator = 4 * v_loc * hidden_size
        if accumulator <= self.budget:
            k = min(k, self._chunks_of_rows(num_tokens, v_loc * 4))
        k = _token_chunks(k, num_tokens)
        rows = math.ceil(num_tokens / k)
        why = (f"{heads} heads of {per_head} rows are stacked: {k} token chunks of <= {rows} rows ("
               f"{rows * v_loc * logit / GiB:.2f} GiB of logits, at most one head's, beside the "
               f"{accumulator / GiB:.2f} GiB fp32 dW accumulator), gradients made in forward: 3 matmuls (a plain "
               "loss holds all heads' logits)")
        return Plan("token", k, GradMode.IN_FORWARD, ("as one head's rows: " + plan.why[0], why))

    def _distill_plan(self, num_tokens: int, vocab_size: int, tp_degree: int, shape: "DistillShape", *,
                      reduction: str, chunks: int | str) -> Plan:
        """Token chunks sized by :func:`distillation_chunk_bytes` against the budget. The logits op
        makes its gradient in backward from the given logits; the linear op makes the student's
        gradients in forward for mean/sum with one microbatch in flight (4 matmuls: both lm_heads'
        logits, dh, dW), else recomputes both models' logits chunk by chunk in backward (6)."""
        if chunks == "auto":
            per_token = distillation_chunk_bytes(1, vocab_size, tp_degree, shape=shape)
            k = self._chunks_of_rows(num_tokens, per_token)
            why = [_distill_reason(self, num_tokens, vocab_size, tp_degree, shape, k)]
        else:
            k = _token_chunks(chunks, num_tokens)
            why = [f"chunks={chunks} as given"]
        k = _token_chunks(k, num_tokens)
        if shape.hidden_sizes is None:
            why.append("the student's gradient is made in backward from the given logits")
            return Plan("token", k, GradMode.RECOMPUTE, tuple(why))
        if reduction == "none":
            why.append("reduction='none': the upstream gradient is known only in backward, so both models' logits "
                       "are recomputed there")
            mode = GradMode.RECOMPUTE
        elif self.microbatches_in_flight > 1:
            why.append(f"{self.microbatches_in_flight} microbatches in flight would each hold dW from forward to "
                       "backward, so recompute")
            mode = GradMode.RECOMPUTE
        else:
            why.append("the student's gradients made in forward for an upstream gradient of 1 (4 matmuls), scaled "
                       "in backward")
            mode = GradMode.IN_FORWARD
        return self._weight_grad(Plan("token", k, mode, tuple(why)), num_tokens, vocab_size, tp_degree, shape)

    @staticmethod
    def _weight_grad(plan: Plan, num_tokens: int, vocab_size: int, tp_degree: int, shape: "DistillShape") -> Plan:
        """``plan`` with its :class:`WeightGrad`: with several chunks, one ``dW`` GEMM over the kept
        logits' gradients where their ``[N, V_loc]`` buffer is no larger than the fp32 sum it
        replaces (``N * grad_bytes <= 4 * H_s``): the same memory, without the sum's read and write
        per chunk (docs/policy.md has the benchmark)."""
        v, h_s = local_vocab(vocab_size, tp_degree), shape.hidden_sizes[0]
        kept, summed = num_tokens * v * shape.grad_bytes, 4 * v * h_s
        if plan.chunks > 1 and shape.grad_bytes and kept <= summed:
            why = (f"dW by one GEMM at the end over every chunk's logits' gradient, kept in a {kept / GiB:.2f} GiB "
                   f"[N, V_loc] buffer in place of its {summed / GiB:.2f} GiB fp32 sum over the chunks (which each "
                   "chunk would read and write once more)")
            return replace(plan, why=plan.why + (why,), weight_grad=WeightGrad.ONE_GEMM)
        if plan.chunks > 1:
            return replace(plan, why=plan.why + ("dW summed over the chunks in fp32",))
        return plan

    def _fit_memory(self, num_tokens: int, vocab_size: int, tp_degree: int, hidden_size: int,
                    logits_dtype: torch.dtype | None):
        """``(schedule, count, reason)`` for :attr:`memory_bytes`: one token chunk (3 matmuls) if
        its modelled peak fits, else the widest vocab blocks (128-column multiples, at most
        ``block_columns``) whose peak does, by :func:`peak_bytes`. A vocab plan's modelled peak stops
        falling once its blocks are ``H`` wide, so when no width fits the blocks are ``H`` wide (the
        floor, with the fewest blocks)."""
        target, n, v_loc = int(self.memory_bytes), num_tokens, local_vocab(vocab_size, tp_degree)

        def peak(schedule, k):
            return peak_bytes(Plan(schedule, k, GradMode.RECOMPUTE), n, vocab_size, tp_degree, hidden_size=hidden_size,
                              logits_dtype=logits_dtype)

        one = peak("token", 1)
        head = f"one token chunk would peak at {one / GiB:.2f} GiB"
        if one <= target or v_loc <= 128:
            fits = "within" if one <= target else "over"
            return "token", 1, f"{head}, {fits} the {target / GiB:.2f} GiB memory target (3 matmuls)"
        # The modelled vocab peak falls as the blocks narrow, until they are H wide (from there dh,
        # not a block's dx, is the largest buffer): search the model itself, from blocks
        # block_columns wide (fewest) to H wide (most), for the fewest whose peak fits.
        fewest = math.ceil(v_loc / (-(-self.block_columns // 128) * 128))
        most = max(fewest, math.ceil(v_loc / max(128, hidden_size // 128 * 128)))
        if peak("vocab", fewest) <= target:
            most = fewest
        lo = fewest  # invariant: peak(lo) > target or lo == most; peak(most) fits or nothing does
        while most - lo > 1:
            mid = (lo + most) // 2
            lo, most = (lo, mid) if peak("vocab", mid) <= target else (mid, most)
        blocks = vocab_blocks(v_loc, most)
        k, width = len(blocks), max(b.stop - b.start for b in blocks)
        got = peak("vocab", k)
        if got > target:
            return "vocab", k, (f"{head}, over the {target / GiB:.2f} GiB memory target, and no plan fits: {k} "
                                f"vocab blocks of ~{width} columns reach the floor, {got / GiB:.2f} GiB (dW, an fp32 "
                                "dh and dh)")
        return "vocab", k, (f"{head}, over the {target / GiB:.2f} GiB memory target; {k} vocab blocks, the fewest "
                            f"that fit, peak at {got / GiB:.2f} GiB")


def _token_chunks(k: int, num_tokens: int) -> int:
    return max(1, min(int(k), max(num_tokens, 1)))


def _budget_reason(policy: ChunkPolicy, num_tokens: int, v_loc: int, k: int) -> str:
    full = num_tokens * v_loc * 4
    text = (f"{num_tokens} tokens x V_loc={v_loc} make {full / GiB:.2f} GiB of fp32 logits against a "
            f"{'default ' if policy.budget_bytes is None else ''}budget of {policy.budget / GiB:.2f} GiB: ")
    if k == 1:
        return text + "they fit in one chunk"
    per = math.ceil(num_tokens / k)
    text += f"{k} chunks of <= {per} tokens ({per * v_loc * 4 / GiB:.2f} GiB each)"
    if policy.budget_bytes is None and k == math.ceil(num_tokens / policy.min_chunk_tokens):
        text += f", capped so no chunk is smaller than {policy.min_chunk_tokens} tokens"
    return text


def _distill_reason(policy: ChunkPolicy, num_tokens: int, vocab_size: int, tp_degree: int, shape: DistillShape,
                    k: int) -> str:
    whole = distillation_chunk_bytes(num_tokens, vocab_size, tp_degree, shape=shape)
    parts = ("the logits' gradient" if shape.row_kernels else "fp32 temporaries") + (
        ", both models' logits and hidden rows" if shape.hidden_sizes else "")
    text = (f"{num_tokens} tokens make a {whole / GiB:.2f} GiB distillation working set "
            f"(distillation_chunk_bytes: {shape.divergence}'s {parts}) against a "
            f"{'default ' if policy.budget_bytes is None else ''}budget of {policy.budget / GiB:.2f} GiB: ")
    if k == 1:
        return text + "it fits in one chunk"
    per = math.ceil(num_tokens / k)
    text += (f"{k} chunks of <= {per} tokens "
             f"({distillation_chunk_bytes(per, vocab_size, tp_degree, shape=shape) / GiB:.2f} GiB each)")
    if policy.budget_bytes is None and k == math.ceil(num_tokens / policy.min_chunk_tokens):
        text += f", capped so no chunk is smaller than {policy.min_chunk_tokens} tokens"
    return text


# Ignored-token compaction (ChunkPolicy.kept_rows, reads_valid_count; docs/policy.md): rows kept
# in groups of 8 (the GEMMs' K of dW stays a multiple of 8), only where at least 1/32 of the rows
# go, and at world 1 only for calls whose one GEMM is at least 2^40 multiply-adds (the host read).
COMPACT_ROW_ALIGN = 8
COMPACT_MIN_DROP = 32
COMPACT_READ_MIN_WORK = 1 << 40

# Default bound on one chunk's fp32 logits. See docs/policy.md for the sweep behind it.
DEFAULT_BUDGET_BYTES = 1 * GiB
_PLANS: dict = {}  # ChunkPolicy.plan's memo


def _count(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 1


def _bytes(value) -> bool:
    return value is None or (isinstance(value, numbers.Real) and not isinstance(value, bool)
                             and math.isfinite(value) and value >= 0)


# field -> (predicate, what it must be)
_FIELD_RULES = {
    "budget_bytes": (_bytes, "a number of bytes >= 0 or None"),
    "min_chunk_tokens": (_count, "an int >= 1"),
    "block_columns": (_count, "an int >= 1"),
    "microbatches_in_flight": (_count, "an int >= 1"),
    "memory_bytes": (_bytes, "a number of bytes >= 0 or None"),
    "compact": (lambda value: value is None or isinstance(value, bool), "True, False or None"),
}

