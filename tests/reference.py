"""Float64 references the tests compare against: the loss on the GATHERED logits, by PyTorch."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def shard(full: torch.Tensor, world: int, rank: int, dim: int = -1) -> torch.Tensor:
    """Rank ``rank``'s piece in the torch.chunk layout (empty for trailing ranks when too few)."""
    pieces = torch.chunk(full, world, dim=dim)
    if rank < len(pieces):
        return pieces[rank]
    shape = list(full.shape)
    shape[dim] = 0
    return full.new_empty(shape)


def reference_loss(logits: torch.Tensor, target: torch.Tensor, *, ignore_index=-100, reduction="mean",
                   label_smoothing=0.0, z_loss=0.0, softcap=None) -> torch.Tensor:
    """``F.cross_entropy`` on soft-capped float64 logits, plus the z-loss (differentiable)."""
    z = logits.double()
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    z2 = z.reshape(-1, z.shape[-1])
    t = target.reshape(-1)
    per = F.cross_entropy(z2, t, ignore_index=ignore_index, reduction="none", label_smoothing=label_smoothing)
    valid = t != ignore_index
    if z_loss:
        per = per + z_loss * torch.logsumexp(z2, -1).square() * valid
    if reduction == "none":
        return per.reshape(target.shape)
    return per.sum() / valid.sum() if reduction == "mean" else per.sum()


def reference_distillation(s, t, target, *, kind, beta=0.5, temperature=1.0, hard_weight=0.0, ignore_index=-100,
                           reduction="mean", dtype=torch.float64):
    """The distillation loss on full (gathered) student ``s`` and teacher ``t`` logits, its
    divergences written out with torch.log_softmax (differentiable), in float64; or in ``dtype``
    (bf16: what a plain bf16 model computes)."""
    s2, t2 = s.to(dtype).reshape(-1, s.shape[-1]), t.to(dtype).reshape(-1, t.shape[-1])
    lp, lq = F.log_softmax(t2 / temperature, -1), F.log_softmax(s2 / temperature, -1)
    p, q = lp.exp(), lq.exp()
    if kind == "forward_kl":
        d = (p * (lp - lq)).sum(-1)
    elif kind == "reverse_kl":
        d = (q * (lq - lp)).sum(-1)
    else:
        lm = torch.log(beta * p + (1 - beta) * q)
        d = beta * (p * (lp - lm)).sum(-1) + (1 - beta) * (q * (lq - lm)).sum(-1)
    return token_reference(d, s2, target, temperature=temperature, hard_weight=hard_weight,
                           ignore_index=ignore_index, reduction=reduction).reshape(
        s.shape[:-1] if reduction == "none" else ())


def token_reference(d, s2, target, *, temperature, hard_weight, ignore_index, reduction):
    """The distillation loss from the per-token divergence ``d`` (``[N]``): ``T**2 d`` plus the hard
    term on the ``[N, V]`` student logits ``s2``, 0 on ignored tokens, reduced (``"none"``: ``[N]``)."""
    per = d * temperature ** 2
    if target is None:
        valid = torch.ones_like(per, dtype=torch.bool)
    else:
        valid = target.reshape(-1) != ignore_index
        if hard_weight:
            per = per + hard_weight * F.cross_entropy(s2, target.reshape(-1), ignore_index=ignore_index,
                                                      reduction="none")
    per = torch.where(valid, per, torch.zeros_like(per))
    if reduction == "none":
        return per
    return per.sum() / valid.sum() if reduction == "mean" else per.sum()


def rel_err(a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor | None = None) -> float:
    """max |a - b| / max |b| (0 when both are zero). ``scale``: divide by max |scale| instead --
    the full (gathered) reference, so a small shard is judged on the scale of the whole gradient."""
    assert a.shape == b.shape, (a.shape, b.shape)
    if b.numel() == 0:
        return 0.0
    a, b = a.double(), b.double()
    scale = (b if scale is None else scale).double().abs().max().item()
    diff = (a - b).abs().max().item()
    return diff / scale if scale > 0 else diff


# tolerance on loss and gradients, relative to the largest reference value
TOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 2e-2}


def local_grad(leaf) -> torch.Tensor:
    """This rank's piece of a leaf DTensor's ``.grad``, laid out like the leaf. torch 2.11 hands a
    leaf DTensor its gradient as ``Replicate`` even when it arrives ``Shard``-ed through
    ``to_local()`` (2.13 keeps the leaf's placements; seen on the H200 image), so compare in the
    leaf's own layout."""
    g = leaf.grad
    if tuple(g.placements) != tuple(leaf.placements):
        g = g.redistribute(leaf.device_mesh, leaf.placements)
    return g.to_local()


def largest_tensor(fn) -> int:
    """The most elements of any tensor an op made while ``fn()`` ran (a dispatch-mode watch): what
    the memory tests bound by a chunk of logits."""
    from torch.utils._python_dispatch import TorchDispatchMode

    largest = 0

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            nonlocal largest
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    largest = max(largest, t.numel())
            return out

    with Watch():
        fn()
    return largest
