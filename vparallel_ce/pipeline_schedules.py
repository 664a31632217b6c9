"""Facts about a ``torch.distributed.pipelining`` schedule that the pipeline loss needs: how many
loss forwards are alive at once on the last stage (:func:`microbatches_in_flight`, which sizes the
chunk policy's memory) and which PP rank holds the last stage (:func:`last_stage_rank`), read from
the public schedule classes and their public action table.
"""

from __future__ import annotations

import functools

__all__ = ["microbatches_in_flight", "last_stage_rank"]


@functools.cache
def _schedule_kinds() -> dict[str, tuple[type, ...]]:
    """The public ``torch.distributed.pipelining`` schedule classes the rules below are about.
    Imported on first use: importing vparallel_ce does not import the pipelining package."""
    from torch.distributed.pipelining import (
        Schedule1F1B, ScheduleDualPipeV, ScheduleGPipe, ScheduleLoopedBFS, ScheduleZBVZeroBubble,
    )

    return {
        "all_at_once": (ScheduleGPipe, ScheduleLoopedBFS),  # every forward before any backward
        "one_at_a_time": (Schedule1F1B,),  # the last stage alternates forward and backward
        "v_shaped": (ScheduleZBVZeroBubble, ScheduleDualPipeV),  # the last stage sits on PP rank 0
    }


def _is(schedule_or_class, kind: str) -> bool:
    cls = schedule_or_class if isinstance(schedule_or_class, type) else type(schedule_or_class)
    return issubclass(cls, _schedule_kinds()[kind])


def _n_microbatches(schedule) -> int:
    """The microbatch count a schedule instance was built with.

    This is the one private attribute this module reads: torch 2.11-2.13 keep the count only in
    ``_PipelineSchedule._n_microbatches`` (no public accessor), and :func:`microbatches_in_flight`
    needs it for a schedule whose public action table does not settle the answer.
    """
    n = getattr(schedule, "_n_microbatches", None)
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(
            f"cannot read the microbatch count of {type(schedule).__name__}: this torch's schedule has no "
            f"private _n_microbatches (or it is not a positive int: {n!r}); pass n_microbatches="
        )
    return n


def _action_table(schedule) -> dict[int, list[tuple[int, str]]] | None:
    """``schedule.pipeline_order`` -- the public table of the actions each PP rank runs, in order --
    as ``{rank: [(stage index, kind), ...]}`` with overlapped actions flattened; kinds as torch
    spells them: "F" forward, "I" input backward, "B" full backward, "W" weight backward, ...

    The entries are torch's own action tuples: only their ``stage_index``, ``computation_type`` and
    ``sub_actions`` fields are read, here. None when there is no table (a single-stage schedule
    may have none) or its entries lack those fields; the callers then fall back to the class rules.
    """
    order = getattr(schedule, "pipeline_order", None)
    if not isinstance(order, dict) or not order:
        return None
    try:
        return {rank: [(a.stage_index, _kind(a)) for a in _flatten(actions)] for rank, actions in order.items()}
    except AttributeError:
        return None


def _kind(action) -> str:
    kind = action.computation_type
    return str(getattr(kind, "value", kind))  # a str Enum in torch 2.11-2.13


def _flatten(actions):
    for a in actions:
        if a is None:  # an idle step
            continue
        subs = getattr(a, "sub_actions", None)
        if subs:
            yield from _flatten(subs)
        else:
            yield a


def _last_stage(table) -> int | None:
    stages = [stage for actions in table.values() for stage, _ in actions if stage is not None]
    return max(stages) if stages else None


def microbatches_in_flight(schedule_or_class, n_microbatches: int | None = None) -> int:
    """How many microbatches' loss forwards are alive at once on the last stage (forward done,
    input-backward not yet run): the ``microbatches_in_flight`` of
    :class:`vparallel_ce.policy.ChunkPolicy` / :meth:`PipelineLoss.linear`.

    * a schedule INSTANCE with an action table (``pipeline_order``: the multi-stage schedules --
      Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble, DualPipeV -- and the
      single-stage GPipe and 1F1B): counted exactly from the table, for the last stage, and capped
      at ``n_microbatches`` when that is given;
    * otherwise, by class: ``ScheduleGPipe`` / ``ScheduleLoopedBFS`` (and subclasses):
      ``n_microbatches`` (every forward runs before any backward); ``Schedule1F1B``: 1 (the last
      stage alternates forward and backward); any other class: ``n_microbatches`` (the safe bound:
      it only makes the policy prefer recompute-in-backward).

    ``n_microbatches`` is required for a class; for an instance it defaults to the count the
    schedule was built with.
    """
    is_class = isinstance(schedule_or_class, type)
    if n_microbatches is None and is_class:
        raise ValueError("microbatches_in_flight: pass n_microbatches for a schedule class")
    if not is_class:
        table = _action_table(schedule_or_class)
        counted = None if table is None else _in_flight_from_table(table)
        if counted:
            return counted if n_microbatches is None else max(1, min(counted, int(n_microbatches)))
    n = max(1, int(_n_microbatches(schedule_or_class) if n_microbatches is None else n_microbatches))
    if _is(schedule_or_class, "one_at_a_time"):
        return 1
    return n  # all at once, or the safe bound


def _in_flight_from_table(table) -> int | None:
    last = _last_stage(table)
    best = None
    for actions in table.values():
        alive, peak = 0, 0
        for stage, kind in actions:
            if stage != last:
                continue
            if kind == "F":
                alive += 1
                peak = max(peak, alive)
            elif kind in ("B", "I"):
                alive -= 1
        if peak:
            best = max(best or 0, peak)
    return best


def last_stage_rank(schedule_or_class, pp_size: int | None = None) -> int:
    """PP group rank of the last stage (where the loss is): ``pp_size - 1`` for looped schedules,
    0 for V-shaped ones (ZBVZeroBubble, DualPipeV). A schedule instance answers from its own
    stage-to-rank map (``stage_index_to_group_rank``) or action table when it has one."""
    if not isinstance(schedule_or_class, type):
        mapping = getattr(schedule_or_class, "stage_index_to_group_rank", None)  # multi-stage schedules
        if isinstance(mapping, dict) and mapping:
            return int(mapping[max(mapping)])
        table = _action_table(schedule_or_class)
        last = None if table is None else _last_stage(table)
        if last is not None:
            return next(int(rank) for rank, actions in table.items() if any(s == last for s, _ in actions))
    if _is(schedule_or_class, "v_shaped"):
        return 0
    if pp_size is None:
        pp_size = getattr(schedule_or_class, "pp_group_size", None)  # multi-stage schedules
    if pp_size is None:
        cls = schedule_or_class if isinstance(schedule_or_class, type) else type(schedule_or_class)
        raise ValueError(f"last_stage_rank: pass pp_size for {cls.__name__}")
    return int(pp_size) - 1
