"""The offline assets TorchTitan's debug model reads, made at test time (its wheel ships neither):

- a tokenizer directory for ``--hf-assets-path``: a word-level ``tokenizer.json`` over a fixed
  vocabulary (far below the debug model's 2048 embeddings) and a ``tokenizer_config.json`` naming its
  BOS and EOS tokens;
- a text dataset for ``--dataloader.dataset c4_test --dataloader.dataset-path DIR``: a JSON-lines
  file of ``{"text": ...}`` records, as TorchTitan's ``c4_test`` loader (``load_dataset(DIR,
  split="train")``) reads the sample in its repository.

Both are the same for the same seed, so two runs see the same tokens. Run with the TorchTitan
virtualenv's Python (it needs ``tokenizers``): ``python -m tests.torchtitan.assets OUT_DIR``.
"""

import argparse
import json
import os
import random

BOS, EOS, UNK = "<|begin_of_text|>", "<|end_of_text|>", "<unk>"
WORDS = 400  # vocabulary size besides the special tokens
DOCUMENTS = 2000  # records in the dataset: more than a test trains through with the harness's batch
SEED = 23


def _words(count: int) -> list[str]:
    """``count`` distinct lowercase pseudo-words, the same on every call."""
    rng = random.Random(SEED)
    words: set[str] = set()
    while len(words) < count:
        words.add("".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 7))))
    return sorted(words)


def write_tokenizer(directory: str) -> int:
    """Writes ``tokenizer.json`` and ``tokenizer_config.json`` into ``directory``; returns the vocabulary size."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {token: i for i, token in enumerate([UNK, BOS, EOS, *_words(WORDS)])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens([BOS, EOS])
    os.makedirs(directory, exist_ok=True)
    tokenizer.save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump({"bos_token": BOS, "eos_token": EOS, "add_bos_token": True, "add_eos_token": True}, f)
    return len(vocab)


def write_dataset(directory: str) -> None:
    """Writes ``train.jsonl``: ``DOCUMENTS`` records of 20-120 words drawn with a fixed seed."""
    rng, words = random.Random(SEED + 1), _words(WORDS)
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "train.jsonl"), "w", encoding="utf-8") as f:
        f.writelines(
            json.dumps({"text": " ".join(rng.choice(words) for _ in range(rng.randint(20, 120)))}) + "\n"
            for _ in range(DOCUMENTS)
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", help="Directory to create 'tokenizer/' and 'dataset/' in.")
    args = parser.parse_args()
    size = write_tokenizer(os.path.join(args.out, "tokenizer"))
    write_dataset(os.path.join(args.out, "dataset"))
    print(f"tokenizer ({size} tokens) and dataset ({DOCUMENTS} records) in {args.out}")


if __name__ == "__main__":
    main()
