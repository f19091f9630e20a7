"""Preflight: the dataset as training will see it, computed at submission, before any GPU.

With the model's own tokenizer and chat template, every record is tokenized by the trainer's
own code (``trainer.dataset``: ``validate_record``, ``tokenize_record``, the same truncation to
``max_seq_len`` as ``load_samples``), so the counts here are the counts of the run:

- records, tokens and trainable (labelled) tokens after truncation, and their fraction;
- records longer than ``max_seq_len``, the tokens truncation cuts and how many were trainable;
- records left with no trainable token (training skips them);
- one rendered record split into runs of trainable / untrained text.

A ``max_steps`` that would pass over the training file more than ``MAX_REPEATS`` times is a
warning too (``repeat_warning``; counted from the tokens here, or from the records alone where
the dataset could not be tokenized). A dataset that trains nothing is refused (``InvalidInput``, 422) with the reason: the chat
template renders no assistant tokens (the trainer would fail on that line), or every record is
cut before its answer. A low trainable fraction (under ``LOW_TRAINABLE_FRACTION``) or records
that lose tokens become ``warnings``, stored on the job. ``report`` runs in a tokenizer-pool
process (``api.files.tokenizer_pool``): it needs transformers, which the API process never imports.

Before a record is tokenized it is held to ``RecordBounds`` (``FTQ_RECORD_MAX_MESSAGES``,
``FTQ_RECORD_MAX_CHARS``): a 10^6-turn conversation is refused by its count, in microseconds,
instead of being rendered.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from core.errors import InvalidInput

LOW_TRAINABLE_FRACTION = 0.05
"""Below this share of trainable tokens a job is accepted with a warning: a chat set whose long
system prompts dwarf one-word answers trains mostly on nothing, which a user wants to know."""
MAX_RECORDS = 100_000
"""Records tokenized at most (as ``GET /v1/files/{id}/tokens``); the report says when it stopped."""
EXAMPLE_TOKENS = 400
"""Tokens of the rendered example shown."""
MAX_REPEATS = 100
"""More passes over the training file than this, set by ``max_steps``, is a warning: 10,000,000
steps over one record is a typo or a misunderstanding, not a plan."""


Progress = Callable[[str, int], None]
"""``progress(param, line)``: the record a tokenizer-pool task is on (for a timed-out request's message)."""


@dataclass(frozen=True)
class RecordBounds:
    """What one record may hold before it is tokenized (``Settings.record_max_messages``,
    ``Settings.record_max_chars``)."""

    max_messages: int = 10_000
    """Messages of a chat record (a preference record's input and outputs together)."""
    max_chars: int = 4_000_000
    """Characters of all the record's strings together (about 1M tokens)."""

    def check(self, record: dict[str, Any], number: int, param: str) -> None:
        """Raises InvalidInput naming the line and the bound ``record`` (line ``number``) is over."""
        messages = _messages(record)
        if messages > self.max_messages:
            raise InvalidInput(
                f"{param}: line {number}: {messages:,} messages, more than the {self.max_messages:,} a record may "
                "have (FTQ_RECORD_MAX_MESSAGES); split the conversation into several records", param=param)
        chars = _chars(record)
        if chars > self.max_chars:
            raise InvalidInput(
                f"{param}: line {number}: {chars:,} characters, more than the {self.max_chars:,} a record may have "
                "(FTQ_RECORD_MAX_CHARS); split the record", param=param)


def _messages(record: dict[str, Any]) -> int:
    lists = [record.get("messages"), record.get("preferred_output"), record.get("non_preferred_output")]
    if isinstance(record.get("input"), dict):
        lists.append(record["input"].get("messages"))
    return sum(len(value) for value in lists if isinstance(value, list))


def _chars(value: Any) -> int:
    total, stack = 0, [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return total


def tokenized(record: dict[str, Any], fmt: str, tokenizer: Any, number: int, param: str) -> Any:
    """``trainer.dataset.tokenize_record``, its failures an InvalidInput naming the line."""
    from trainer.data.dataset import tokenize_record
    from trainer.errors import DatasetError

    try:
        return tokenize_record(record, fmt, tokenizer)
    except DatasetError as exc:
        raise InvalidInput(f"{param}: line {number}: {exc}", param=param) from None
    except Exception as exc:  # noqa: BLE001 - a template that raises (e.g. "System role not supported")
        raise InvalidInput(f"{param}: line {number}: the model's tokenizer or chat template fails on this record "
                           f"({type(exc).__name__}: {exc}); the trainer would fail the same way", param=param) from None


def report(tokenizer: Any, train: tuple[str, str], validation: tuple[str, str] | None, max_seq_len: int,
           bounds: RecordBounds | None = None, *, progress: Progress | None = None) -> dict[str, Any]:
    """The preflight report (``api.jobs.schemas.PreflightOut``) of a ``(path, format)`` training
    file and optional validation file under ``tokenizer``, each record held to ``bounds`` first.

    Raises:
        InvalidInput: nothing in the training (or validation) file would be trained on, or a record
            is over ``bounds`` or fails to tokenize (naming the line).
    """
    bounds, progress = bounds or RecordBounds(), progress or _no_progress
    out = _counts(tokenizer, *train, max_seq_len, "training_file", bounds, progress)
    out["warnings"] = _warnings(out, max_seq_len)
    if validation is not None:
        counts = _counts(tokenizer, *validation, max_seq_len, "validation_file", bounds, progress)
        out["validation"] = {k: v for k, v in counts.items() if k != "example"}
    return {"checked": True, **out}


def _no_progress(param: str, line: int) -> None:
    return None


def _counts(tokenizer: Any, path: str, fmt: str, max_seq_len: int, param: str, bounds: RecordBounds,
            progress: Progress) -> dict[str, Any]:
    from trainer.data.dataset import detect_format, read_records, validate_record
    from trainer.errors import DatasetError

    try:
        records = read_records(path)
    except DatasetError as exc:
        raise InvalidInput(f"{param}: {exc}", param=param) from None
    fmt = fmt if fmt in ("chat", "prompt_completion", "text") else (detect_format(records[0][1]) or "text")
    totals = dict.fromkeys(("tokens", "trainable_tokens", "truncated_records", "truncated_tokens",
                            "truncated_trainable_tokens", "dropped_records"), 0)
    example: list[dict[str, Any]] = []
    for number, record in records[:MAX_RECORDS]:
        progress(param, number)
        bounds.check(record, number, param)
        problem = validate_record(record, fmt)
        if problem:
            raise InvalidInput(f"{param}: line {number}: {problem}", param=param)
        whole = tokenized(record, fmt, tokenizer, number, param)
        if whole.num_loss_tokens == 0:
            raise InvalidInput(_no_labels(param, number, fmt), param=param)
        kept = type(whole)(whole.input_ids[:max_seq_len], whole.labels[:max_seq_len])
        totals["tokens"] += len(kept)
        totals["trainable_tokens"] += kept.num_loss_tokens
        if len(whole) > max_seq_len:
            totals["truncated_records"] += 1
            totals["truncated_tokens"] += len(whole) - len(kept)
            totals["truncated_trainable_tokens"] += whole.num_loss_tokens - kept.num_loss_tokens
        if kept.num_loss_tokens == 0:
            totals["dropped_records"] += 1
        elif not example:
            example = render_example(kept, tokenizer)
    counted = min(len(records), MAX_RECORDS)
    if totals["dropped_records"] == counted:
        raise InvalidInput(
            f"{param}: every record is cut before its first trainable token by max_seq_len={max_seq_len} "
            f"(truncation removes all {totals['truncated_trainable_tokens']} trainable tokens); raise "
            "hyperparameters.max_seq_len or shorten the prompts",
            param="hyperparameters.max_seq_len",
        )
    return {"format": fmt, "records": counted, **totals, "max_seq_len": max_seq_len,
            "trainable_fraction": round(totals["trainable_tokens"] / max(totals["tokens"], 1), 4),
            "capped": len(records) > MAX_RECORDS, "example": example}


def _no_labels(param: str, number: int, fmt: str) -> str:
    if fmt == "chat":
        return (f"{param}: line {number}: the model's chat template puts no assistant tokens in this "
                "conversation (it does not render the conversation's prefixes as prefixes of the whole, or "
                "drops the assistant turn), so nothing would be trained; use a model whose template keeps "
                "assistant turns, or prompt/completion records")
    return f"{param}: line {number}: the record tokenizes to no trainable token; give it a non-empty answer"


def render_example(sample: Any, tokenizer: Any) -> list[dict[str, Any]]:
    """``sample``'s first ``EXAMPLE_TOKENS`` tokens as runs of ``{text, trainable}``."""
    from trainer.data.dataset import IGNORE_INDEX

    runs: list[dict[str, Any]] = []
    ids, labels = sample.input_ids[:EXAMPLE_TOKENS], sample.labels[:EXAMPLE_TOKENS]
    start = 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or (labels[i] != IGNORE_INDEX) != (labels[start] != IGNORE_INDEX):
            runs.append({"text": tokenizer.decode(ids[start:i]), "trainable": labels[start] != IGNORE_INDEX})
            start = i
    return runs


def _warnings(counts: dict[str, Any], max_seq_len: int) -> list[str]:
    warnings = []
    fraction = counts["trainable_fraction"]
    if fraction < LOW_TRAINABLE_FRACTION:
        warnings.append(
            f"only {fraction:.1%} of the tokens are trainable ({counts['trainable_tokens']} of {counts['tokens']}): "
            "most of each record is prompt the model is not trained on; check that the answers are where "
            "the loss is taken"
        )
    if counts["truncated_records"]:
        warnings.append(
            f"{counts['truncated_records']} records are longer than max_seq_len={max_seq_len}: truncation cuts "
            f"{counts['truncated_tokens']} tokens, {counts['truncated_trainable_tokens']} of them trainable"
        )
    if counts["dropped_records"]:
        warnings.append(f"{counts['dropped_records']} records keep no trainable token within max_seq_len and "
                        "will be skipped")
    return warnings


def unchecked(note: str) -> dict[str, Any]:
    """The report of a dataset that could not be tokenized here (``checked`` false, why in ``note``)."""
    return {"checked": False, "note": note, "warnings": [note]}


def checked_report(tokenizer: Any, model_type: str | None, train: tuple[str, str],
                   validation: tuple[str, str] | None, max_seq_len: int, bounds: RecordBounds | None = None, *,
                   progress: Progress | None = None) -> dict[str, Any]:
    """``report``, after checking that transformers knows a local model's ``model_type`` (run in a
    tokenizer-pool process, where transformers is loaded anyway)."""
    if model_type is not None:
        from transformers import CONFIG_MAPPING

        if model_type not in CONFIG_MAPPING:
            raise InvalidInput(
                f"model: config.json's model_type {model_type!r} is not an architecture this box's transformers "
                "knows; check the config, or upgrade transformers on the box",
                param="model",
            )
    return report(tokenizer, train, validation, max_seq_len, bounds, progress=progress)


def repeat_warning(report: dict[str, Any], *, max_steps: int | None, micro_batches_per_step: int,
                   batch_tokens: int, records: int) -> str | None:
    """The warning for a ``max_steps`` that repeats the training file more than ``MAX_REPEATS``
    times, else None.

    A pass over the file is about ``ceil(tokens / batch_tokens)`` packed micro-batches (never more
    than one per record); a step takes ``micro_batches_per_step`` (``grad_accum x gpus``). Without
    token counts (``report`` not ``checked``) a pass is counted as one micro-batch per record, the
    most it can be, so the count is a floor ("at least").

    Args:
        report: the preflight report (``tokens`` and ``records`` counted, when ``checked``).
        records: the training file's records (all of them; the report may count fewer).
    """
    if max_steps is None or records < 1:
        return None
    tokens = None
    if report.get("checked") and report.get("records"):
        tokens = report["tokens"] * records / report["records"]  # the report tokenizes MAX_RECORDS at most
    per_pass = records if tokens is None else min(records, max(1, math.ceil(tokens / batch_tokens)))
    repeats = max_steps * micro_batches_per_step / per_pass
    if repeats <= MAX_REPEATS:
        return None
    steps = per_pass / micro_batches_per_step
    size = f"{records:,} record{'s' if records != 1 else ''}"
    if tokens is not None:
        size, repeated, pass_is = f"{size}, {round(tokens):,} tokens", "about", "about"
    else:
        repeated, pass_is = "at least", "at most"
    return (f"max_steps {max_steps} repeats the training file {repeated} {round(repeats):,} times (one pass over "
            f"its {size} is {pass_is} {_amount(steps)} step{'s' if steps != 1 else ''}); set epochs or fewer max_steps")


def _amount(x: float) -> str:
    return f"{round(x):,}" if x >= 10 else f"{x:.2g}"
