"""The sampling set's values check (``check=True``): on the tokens that count (``target`` not
ignored), every id in ``[-1, V)``, no id twice in a row, the target among its row's ids (unless
the row is all ``-1``, the whole vocabulary). One launch after a row sort with the kernels
(:func:`vparallel_ce.kernels.support_bad_rows`), else the torch steps here; one host read either
way. :mod:`vparallel_ce.sampling_set` calls it once the ranks agree on the set.
"""

from __future__ import annotations

import torch

from .call import Call
from .kernels import support_bad_rows
from .validate import raise_values_problem

__all__ = ["check_support_values"]


def check_support_values(support: torch.Tensor, target: torch.Tensor, call: Call) -> None:
    """The set's values on the tokens that count (``target`` not ignored): ids in ``[-1, V)``, no id
    twice in a row, the target among its row's ids (unless the row is all ``-1``). One host read;
    called once the ranks agree on the set (the exchange compared its checksums), so every rank
    raises the same error -- with sequence parallelism (each rank its own rows) after one more
    exchange of the ranks' verdicts."""
    problem = _support_problem(support, target, call.spec.ignore_index, call.layout.vocab_size, call.kernels)
    raise_values_problem(problem, call.layout.group if call.sequence_parallel else None, support.device)


def _support_problem(ids: torch.Tensor, target: torch.Tensor, ignore_index: int, vocab_size: int,
                     current=None) -> str | None:
    if ids.numel() == 0:
        return None
    first = support_bad_rows(ids, target, ignore_index, vocab_size, current) or _bad_rows(ids, target, ignore_index,
                                                                                          vocab_size)
    if first[0] is not None:
        row = ids[first[0]]
        return (f"support holds an id outside [0, {vocab_size}) (or -1 padding) on token {first[0]}: "
                f"{row[(row < -1) | (row >= vocab_size)][0].item()}")
    if first[1] is not None:
        return (f"support repeats an id within token {first[1]}'s row: {ids[first[1]].tolist()[:16]}: a set's ids "
                "must be distinct")
    if first[2] is not None:
        row = first[2]
        return (f"token {row}'s target {target[row].item()} is not in its support row {ids[row].tolist()[:16]}: a "
                "token sampled from the set is one of its ids (pass check=False to get logp = -inf for it)")
    return None


def _bad_rows(ids: torch.Tensor, target: torch.Tensor, ignore_index: int, vocab_size: int) -> list[int | None]:
    """The torch steps of :func:`vparallel_ce.kernels.support_bad_rows`: the first valid row with an
    id outside ``[-1, V)``, with an id twice, with its target missing (its row not all ``-1``)."""
    valid = target != ignore_index
    out = (~((ids >= -1) & (ids < vocab_size))).any(-1)
    ordered = ids.sort(dim=-1).values
    repeated = ((ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)).any(-1)
    missing = ~(ids < 0).all(-1) & ~(ids == target.unsqueeze(-1)).any(-1)
    bad = torch.stack([out, repeated, missing]) & valid
    if not bad.any().item():
        return [None] * 3
    return [int(r[0]) if r.numel() else None for r in (b.nonzero()[:, 0] for b in bad)]
