"""A real way to make training non-finite: a model whose embedding rows of some tokens are NaN.

No mock and no hook in the trainer: a sample that contains a poisoned token makes its forward,
its loss and every gradient NaN, exactly as a bad batch does in the wild, and samples without it
train normally. ``text`` records longer than ``max_seq_len`` are cut to exactly ``max_seq_len``
tokens, so with ``batch_tokens == max_seq_len`` each optimizer step trains one record, and
``seed_with_order`` finds the seed whose schedule (the trainer's own ``BatchSchedule``) trains the
records in the wanted clean/poisoned order.
"""

from __future__ import annotations

import shutil
from pathlib import Path

CLEAN_TEXT = "the cat sat on the mat and the dog ran in the park " * 8
POISON_TEXT = "~ ^ ~ ^ " + CLEAN_TEXT
"""Starts with characters the clean text never uses: their tokens are the poisoned ones."""


def poison_model(src: Path, dst: Path) -> list[int]:
    """Copy the model at ``src`` to ``dst`` with NaN embeddings for the tokens only POISON_TEXT has."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    shutil.copytree(src, dst)
    tokenizer = AutoTokenizer.from_pretrained(src)
    clean = set(tokenizer(CLEAN_TEXT)["input_ids"])
    bad = sorted(set(tokenizer(POISON_TEXT)["input_ids"]) - clean)
    assert bad, "the poison text has no token of its own"
    weights = load_file(dst / "model.safetensors")
    [name] = [k for k in weights if k.endswith("embed_tokens.weight")]
    weights[name][torch.tensor(bad)] = float("nan")
    save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    return bad


def records(pattern: str) -> list[dict[str, str]]:
    """``text`` records, one per letter of ``pattern``: ``c`` clean, ``p`` poisoned."""
    return [{"text": POISON_TEXT if ch == "p" else CLEAN_TEXT} for ch in pattern]


def seed_with_order(pattern: str, wanted: str, max_seq_len: int) -> int:
    """A seed whose first epoch trains the records of ``pattern`` in the order ``wanted`` begins with."""
    from trainer.data.packing import BatchSchedule

    for seed in range(10_000):
        schedule = BatchSchedule([max_seq_len] * len(pattern), max_seq_len, seed, 1, max_steps=len(pattern))
        order = "".join(pattern[batch[0]] for batch in schedule.epoch_batches(0))
        if order.startswith(wanted):
            return seed
    raise AssertionError(f"no seed trains {pattern!r} as {wanted!r}...")
