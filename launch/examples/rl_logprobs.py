"""RL log-probs with vparallel_ce, minimal: per-token log-probs and entropy of sampled tokens straight
from the hidden states and the lm_head (``linear_token_logprobs``: no [N, V] logits), with gradients.

    python launch/examples/rl_logprobs.py

One process here. Under tensor parallelism pass this rank's lm_head shard and ``group=tp_group``,
as for ``linear_cross_entropy`` (launch/examples/tp_cross_entropy.py).
"""

import torch

import vparallel_ce

N, H, V = 128, 64, 3000  # tokens, hidden size, vocab
TEMPERATURE, ENTROPY_COEF = 0.7, 0.01


def main() -> None:
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(N, H, generator=g).requires_grad_()  # the policy's final hidden states
    weight = (torch.randn(V, H, generator=g) / H**0.5).requires_grad_()  # its lm_head
    tokens = torch.randint(V, (N,), generator=g)  # the sampled tokens
    tokens[: N // 4] = -100  # the prompt: no log-prob, no gradient
    advantages = torch.randn(N, generator=g)

    logp, entropy = vparallel_ce.linear_token_logprobs(hidden, weight, tokens, temperature=TEMPERATURE,
                                                       with_entropy=True)
    loss = -(advantages * logp).mean() - ENTROPY_COEF * entropy.mean()  # a policy-gradient loss
    loss.backward()

    # the same from the full logits
    ref_h, ref_w = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    log_probs = torch.log_softmax(ref_h @ ref_w.T / TEMPERATURE, dim=-1)
    valid = tokens != -100
    ref_logp = log_probs.gather(-1, tokens.clamp(min=0)[:, None]).squeeze(-1) * valid
    ref_entropy = -(log_probs.exp() * log_probs).sum(-1) * valid
    ref = -(advantages * ref_logp).mean() - ENTROPY_COEF * ref_entropy.mean()
    ref.backward()
    for got, want in ((logp, ref_logp), (entropy, ref_entropy), (hidden.grad, ref_h.grad), (weight.grad, ref_w.grad)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    print(f"{int(valid.sum())} sampled tokens: mean log-prob {logp[valid].mean().item():.4f}, mean entropy "
          f"{entropy[valid].mean().item():.4f}, loss {loss.item():.6f} (full logits: {ref.item():.6f}); "
          "gradients match: OK")


if __name__ == "__main__":
    main()
