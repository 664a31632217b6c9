r"""Ignored-token compaction: the linear ops' lm_head runs only over the rows whose target counts.

A token whose target is ``ignore_index`` contributes nothing -- loss 0, ``dh`` row 0, nothing to
``dW`` -- yet its lm_head row costs as much as any other in every GEMM. With ``n`` of ``N`` rows
valid, the call runs over ``m`` rows instead (``n`` rounded up to a multiple of 8 with ignored rows,
:meth:`vparallel_ce.policy.ChunkPolicy.kept_rows`):

* ``rows``: the first ``m`` entries of the stable partition of ``0..N-1`` that puts the valid rows
  first (one sort on the device; the valid rows keep their order);
* the op's inputs are ``hidden[rows]``, ``target[rows]`` (and a distillation teacher's rows): the
  plan, chunks and kernels are those of an ``m``-token call;
* its per-token outputs come back at ``rows`` of ``[N]`` zeros (the caller's order), and the
  gradient of ``hidden`` is the ``[m, H]`` one scattered into zeros: an ignored row is exactly 0,
  as uncompacted. Mean and sum are the same sums over the same valid tokens.

The GEMMs need ``m`` on the host, so the count must be there. On a group it is: every rank's
valid count rides on the call's one metadata exchange (:func:`vparallel_ce.agreement.agree`),
which already waits for the device, and every rank computes the same ``m`` of every rank from
those counts -- no collective and no host sync added. With sequence parallelism and ``check=False``
the counts ride on the token counts' all-gather. Elsewhere (world 1; a group with ``check=False``,
whose replicated targets give every rank the same count) reading it is one host sync the call
does not otherwise make, taken only where it costs little (:meth:`ChunkPolicy.reads_valid_count`).
Under ``torch.compile`` the compiled op runs uncompacted (its output shapes are fixed and its
custom ops hold no index ops around the Function).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Compaction", "compacted_rows", "compacted_head_rows"]


@dataclass(frozen=True)
class Compaction:
    """Which of this rank's ``total`` rows a compacted call runs over: ``rows`` (int64 ``[m]`` on
    the device), or None for all of them in order (this rank drops none, while another rank of a
    sequence-parallel group does)."""

    rows: torch.Tensor | None
    total: int

    def take(self, x: torch.Tensor | None) -> torch.Tensor | None:
        """``x[rows]`` of a per-token tensor ``[N, ...]`` (differentiable: its gradient is scattered
        back, 0 on the rows not taken)."""
        return x if x is None or self.rows is None else x.index_select(0, self.rows)

    def place(self, y: torch.Tensor) -> torch.Tensor:
        """A per-token output ``[m]`` of the compacted call at its rows of ``[N]`` zeros (the
        caller's order; the gradient of each row is read back from there)."""
        if self.rows is None:
            return y
        return y.new_zeros((self.total, *y.shape[1:])).index_copy(0, self.rows, y)


def compacted_rows(target: torch.Tensor, ignore_index: int, kept: int) -> torch.Tensor:
    """The first ``kept`` rows of the stable partition of ``target``'s rows that puts the valid ones
    (not ``ignore_index``) first: every valid row, in order, then ignored ones (int64, on the
    target's device; no host sync)."""
    order = torch.argsort((target == ignore_index).to(torch.uint8), stable=True)
    return order[:kept]


def compacted_head_rows(target: torch.Tensor, ignore_index: int, heads: int, kept: int) -> torch.Tensor:
    """:func:`compacted_rows` of each of ``heads`` equal parts of ``target`` (a multi-token
    prediction's stacked heads), ``kept`` rows of each: head ``d``'s valid rows in order, then its
    ignored ones, at ``d * kept ..``, so the heads keep equal parts (int64, on the device)."""
    per_head = target.numel() // heads
    ignored = (target.reshape(heads, per_head) == ignore_index).to(torch.uint8)
    order = torch.argsort(ignored, dim=1, stable=True)[:, :kept]
    return (order + torch.arange(heads, device=target.device)[:, None] * per_head).reshape(-1)


def valid_count(target: torch.Tensor, ignore_index: int) -> int:
    """The valid targets' count, read on the host (a sync: the caller decided it may)."""
    return int((target != ignore_index).sum())
