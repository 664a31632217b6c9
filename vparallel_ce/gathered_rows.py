r"""The lm_head over each token's own weight rows, in torch: the reference and CPU path of the
gather mode of ``linear_token_logprobs(..., support=ids)`` (:mod:`vparallel_ce.sampling_set`; the
Triton version, which makes none of the gathered rows: :mod:`vparallel_ce.kernels.gathered_rows`).

``cols [c, K]`` holds, per token, the local weight rows of its kept ids and ``-1`` where none; a
``-1`` entry reads and adds nothing::

    x[n, k]  = h[n] . w[cols[n, k]] (+ b[cols[n, k]])
    dh[n]    = sum_k d[n, k] w[cols[n, k]]
    dW[v]    = sum over the chunks and their (n, k) with cols[n, k] = v of d[n, k] h[n],   db[v] += sum d[n, k]

Here the rows are gathered (``[c, K, H]``) and the products summed by ``bmm`` / ``index_add_``, a
chunk at a time: ``O(c K H)`` memory, which the caller's chunks bound.
"""

from __future__ import annotations

import torch

__all__ = ["logits", "hidden_grad", "weight_grad"]


def _gathered(w: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """``w[cols]`` ``[c, K, H]``, rows of ``-1`` entries zero."""
    if w.shape[0] == 0:  # an empty shard: every entry -1
        return w.new_zeros((*cols.shape, w.shape[1]))
    return w[cols.clamp(min=0)].masked_fill_((cols < 0).unsqueeze(-1), 0)


def logits(parts, w: torch.Tensor, b: torch.Tensor | None, out_dtype: torch.dtype, *,
           by_row=None) -> list[torch.Tensor]:
    """Each chunk's ``[c, K]`` logits for the chunks ``(cols [c, K], h [c, H])`` of ``parts``, in
    ``out_dtype`` (the products summed in ``out_dtype``, or in the operands' dtype and cast), the
    bias added in it; 0 (or the bias of row 0) where ``cols = -1``. (``by_row``: unread, as in the kernels'.)"""
    wide = out_dtype if torch.finfo(out_dtype).bits > torch.finfo(w.dtype).bits else w.dtype
    out = []
    for cols, h in parts:
        x = torch.bmm(_gathered(w, cols).to(wide), h.to(wide).unsqueeze(-1)).squeeze(-1).to(out_dtype)
        out.append(x if b is None or b.shape[0] == 0 else x + b[cols.clamp(min=0)].to(out_dtype))
    return out


def hidden_grad(d: torch.Tensor, cols: torch.Tensor, w: torch.Tensor, *,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """``dh [c, H]`` in ``d``'s dtype (written into ``out``, if given, and returned)."""
    d = d.masked_fill(cols < 0, 0)
    dh = torch.bmm(d.unsqueeze(1), _gathered(w, cols).to(d.dtype)).squeeze(1)
    return dh if out is None else out.copy_(dh)


def weight_grad(parts, w: torch.Tensor, out_dtype: torch.dtype | None, base: torch.Tensor | None = None,
                db: torch.Tensor | None = None, *, by_row=None) -> torch.Tensor | None:
    """``dW`` (``w``'s shape and device) in ``out_dtype`` (None: none, ``db`` only): ``base`` (the fp32/fp64 sum so far,
    or 0) plus the chunks' ``(d [c, K], cols [c, K], h [c, H])`` products, summed chunk by chunk in
    ``base``'s dtype (else ``d``'s) and rounded once; ``db [V]`` gets ``sum d`` added. ``-1`` entries
    add an exact 0 (to row 0). ``base`` may be overwritten. (``by_row``: unread, as in the kernels'.)"""
    shape = tuple(w.shape)
    acc = base
    for d, cols, h in parts if shape[0] else ():  # (an empty shard: every entry -1)
        pad = (cols < 0).reshape(-1)
        flat = cols.clamp(min=0).reshape(-1)
        if out_dtype is not None:
            if acc is None:
                acc = torch.zeros(shape, dtype=d.dtype, device=d.device)
            prod = (d.to(acc.dtype).unsqueeze(-1) * h.to(acc.dtype).unsqueeze(1)).reshape(flat.numel(), shape[1])
            acc.index_add_(0, flat, prod.masked_fill_(pad.unsqueeze(-1), 0))
        if db is not None:
            db.index_add_(0, flat, d.reshape(-1).to(db.dtype).masked_fill(pad, 0))
    if out_dtype is None:
        return None
    if acc is None:
        return torch.zeros(shape, dtype=out_dtype, device=w.device)
    return acc.to(out_dtype)
