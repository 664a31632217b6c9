#!/usr/bin/env python
"""Write a tokenizer and a text dataset that torchtitan's llama3 data path can read offline.

    python launch/cluster/torchtitan_assets.py OUTDIR [--vocab 2048] [--docs 100] [--words 50 300]

OUTDIR/tokenizer: a word-level HF ``tokenizer.json`` (``<unk>``, BOS ``<|begin_of_text|>``, EOS
``<|end_of_text|>``, then ``vocab - 3`` words ``w0``, ``w1``, ...) with its ``tokenizer_config.json``
-> ``--model.hf_assets_path OUTDIR/tokenizer``.
OUTDIR/data/train.jsonl: ``{"text": ...}`` documents, each a walk of a seeded Markov chain in which
every word has 4 possible successors (learnable) -> ``--training.dataset c4_test
--training.dataset_path OUTDIR/data``.

Every token id is below ``--vocab``: keep it <= the model's vocab size (2048 for the debug model).
Needs the ``tokenizers`` package (a torchtitan dependency).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

BOS, EOS, UNK = "<|begin_of_text|>", "<|end_of_text|>", "<unk>"


def write_assets(out: Path, *, vocab: int = 2048, docs: int = 100, words: tuple[int, int] = (50, 300),
                 seed: int = 0) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    if vocab < 4:
        raise ValueError("--vocab must be >= 4")
    (out / "tokenizer").mkdir(parents=True, exist_ok=True)
    (out / "data").mkdir(parents=True, exist_ok=True)
    names = [f"w{i}" for i in range(vocab - 3)]
    ids = {UNK: 0, BOS: 1, EOS: 2, **{w: i + 3 for i, w in enumerate(names)}}
    tok = Tokenizer(models.WordLevel(ids, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(out / "tokenizer" / "tokenizer.json"))
    config = {"bos_token": BOS, "eos_token": EOS, "add_bos_token": True, "add_eos_token": True}
    (out / "tokenizer" / "tokenizer_config.json").write_text(json.dumps(config))
    rng = random.Random(seed)
    successors = [[rng.randrange(len(names)) for _ in range(4)] for _ in names]
    with open(out / "data" / "train.jsonl", "w") as f:
        for _ in range(docs):
            w, text = rng.randrange(len(names)), []
            for _ in range(rng.randint(*words)):
                text.append(names[w])
                w = rng.choice(successors[w])
            f.write(json.dumps({"text": " ".join(text)}) + "\n")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--docs", type=int, default=100)
    p.add_argument("--words", type=int, nargs=2, default=(50, 300), metavar=("MIN", "MAX"))
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    write_assets(a.out, vocab=a.vocab, docs=a.docs, words=tuple(a.words), seed=a.seed)


if __name__ == "__main__":
    main()
