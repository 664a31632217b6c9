"""A GRPO-style update that replays the rollout's sampling set: the engine sampled with top-p and
returned, per position, the ids it kept (vLLM / SGLang can), so the trainer's log-probs are over the
same set and the importance ratio pi_new / pi_old is 1 where the weights have not moved -- where the
full-vocabulary log-probs give the kept mass instead.

    python launch/examples/rollout_support.py

Two gloo ranks (tensor parallelism over the lm_head's vocab, started here; torchrun works too).
"""

import torch
import torch.distributed as dist

import vparallel_ce
from _spawn import run_ranks  # this folder's rank starter (the script's folder is on sys.path)

N, H, V = 64, 32, 1000  # tokens, hidden size, vocab
TEMPERATURE, TOP_P, K_MAX, CLIP = 0.8, 0.9, 64, 0.2


def engine_rollout(hidden, weight):
    """What the inference engine does (one process, full logits): top-p sampling at TEMPERATURE,
    returning the sampled tokens, their log-probs over the kept set, and the kept ids padded to
    K_MAX with -1 (an engine caps the set it sends)."""
    g = torch.Generator().manual_seed(1)
    z = (hidden @ weight.T).float() / TEMPERATURE
    order = z.sort(dim=-1, descending=True)
    mass = torch.softmax(order.values, -1)
    keep = (mass.cumsum(-1) - mass < TOP_P) & (torch.arange(V) < K_MAX)  # nucleus, capped at K_MAX ids
    ids = torch.where(keep, order.indices, -1)[:, :K_MAX]
    kept_z = torch.where(keep, order.values, float("-inf"))
    pick = torch.multinomial(torch.softmax(kept_z, -1), 1, generator=g).squeeze(-1)
    tokens = order.indices.gather(1, pick[:, None]).squeeze(-1)
    old_logp = torch.log_softmax(kept_z, -1).gather(1, pick[:, None]).squeeze(-1)
    return tokens, old_logp, ids


def worker() -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(N, H, generator=g)
    weight_full = torch.randn(V, H, generator=g) / H**0.5 * 4
    tokens, old_logp, support = engine_rollout(hidden, weight_full)
    advantages = torch.randn(N, generator=g)

    weight = torch.chunk(weight_full, world)[rank].clone().requires_grad_()  # this rank's lm_head shard
    h = hidden.clone().requires_grad_()
    logp = vparallel_ce.linear_token_logprobs(h, weight, tokens, group=dist.group.WORLD, temperature=TEMPERATURE,
                                              support=support)
    ratio = torch.exp(logp - old_logp)
    loss = -torch.min(ratio * advantages, ratio.clamp(1 - CLIP, 1 + CLIP) * advantages).mean()
    loss.backward()

    full = vparallel_ce.linear_token_logprobs(hidden, weight.detach(), tokens, group=dist.group.WORLD,
                                              temperature=TEMPERATURE)
    torch.testing.assert_close(ratio, torch.ones_like(ratio), rtol=0, atol=1e-5)
    assert torch.isfinite(h.grad).all() and torch.isfinite(weight.grad).all()
    if rank == 0:
        print(f"ratio over the kept set: mean {ratio.mean().item():.6f}; over the whole vocabulary: mean "
              f"{torch.exp(full - old_logp).mean().item():.4f} (the kept mass); loss {loss.item():.6f}: OK")


if __name__ == "__main__":
    run_ranks(worker)
