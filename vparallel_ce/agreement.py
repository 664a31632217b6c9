"""The cross-rank agreement: one fixed-size metadata exchange per call.

Every rank all-gathers one row of int64s: a flag for a local input problem
(:class:`~vparallel_ce.validate.Problem`, raised on EVERY rank), its vocab rows, the lowest and
highest valid target id (:mod:`vparallel_ce.target_check`) and its
:class:`~vparallel_ce.facts.Facts`, everything the ranks must agree on. Ranks that disagree raise
the same error, naming the fact and each rank's value, and never hang in a later collective.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import comm, kernels
from .checksums import target_checksum
from .facts import _FACT_FIELDS, _NO_COUNT, _NO_FACT, OPS, Facts
from .layout import VocabLayout, shard_sizes
from .options import Options
from .policy import DEFAULT_POLICY
from .target_check import DeferredTargetCheck, deferred_check
from .target_check import _check_targets, _torch_span  # the group's span is checked as the world-1 one
from .validate import InvalidInputError, Problem

__all__ = ["agree", "Agreement", "Facts", "OPS"]

# problem flag, vocab rows, vocab_size claim, lowest and highest valid target id, shard sample, valid target count
_HEAD = 7


@dataclass(frozen=True)
class Agreement:
    """The outcome of a call's exchange: the layout of this rank's vocab shard, the token count of
    every rank (known from the exchange; None without one), at world 1 the target check still
    to settle, and every rank's count of targets that are not ``ignore_index`` (from the exchange;
    None without one), which ignored-token compaction (:mod:`vparallel_ce.compaction`) reads
    without a host sync of its own."""

    layout: VocabLayout
    counts: tuple[int, ...] | None = None
    pending: DeferredTargetCheck | None = None
    valid_counts: tuple[int, ...] | None = None


def agree(
    problem: Problem | None,
    group,
    *,
    local_size: Callable[[], int],
    facts: Callable[[torch.Tensor], Facts],
    device,
    options: Options,
    vocab_size: int | None,
    target: torch.Tensor,
    shard: Callable[[], torch.Tensor] | None = None,
    shard_name: str = "logits",
) -> Agreement:
    """The one metadata exchange of a call: raise ``problem`` on every rank, check that the ranks
    agree on the call's :class:`Facts` and that the shard sizes form the torch.chunk layout.

    Args:
        problem: this rank's local input problem, or None.
        group: resolved ProcessGroup or None.
        local_size: this rank's vocab rows (called only when ``problem`` is None).
        facts: makes this rank's :class:`Facts` from its target checksum -- only for an exchange
            (at world 1 they would be host time before the first GEMM), and only when ``problem``
            is None (a rank with bad input sends zeros: the row has the same length either way).
        options: the call's options. ``check``: exchange (one all-gather of a fixed number of
            int64s) and check; needed anyway when the vocab size is unknown, skipped otherwise with
            ``check=False``, and then a problem raises locally. ``policy``: shown field by field if
            the ranks' policies differ.
        vocab_size: the global vocab size if the caller knows it (given, or a DTensor's).
        target: the target (its checksum is compared); with ``check``, every valid id (not
            ``ignore_index``) of every rank's ``target`` must lie in ``[0, V)``: checked here on a
            group; at world 1 by the returned :attr:`Agreement.pending`, which the op settles.
        shard: makes this rank's :func:`shard_checksum` of its vocab shard (the logits, or the
            lm_head weight): where the vocab size is unknown, ranks that all hold the same shard
            (the full, unsharded tensor on every rank) are refused (:func:`_check_distinct_shards`);
            ``shard_name`` names it in the message.
    """
    check, ignore_index, policy = options.check, options.ignore_index, options.policy
    world = comm.world_size(group)
    # only check=False with a known vocab size skips the exchange (a check that is not a bool is a
    # problem to report through it)
    exchange = check is not False or vocab_size is None
    if problem is not None and (world == 1 or not exchange):
        problem.raise_()
    span = check is True
    if world == 1:
        v = local_size() if vocab_size is None else vocab_size
        if v != local_size():
            raise ValueError(f"vocab_size={vocab_size} but the unsharded input has {local_size()} classes")
        return Agreement(VocabLayout.of_rank(None, 1, 0, v), None,
                         deferred_check(target, options, v, of_logits=not shard_name.endswith("weight")))
    me = comm.rank(group)
    counts = valid = None
    if exchange:
        ok = problem is None
        # a rank with bad input sends no claim: its vocab_size may be what is bad (not an int64)
        mine = [int(not ok), local_size() if ok else 0, -1 if vocab_size is None or not ok else vocab_size]
        if ok:
            lo, hi, checksum, valid = _target_facts(target, ignore_index).unbind()
            sample = shard() if shard is not None and vocab_size is None else _NO_FACT
            mine += ([lo, hi] if span else [0, 0]) + [sample, valid] + facts(checksum).row()
        else:
            mine += [0, 0, _NO_FACT, 0] + [_NO_FACT] * len(_FACT_FIELDS)
        rows = comm.all_gather_ints(mine, group, device)
        bad = [r for r, row in enumerate(rows) if row[0]]
        if bad:  # every rank sees the same rows, so every rank takes this second exchange
            messages = comm.all_gather_objects(None if ok else problem.message, group)
            if problem is not None:
                problem.raise_()
            raise InvalidInputError("invalid input on rank(s) " + "; ".join(f"{r}: {messages[r]}" for r in bad))
        _check_facts([row[_HEAD:] for row in rows], group, policy)
        _check_count(rows[0][_HEAD + _NUM_VALID])
        if shard is not None and all(row[2] < 0 for row in rows):  # no rank claims a vocab size
            _check_distinct_shards([row[1] for row in rows], [row[5] for row in rows], shard_name,
                                   highest=max(row[4] for row in rows))
        vocab_size = _check_sizes([row[1] for row in rows], [row[2] for row in rows], vocab_size, world)
        if span:
            _check_targets([row[3:5] for row in rows], vocab_size, of_logits=not shard_name.endswith("weight"))
        counts = tuple(row[_HEAD + _COUNT] for row in rows)
        valid = tuple(row[6] for row in rows)
    lay = VocabLayout.of_rank(group, world, me, vocab_size)
    if lay.local_size != local_size():
        lay = _unchecked_layout(lay, local_size(), exchange)
    return Agreement(lay, counts, None, valid)


def _unchecked_layout(lay: VocabLayout, rows: int, exchanged: bool) -> VocabLayout:
    """A rank whose shard is not its torch.chunk share of the vocab. After an exchange every rank
    has found that already (the sizes were compared); without one (``check=False`` with a known
    vocab size) this rank is the only one that knows, and an error here would leave the others
    waiting in the op's first collective until the process group's timeout. So it warns and goes
    on over its own rows (the kernels never index past them): ``check=False`` vouches for the
    layout, and the loss is then wrong."""
    message = (f"rank {lay.rank} holds {rows} vocab rows, but the torch.chunk layout of V={lay.vocab_size} over "
               f"{lay.world} ranks gives it {lay.local_size}")
    if exchanged:
        raise ValueError(message)
    warnings.warn(f"{message}: with check=False this rank cannot tell the others, so the call goes on and its loss "
                  "is wrong; fix vocab_size or the shards (check=True raises this on every rank)", stacklevel=4)
    return dataclasses.replace(lay, local_size=rows)


_COUNT = [f.name for f in _FACT_FIELDS].index("token_count")


_NUM_VALID = [f.name for f in _FACT_FIELDS].index("num_valid_tokens")


def _check_count(code: int) -> None:
    """A tensor ``num_valid_tokens`` is only read here, from the exchange (the ranks agree on it
    by now), or at world 1 from the deferred check (:class:`DeferredTargetCheck`): a negative count
    raises on every rank. (With ``check=False`` and no exchange a negative count makes the loss
    nan: :func:`vparallel_ce.call._divisor`.)"""
    if code != _NO_COUNT and code < 0:
        raise InvalidInputError(f"num_valid_tokens must be >= 0, got {code}")


_SP = [f.name for f in _FACT_FIELDS].index("sequence_parallel")


def _check_facts(rows: list[list[int]], group, policy) -> None:
    """Raise the same error on every rank at the first fact the ranks disagree on (every rank
    holds every row), naming it and each rank's value."""
    sequence_parallel = rows[0][_SP]
    for i, f in enumerate(_FACT_FIELDS):
        if f.metadata["per_rank"] and sequence_parallel:
            continue
        values = [row[i] for row in rows]
        if len(set(values)) == 1:
            continue
        if f.name == "chunk_policy":  # a CRC names nothing: every rank sends its policy itself
            shown = [repr(p) for p in comm.all_gather_objects(policy or DEFAULT_POLICY, group)]
        else:
            shown = [f.metadata["show"](v) for v in values]
        per_rank = ", ".join(f"rank {r}: {v}" for r, v in enumerate(shown))
        hint = {
            "target_checksum": "every rank must pass the same target ids in the same order",
            "teacher_ids_checksum": "every rank must pass the same TopKTeacher ids (global vocab ids, not this "
                                    "rank's shard of them)",
            "teacher_logprobs_checksum": "every rank must pass the same TopKTeacher logprobs",
            "support_checksum": "every rank must pass the same support ids (global vocab ids, -1 padding) in the "
                                "same order",
            "hidden_checksum": "hidden (and linear_distillation_loss's teacher_hidden) must be replicated over the "
                               "group (the same values on every rank); a "
                               "token-sharded hidden needs sequence_parallel=True. Inside a "
                               "torch.distributed.pipelining schedule wrap the loss in "
                               "vparallel_ce.pipeline.PipelineLoss (its first step's shape inference passes "
                               "uninitialised outputs), or pass check_replicated=False",
            "grads": "run the op with the same autograd state on every rank: its backward joins the ranks",
        }.get(f.name, "every rank of the group must pass the same tokens and options")
        raise InvalidInputError(f"ranks of the vocab-parallel group disagree on {f.name.replace('_', ' ')}: "
                                f"{per_rank} ({hint})")


def _check_sizes(sizes: list[int], claims: list[int], vocab_size: int | None, world: int) -> int:
    """The shard sizes against the claimed vocab size and the torch.chunk layout; the same error on
    every rank when they do not fit."""
    if len(set(claims)) > 1:
        raise ValueError(f"ranks of the group disagree on vocab_size: {[None if c < 0 else c for c in claims]}")
    total = sum(sizes)
    if vocab_size is not None and total != vocab_size:
        raise ValueError(
            f"shard sizes {sizes} add up to {total}, but vocab_size is {vocab_size}: "
            "each rank must pass its torch.chunk slice of the vocab"
        )
    expected = shard_sizes(total, world)
    if sizes != expected:
        raise ValueError(
            f"vocab shard sizes over the group are {sizes}; the torch.chunk layout of V={total} "
            f"over {world} ranks is {expected} (rank r must hold torch.chunk(full, {world}, -1)[r])"
        )
    return total


def _target_facts(target: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """``[lo, hi, checksum, valid]`` (int64, on the target's device): every valid id of ``target``
    lies in ``[lo, hi]``, both inside ``[0, V)`` exactly when every valid id is, and an out-of-range
    id, if any, is one of them; ``checksum`` is :func:`target_checksum`; ``valid`` counts the ids
    that are not ``ignore_index``."""
    t = target.reshape(-1)
    if t.numel() == 0:
        return torch.zeros(4, dtype=torch.int64, device=t.device)
    found = kernels.target_facts(t, ignore_index)  # one launch on a GPU
    if found is not None:
        return found
    lo, hi, ignored = _torch_span(t, ignore_index)
    return torch.stack([lo, hi, target_checksum(t.to(torch.int64)), (~ignored).sum()])


def _check_distinct_shards(sizes: list[int], samples: list[int], name: str, *, highest: int) -> None:
    """Refuse, on every rank, a group whose ranks all hold the same non-empty shard: the full
    ``[..., V]`` tensor passed on every rank, which the torch.chunk layout of ``W * V`` would
    otherwise accept -- a loss off by ``ln W``. Its targets are ids of the true vocab, all inside
    the first "shard": ``highest``, the group's highest valid id (0 where the exchange carries no
    span, ``check=False``), beyond the first shard clears the shards however alike they are. Not
    told apart: identical shards of a vocab split for real (same-seeded random shards, constant
    logits) whose targets all fall in the first shard, which the same call with ``vocab_size``
    given accepts."""
    if len(sizes) < 2 or len(set(sizes)) > 1 or not sizes[0] or len(set(samples)) > 1 or samples[0] == _NO_FACT:
        return
    if highest >= sizes[0]:
        return
    per_rank = ", ".join(f"rank {r}: {v:#x}" for r, v in enumerate(samples))
    world = len(sizes)
    raise InvalidInputError(
        f"every rank of the group holds the same {name} ({sizes[0]} vocab entries each; checksum of a sample of "
        f"each rank's {name}: {per_rank}): is the full, unsharded {name} passed on every rank? Each rank must pass "
        f"its own torch.chunk shard of the vocab (the full one on {world} ranks reads as a vocab {world} times its "
        f"size: a cross-entropy off by ln {world}){_HIDDEN_HINT if name.endswith('logits') else ''}. If the shards "
        "are really identical, pass vocab_size= (the global vocab size) to say so")


_HIDDEN_HINT = ("; or, if they are replicated hidden states [..., H] rather than logits, pass them with the lm_head "
                "weight to the linear op (linear_cross_entropy(hidden, weight, target))")
