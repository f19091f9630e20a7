"""Preference pairs for DPO: OpenAI's records tokenized into a chosen and a rejected sequence.

A record (``data.format`` ``preference``, validated at upload by ``core.files.validate``)::

    {"input": {"messages": [...], "tools": [...]?},
     "preferred_output": [assistant message, ...], "non_preferred_output": [assistant message, ...]}

Tokenized as TRL's ``DPOTrainer`` does a conversational pair: the prompt is the input's messages
rendered with the chat template and the generation prompt; each answer is the rendering of
messages + output, and the answer's tokens start where prompt and rendering first differ (the
shorter of the two common prefixes, so both sequences share one prompt). Labels are -100 on the
prompt and the answer's tokens after it (the template's end-of-turn tokens included).

Each sequence is truncated from its end to ``min(max_seq_len, batch_tokens // 2)`` tokens, so a
pair always fits in one packed micro-batch (``trainer.data.packing.pack_batch`` packs a pair's two
sequences side by side); a pair left with no answer token on either side is dropped.

Where the run's packed attention takes shared prefixes (``trainer.data.packed_metadata``), ``pack_pairs``
lays the prompt the two sequences share once (``shared_prefix``: the tokens at the start of both
that neither trains on), then each answer continuing it, attending to it as its prefix: the same
attention, positions and log-probabilities as the two whole sequences, the prompt's forward and
backward (and the reference's forward) done once.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.config import TrainConfig
from trainer.data.dataset import IGNORE_INDEX, Sample, read_records
from trainer.data.packing import PackedBatch, SegmentRow, pack_batch
from trainer.errors import DatasetError

KEYS = ("input", "preferred_output", "non_preferred_output")


@dataclass(frozen=True)
class PreferencePair:
    """One DPO pair: the schedule's item (its length is both sequences'), packed as two sequences."""

    chosen: Sample
    rejected: Sample

    def __len__(self) -> int:
        return len(self.chosen) + len(self.rejected)

    @property
    def sequences(self) -> tuple[Sample, Sample]:
        """What ``pack_batch`` lays into the row, in this order (``trainer.objectives.dpo`` relies on it)."""
        return self.chosen, self.rejected

    @property
    def num_loss_tokens(self) -> int:
        """The pair's share of a step's loss denominator: DPO's loss is a mean over pairs."""
        return 1


def load_pairs(path: str | Path, tokenizer: Any, max_seq_len: int, batch_tokens: int) -> list[PreferencePair]:
    """Read and tokenize a preference JSONL file (see the module docstring).

    Raises:
        DatasetError: a record that is not a preference pair, a tokenizer with no chat template,
            or no pair left after truncation (each names the file, and the line where there is one).
    """
    if not getattr(tokenizer, "chat_template", None):
        raise DatasetError(f"{path}: preference records need a tokenizer with a chat template; this tokenizer has none")
    limit = min(max_seq_len, batch_tokens // 2)
    pairs = []
    for number, record in read_records(path):
        problem = _problem(record)
        if problem:
            raise DatasetError(f"{path}, line {number}: {problem}")
        pair = tokenize_pair(record, tokenizer)
        pair = PreferencePair(_truncated(pair.chosen, limit), _truncated(pair.rejected, limit))
        if pair.chosen.num_loss_tokens and pair.rejected.num_loss_tokens:
            pairs.append(pair)
    if not pairs:
        raise DatasetError(
            f"{path}: every pair has an answer beyond {limit} tokens (min of data.max_seq_len and half of "
            "data.batch_tokens, so that a pair fits in one packed batch); raise them"
        )
    return pairs


def load_pair_sets(config: TrainConfig, tokenizer: Any) -> tuple[list[PreferencePair], list[PreferencePair] | None]:
    """The run's training pairs and its validation pairs (None without a validation file)."""
    data = config.data
    train = load_pairs(data.train_path, tokenizer, data.max_seq_len, data.batch_tokens)
    if not data.validation_path:
        return train, None
    return train, load_pairs(data.validation_path, tokenizer, data.max_seq_len, data.batch_tokens)


def tokenize_pair(record: dict[str, Any], tokenizer: Any) -> PreferencePair:
    """Tokenize one valid record, untruncated."""
    messages = record["input"]["messages"]
    tools = record["input"].get("tools")

    def encode(conversation: list[dict[str, Any]], generation_prompt: bool) -> list[int]:
        extra = {"tools": tools} if tools else {}
        text = tokenizer.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=generation_prompt, **extra
        )
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    prompt = encode(messages, True)
    chosen = encode(messages + record["preferred_output"], False)
    rejected = encode(messages + record["non_preferred_output"], False)
    start = min(_common_prefix(prompt, chosen), _common_prefix(prompt, rejected))
    return PreferencePair(_answer(chosen, start), _answer(rejected, start))


def _answer(ids: list[int], start: int) -> Sample:
    return Sample(ids, [IGNORE_INDEX] * start + ids[start:])


def _truncated(sample: Sample, limit: int) -> Sample:
    return Sample(sample.input_ids[:limit], sample.labels[:limit])


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _problem(record: dict[str, Any]) -> str | None:
    """Why ``record`` is no preference pair the trainer can tokenize, or None."""
    missing = [key for key in KEYS if key not in record]
    if missing:
        return f"expected a preference record ({', '.join(KEYS)}); '{missing[0]}' is missing"
    prompt = record["input"]
    if not isinstance(prompt, dict) or not isinstance(prompt.get("messages"), list) or not prompt["messages"]:
        return "'input' must be an object with a non-empty 'messages' list"
    for key in KEYS[1:]:
        output = record[key]
        if not isinstance(output, list) or not output:
            return f"'{key}' must be a non-empty list of assistant messages"
        if any(not isinstance(m, dict) or m.get("role") != "assistant" for m in output):
            return f"'{key}' must hold assistant messages only"
    return None


def shared_prefix(pair: PreferencePair) -> int:
    """The tokens at the start of both of ``pair``'s sequences whose targets neither trains on (the
    prompt, less any token whose next one is an answer's), at most one less than either sequence:
    each keeps a token to continue from."""
    chosen, rejected = pair.chosen, pair.rejected
    limit = min(len(chosen), len(rejected)) - 1
    n = 0
    while (n < limit and chosen.input_ids[n] == rejected.input_ids[n]
           and chosen.labels[n + 1] == IGNORE_INDEX and rejected.labels[n + 1] == IGNORE_INDEX):
        n += 1
    return n


def pack_pairs(pairs: list[PreferencePair], shared: bool) -> PackedBatch:
    """One packed micro-batch of ``pairs``: ``pack_batch``'s two whole sequences a pair, or ``shared``:
    each pair's ``shared_prefix`` once, then its chosen and its rejected answer continuing it (positions
    from the prefix's length), with ``prefixes`` and an extra ``sequence`` giving each position's
    sequence (pair i's chosen 2i, rejected 2i + 1; its prefix's tokens, which have no target, 2i)."""
    if not shared:
        return pack_batch(pairs)
    row = SegmentRow()
    for i, pair in enumerate(pairs):
        n = shared_prefix(pair)
        head = row.add(pair.chosen.input_ids[:n], [IGNORE_INDEX] * n, sequence=2 * i) if n else -1
        for j, s in enumerate(pair.sequences):
            row.add(s.input_ids[n:], list(s.labels[n + 1:]) + [IGNORE_INDEX], n, head, sequence=2 * i + j)
    return row.batch(len(pairs))
