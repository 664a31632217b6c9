"""Gradient accumulation with data parallelism, exact: DDP and FSDP2 on CPU (gloo), 2 ranks.

    python launch/examples/grad_accumulation.py                        # starts its 2 processes itself
    torchrun --nproc_per_node 2 launch/examples/grad_accumulation.py   # or under torchrun

Each rank runs 4 microbatches per optimizer step, and the microbatches hold very different numbers
of valid tokens (here 12, 1, 0, 7 on rank 0 and 3, 12, 9, 2 on rank 1). The step's loss should be
the mean over ALL its valid tokens, as one big batch would give. The usual loop (each microbatch's
own mean, divided by the number of microbatches, then the data-parallel mean of the gradients)
weights a token of a 1-token microbatch 12 times more than one of a 12-token microbatch.

The exact recipe, three lines:

1. count the step's valid tokens over the data-parallel group once, before the microbatches:
   ``n = vparallel_ce.count_valid_tokens(all_labels_of_the_step, group=dp_group)``;
2. pass it as the mean's divisor of every microbatch: ``loss(..., num_valid_tokens=n)``;
3. undo the data-parallel mean of the gradients (DDP and FSDP2 divide the summed gradients by the
   group size): multiply the loss by ``dp_group.size()`` before ``backward()`` (or give DDP a sum
   communication hook, or FSDP2 ``set_gradient_divide_factor(1.0)``, and skip the factor).
"""

import gc

import torch
import torch.distributed as dist
from torch import nn

import vparallel_ce

from _spawn import run_ranks  # this folder's rank starter (the script's folder is on sys.path)

H, V, S = 16, 50, 12  # hidden size, vocab, tokens per microbatch (one sequence)
VALID = [[12, 1, 0, 7], [3, 12, 9, 2]]  # valid tokens of each rank's microbatches
IGNORE = -100


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, H)
        self.mix = nn.Linear(H, H)
        self.head = nn.Linear(H, V, bias=False)

    def hidden(self, ids):
        return torch.tanh(self.mix(self.emb(ids)))

    def forward(self, ids, labels, num_valid_tokens=None):
        # the fused loss: hidden states and the lm_head weight, no [tokens, V] logits
        return vparallel_ce.linear_cross_entropy(self.hidden(ids), self.head.weight, labels,
                                                 num_valid_tokens=num_valid_tokens)


def microbatches(rank):
    """Rank ``rank``'s (ids, labels) per microbatch: the last tokens of each are ignored."""
    g = torch.Generator().manual_seed(100 + rank)
    out = []
    for valid in VALID[rank]:
        ids = torch.randint(V, (S,), generator=g)
        labels = torch.randint(V, (S,), generator=g)
        labels[valid:] = IGNORE
        out.append((ids, labels))
    return out


def model():
    torch.manual_seed(0)  # the same initial weights on every rank
    return TinyLM().double()


def one_big_batch():
    """The reference: every microbatch of every rank in one batch, one mean over its valid tokens."""
    m = model()
    batches = [mb for rank in range(len(VALID)) for mb in microbatches(rank)]
    ids, labels = torch.stack([b[0] for b in batches]), torch.stack([b[1] for b in batches])
    m(ids, labels).backward()
    return {name: p.grad for name, p in m.named_parameters()}


def accumulate(wrapped, local_model, mbs, group, *, exact: bool):
    """One optimizer step's backward over this rank's microbatches."""
    n = vparallel_ce.count_valid_tokens([labels for _, labels in mbs], group=group) if exact else None
    world = dist.get_world_size(group)
    for i, (ids, labels) in enumerate(mbs):
        last = i == len(mbs) - 1
        sync = wrapped.no_sync() if hasattr(wrapped, "no_sync") and not last else _nothing()
        if hasattr(wrapped, "set_requires_gradient_sync"):  # FSDP2: reduce-scatter on the last only
            wrapped.set_requires_gradient_sync(last)
        with sync:
            if exact:
                loss = wrapped(ids, labels, num_valid_tokens=n) * world
            else:  # the usual loop: each microbatch's own mean, averaged over the microbatches
                loss = wrapped(ids, labels) / len(mbs)
            loss.backward()


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def worker() -> None:
    rank, group = dist.get_rank(), dist.group.WORLD
    want = one_big_batch()
    mbs = microbatches(rank)

    def max_error(grads):
        return max(float((grads[name] - want[name]).abs().max() / want[name].abs().max()) for name in want)

    from torch.nn.parallel import DistributedDataParallel as DDP

    errors = {}
    for exact in (True, False):
        m = model()
        ddp = DDP(m)
        accumulate(ddp, m, mbs, group, exact=exact)
        errors[f"DDP, {'exact' if exact else 'usual loop'}"] = max_error(
            {name: p.grad for name, p in m.named_parameters()})

    from torch.distributed.fsdp import fully_shard

    m = model()
    fully_shard(m)
    accumulate(m, m, mbs, group, exact=True)
    # FSDP2 leaves each rank a shard of every gradient: gather them to compare
    errors["FSDP2, exact"] = max_error({name: p.grad.full_tensor() for name, p in m.named_parameters()})

    if rank == 0:
        for name, err in errors.items():
            print(f"{name:20s} max relative gradient error vs one big batch: {err:.1e}")
    assert errors["DDP, exact"] < 1e-12 and errors["FSDP2, exact"] < 1e-12, errors
    assert errors["DDP, usual loop"] > 0.1, errors  # what the recipe fixes
    # the wrapped models hold the group's last collectives: released while the interpreter is fully
    # alive, before the group goes (left to its shutdown, gloo's threads could abort the process)
    del ddp, m
    gc.collect()
    if rank == 0:
        print("OK", flush=True)


if __name__ == "__main__":
    run_ranks(worker)
