"""``"auto"`` hyperparameters resolved from the training file, and OpenAI's hyperparameters
turned into ftq's.

The rule (also in docs/openai.md), from the training file's record
count ``n`` and its characters per record (measured at upload):

- ``n_epochs``: 3, raised for a small file so the job sees at least 300 examples (at most 10
  epochs), lowered for a large one so it sees at most 30,000 (at least 1).
- ``batch_size``: ``n / 32`` rounded down to a power of two, between 1 and 64.
- ``learning_rate_multiplier``: ``sqrt(batch_size / 8)`` between 0.5 and 2 (the learning rate
  grows with the square root of the batch), times ftq's base rate of 2e-4 (LoRA).
- ``beta`` (DPO): 0.1.
- ``compute_multiplier`` (reinforcement): 1, i.e. ``grpo.group_size`` 8 completions per prompt
  (``8 x`` the multiplier, between 2 and 256).

ftq packs samples by tokens, not by count, so ``batch_size`` becomes a token budget:
``batch_tokens = batch_size x`` the estimated tokens of a mean record (characters / 3 + 32 for
the chat template; a DPO record counts its prompt with each answer, so twice), never below
``max_seq_len`` (a DPO pair's two sequences: twice that). ``max_seq_len`` is the next power of two above the longest record's characters
+ 64 (a token is at least one character in every tokenizer ftq knows), between 256 and 4096.
A reinforcement record (a prompt) counts its group: ``group_size x`` (its estimated tokens +
``grpo.max_new_tokens`` 256), and the budget holds at least the longest prompt's group.
A step therefore holds ``batch_size`` examples on average, not exactly. A checkpoint is kept
about once per epoch (every ``ceil(n / batch_size)`` steps), and always at the end.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from trainer.objectives.grpo_config import GrpoConfig

BASE_LEARNING_RATE = 2e-4
"""ftq's default LoRA learning rate: what a multiplier of 1 means."""
DEFAULT_BETA = 0.1
MIN_SEEN, MAX_SEEN = 300, 30_000
MAX_SEQ_LEN_RANGE = (256, 4096)
MAX_BATCH_TOKENS = 4_194_304
GROUP_SIZE = GrpoConfig().group_size
"""A reinforcement job's completions per prompt at ``compute_multiplier`` 1."""
MAX_NEW_TOKENS = GrpoConfig().max_new_tokens


@dataclass(frozen=True)
class Resolved:
    """Every hyperparameter as the job runs it, in OpenAI's names."""

    n_epochs: int
    batch_size: int
    learning_rate_multiplier: float
    beta: float | None
    """None for a supervised job."""
    compute_multiplier: float | None = None
    """A reinforcement job's: ``group_size`` is ``GROUP_SIZE x`` it; None for the others."""

    @property
    def group_size(self) -> int | None:
        """Completions sampled per prompt (``grpo.group_size``), for a reinforcement job."""
        if self.compute_multiplier is None:
            return None
        return min(256, max(2, round(GROUP_SIZE * self.compute_multiplier)))

    def as_openai(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "batch_size": self.batch_size,
            "learning_rate_multiplier": self.learning_rate_multiplier,
            "n_epochs": self.n_epochs,
        }
        if self.beta is not None:
            out["beta"] = self.beta
        if self.compute_multiplier is not None:
            out["compute_multiplier"] = self.compute_multiplier
        return out


def resolve(requested: dict[str, Any], *, num_records: int, dpo: bool, reinforcement: bool = False) -> Resolved:
    """Fill each ``"auto"`` (or absent) value of ``requested`` by the rule above."""

    def pick(name: str, auto: Any) -> Any:
        value = requested.get(name, "auto")
        return auto if value == "auto" or value is None else value

    batch_size = int(pick("batch_size", auto_batch_size(num_records)))
    return Resolved(
        n_epochs=int(pick("n_epochs", auto_epochs(num_records))),
        batch_size=batch_size,
        learning_rate_multiplier=float(pick("learning_rate_multiplier", auto_lr_multiplier(batch_size))),
        beta=float(pick("beta", DEFAULT_BETA)) if dpo else None,
        compute_multiplier=float(pick("compute_multiplier", 1.0)) if reinforcement else None,
    )


def auto_epochs(num_records: int) -> int:
    n = max(num_records, 1)
    epochs = 3
    if n * epochs < MIN_SEEN:
        epochs = min(10, math.ceil(MIN_SEEN / n))
    if n * epochs > MAX_SEEN:
        epochs = max(1, MAX_SEEN // n)
    return epochs


def auto_batch_size(num_records: int) -> int:
    quotient = max(num_records, 1) / 32
    return int(min(64, max(1, 2 ** math.floor(math.log2(quotient))) if quotient >= 1 else 1))


def auto_lr_multiplier(batch_size: int) -> float:
    return round(min(2.0, max(0.5, math.sqrt(batch_size / 8))), 4)


def steps_per_epoch(resolved: Resolved, num_records: int) -> int:
    """Optimizer steps of one pass, about (packing makes it approximate)."""
    return max(1, math.ceil(num_records / resolved.batch_size))


def ftq_hyperparameters(resolved: Resolved, stats: dict[str, Any], *, seed: int, dpo: bool) -> dict[str, Any]:
    """The native job spec's ``hyperparameters`` for ``resolved`` and the file's ``stats``."""
    chars = stats.get("chars_per_record") or {}
    mean_chars = float(chars.get("mean") or 0)
    max_chars = int(chars.get("max") or 0)
    low, high = MAX_SEQ_LEN_RANGE
    max_seq_len = min(high, max(low, 1 << math.ceil(math.log2(max_chars + 64))))
    per_record = math.ceil(mean_chars * (2 if dpo else 1) / 3) + 32 * (2 if dpo else 1)
    floor = max_seq_len * (2 if dpo else 1)
    if (group := resolved.group_size) is not None:  # a prompt's group of completions is packed whole
        per_record = group * (math.ceil(mean_chars / 3) + 32 + MAX_NEW_TOKENS)
        floor = max(floor, group * (max_chars + 64 + MAX_NEW_TOKENS))
    budget = math.ceil(resolved.batch_size * per_record / 64) * 64
    return {
        "epochs": float(resolved.n_epochs),
        "learning_rate": BASE_LEARNING_RATE * resolved.learning_rate_multiplier,
        "max_seq_len": max_seq_len,
        "batch_tokens": min(MAX_BATCH_TOKENS, max(floor, budget)),
        "seed": seed,
    }
