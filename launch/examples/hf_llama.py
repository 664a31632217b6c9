"""Hugging Face, minimal: a tiny random Llama whose loss runs through vparallel_ce.

    python launch/examples/hf_llama.py

``vparallel_ce.integrations.transformers.apply(model)`` makes ``model(input_ids, labels=labels)``
compute the causal-LM loss with ``linear_cross_entropy`` from the final hidden states and the
lm_head weight: no logits. The example checks the loss and every parameter's gradient against
the same model without it (HF's own loss), with tied embeddings, padding labels and HF's
``num_items_in_batch``. Needs ``pip install "vparallel_ce[transformers]"``; nothing is downloaded.
"""

import copy

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from vparallel_ce.integrations import transformers as vparallel_hf


def main() -> None:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    reference = LlamaForCausalLM(config)
    model = vparallel_hf.apply(copy.deepcopy(reference), chunks="auto")

    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, config.vocab_size, (4, 16), generator=g)
    labels = input_ids.clone()
    labels[:, :5] = -100                                  # a prompt: no loss there
    n = int((labels[:, 1:] != -100).sum())                # what HF's Trainer passes under accumulation

    out = model(input_ids, labels=labels, num_items_in_batch=n)
    assert out.logits is None                             # the logits were never made
    out.loss.backward()
    ref = reference(input_ids, labels=labels, num_items_in_batch=n)
    ref.loss.backward()
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)

    with torch.no_grad():                                 # no labels: HF's own forward, logits and all
        assert torch.equal(model(input_ids).logits, reference(input_ids).logits)
    print(f"loss {out.loss.item():.6f} (HF {ref.loss.item():.6f}), every gradient matches")
    print("OK")


if __name__ == "__main__":
    main()
