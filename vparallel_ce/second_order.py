"""Second derivatives: refused with an error, never a wrong number.

Every op's backward is a hand-written first derivative (the softmax statistics are joined over the
group; nothing in it is recorded for autograd). ``torch.autograd.grad(..., create_graph=True)``
followed by a second differentiation (a Hessian-vector product, a gradient penalty) would otherwise
differentiate that backward as if it were a constant and give a silently wrong result.

:func:`first_order_only` wraps a ``backward``: it runs under ``no_grad`` and, only when autograd is
building a graph of the gradients (``create_graph=True``), hands them out through a node whose own
backward raises. First derivatives, with or without ``create_graph``, are unchanged; anything that
differentiates through them raises :class:`SecondDerivativeError` naming the op -- or the
backward itself raises it under ``create_graph=True`` where the op kept no input to tie that node
to (gradients made in forward).
"""

from __future__ import annotations

import functools

import torch

__all__ = ["SecondDerivativeError", "first_order_only"]


class SecondDerivativeError(RuntimeError):
    """A second derivative was asked of an op that has only a first one."""


class _Refuse(torch.autograd.Function):
    """Identity on the gradients in forward (``anchors`` only tie the node into the graph); in
    backward, the error."""

    @staticmethod
    def forward(ctx, op: str, n_anchors: int, *anchors_and_grads):
        ctx.op = op
        return tuple(g.view_as(g) for g in anchors_and_grads[n_anchors:])

    @staticmethod
    def backward(ctx, *_):
        raise _refusal(ctx.op)


def _refusal(op: str) -> SecondDerivativeError:
    return SecondDerivativeError(
        f"vparallel_ce.{op} has no second derivative: its backward is a hand-written first derivative, so "
        "differentiating a gradient made with create_graph=True through it (a Hessian-vector product, a gradient "
        "penalty) is not supported"
    )


def first_order_only(op: str):
    """Decorator for an autograd Function's ``backward``: the gradients of op ``op``, refusing to
    be differentiated again (see the module docstring)."""

    def wrap(backward):
        @functools.wraps(backward)
        def run(ctx, *grad_outputs):
            with torch.no_grad():
                grads = backward(ctx, *grad_outputs)
            if not torch.is_grad_enabled():  # the usual backward: create_graph=False
                return grads
            tensors = [g for g in grads if isinstance(g, torch.Tensor)]
            if not tensors:
                return grads
            # the op's saved inputs and the upstream gradients that require grad tie the refusing
            # node into the graph, so that a second derivative with respect to any of them reaches
            # it (the gradients are linear in the upstream ones, which the no_grad backward hides)
            inputs = [t for t in ctx.saved_tensors if t is not None and t.requires_grad]
            if not inputs:  # gradients made in forward: no input to tie the node to, so a second
                # derivative with respect to them could not reach it -- refuse now
                raise _refusal(op)
            anchors = inputs + [g for g in grad_outputs if isinstance(g, torch.Tensor) and g.requires_grad]
            refused = iter(_Refuse.apply(op, len(anchors), *anchors, *tensors))
            return tuple(next(refused) if isinstance(g, torch.Tensor) else g for g in grads)

        return run

    return wrap
