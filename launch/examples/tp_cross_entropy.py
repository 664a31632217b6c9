"""Tensor parallelism with vparallel_ce, minimal: TP=2 on CPU (gloo), checked against F.cross_entropy.

    python launch/examples/tp_cross_entropy.py                        # starts its 2 processes itself
    torchrun --nproc_per_node 2 launch/examples/tp_cross_entropy.py   # or under torchrun

Every rank holds the same hidden states and targets, and its ``torch.chunk`` shard of the lm_head
weight (a slice of the vocab rows). ``linear_cross_entropy`` takes the hidden states and that shard
(the logits are never formed); ``cross_entropy`` takes this rank's shard of the logits. Both give the
loss over the whole vocabulary; ``hidden.grad`` is the full gradient, the weight's and the logits'
gradients are this rank's slices of the full ones.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F

import vparallel_ce

from _spawn import run_ranks  # this folder's rank starter (the script's folder is on sys.path)

N, H, V = 64, 32, 1001  # tokens, hidden size, vocab (uneven over 2 ranks: 501 + 500 rows)


def worker() -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(0)  # the same full tensors on every rank
    hidden, weight = torch.randn(N, H, generator=g), torch.randn(V, H, generator=g) / H**0.5
    target = torch.randint(V, (N,), generator=g)
    shard = weight.chunk(world)[rank]  # this rank's vocab rows

    h, w = hidden.clone().requires_grad_(), shard.clone().requires_grad_()
    loss = vparallel_ce.linear_cross_entropy(h, w, target, group=dist.group.WORLD)
    loss.backward()
    logits = (hidden @ shard.T).requires_grad_()  # this rank's [N, V/world] shard of the logits
    loss_ce = vparallel_ce.cross_entropy(logits, target, group=dist.group.WORLD)
    loss_ce.backward()

    # the single-process reference: the full logits
    ref_h, ref_w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ref_logits = ref_h @ ref_w.T
    ref_logits.retain_grad()
    ref = F.cross_entropy(ref_logits, target)
    ref.backward()
    for got, want in ((loss, ref), (loss_ce, ref), (h.grad, ref_h.grad), (w.grad, ref_w.grad.chunk(world)[rank]),
                      (logits.grad, ref_logits.grad.chunk(world, dim=-1)[rank])):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    if rank == 0:
        print(f"TP={world}: linear_cross_entropy {loss.item():.6f}, cross_entropy {loss_ce.item():.6f}, "
              f"F.cross_entropy on the full logits {ref.item():.6f}; gradients match: OK", flush=True)


if __name__ == "__main__":
    run_ranks(worker)
