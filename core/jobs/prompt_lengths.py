"""A generation job's prompts against its model's context, checked at submission.

The sampler's cache holds each prompt with its ``sampling.max_tokens`` new tokens, and nothing in
the trainer stops a sequence from running past the positions the model was trained on
(``max_position_embeddings``), so the submission does: when the model is local (a base under the
model root, a training job's weights or a merged export: a directory with its ``config.json``
and tokenizer), each prompt is tokenized as the trainer will tokenize it
(``trainer.generate.job.encode``: chat through the template with the generation prompt, text
with the bos) in a tokenizer-pool process (``api.files.tokenizer_pool``, as the dataset
preflight), and the first prompt whose tokens + ``max_tokens`` exceed the limit is refused with
its line. The limit is the model's ``max_position_embeddings``, or ``FTQ_GENERATE_MAX_LEN`` where
that is lower. A hub model is not checked: its config and tokenizer need not be on the box. Nor is
a full fine-tune saved without tokenizer files whose base (which lends it the tokenizer) is a hub id.

    locate (a thread, the store)    the prompts file, the model's directory and the limit
    count  (a tokenizer process)    each prompt's tokens; InvalidDataset naming the first too long
    add_counts                      the counts into the submission's report
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session

from core.errors import InvalidDataset, InvalidInput
from core.jobs.admission import usable_file
from core.jobs.generate_spec import GenerateSpec
from core.jobs.generation import PURPOSE, resolve
from core.jobs.model_source import ModelSource
from core.jobs.preflight import MAX_RECORDS, Progress
from core.settings import Settings

PARAM = "prompts_file"


@dataclass(frozen=True)
class Limit:
    """The most tokens one sequence (prompt + ``max_tokens``) may hold, and where that comes from."""

    tokens: int
    why: str
    """``max_position_embeddings`` of the model's config.json, or ``FTQ_GENERATE_MAX_LEN``."""


@dataclass(frozen=True)
class Located:
    """What ``count`` needs: the tokenizer's directory, the prompts and the limit."""

    source: ModelSource
    """Where the tokenizer loads from: the model's directory, or the base's for a full fine-tune
    saved without tokenizer files (``core.jobs.generation.ResolvedModel.tokenizer``)."""
    prompts_path: str
    limit: Limit


def locate(session: Session, spec: GenerateSpec, *, settings: Settings, project_id: str | None) -> Located | None:
    """The check of ``spec``'s prompts; None where there is none (a hub model, no known context).

    Raises:
        InvalidInput: the prompts file or the model (as ``core.jobs.generation.preflight`` does).
    """
    row = usable_file(session, spec.prompts_file, PURPOSE, PARAM, project_id)
    resolved = resolve(session, spec.model, settings=settings, project_id=project_id)
    model, tokenizer = resolved.model, resolved.tokenizer or resolved.model
    if not (os.path.isabs(model) and Path(model, "config.json").is_file()) or not os.path.isabs(tokenizer):
        return None
    limit = context_limit(_config(Path(model)), settings.generate_max_len)
    return Located(ModelSource("local", tokenizer), row.path, limit) if limit is not None else None


def context_limit(config: dict[str, Any], cap: int | None) -> Limit | None:
    """The lower of ``config``'s ``max_position_embeddings`` (its ``text_config``'s for a model
    that nests it) and ``cap``; None when neither is known."""
    context = config.get("max_position_embeddings")
    if context is None and isinstance(config.get("text_config"), dict):
        context = config["text_config"].get("max_position_embeddings")
    if not isinstance(context, int) or isinstance(context, bool) or context < 1:
        context = None
    if cap is not None and (context is None or cap < context):
        return Limit(cap, "FTQ_GENERATE_MAX_LEN")
    return Limit(context, "max_position_embeddings of its config.json") if context is not None else None


def count(tokenizer: Any, prompts_path: str, max_tokens: int, limit: Limit, *,
          progress: Progress | None = None) -> dict[str, Any]:
    """The prompt tokens of the first ``MAX_RECORDS`` prompts of ``prompts_path`` (run in a
    tokenizer-pool process: ``trainer.generate`` imports torch).

    Returns:
        ``{"tokens": all prompts' tokens, "longest": the longest prompt's, "capped": bool}``.

    Raises:
        InvalidDataset: a prompt + ``max_tokens`` over ``limit``, or one the model's tokenizer or chat
            template fails on (the trainer would fail the same way); the message names its line.
    """
    from trainer.generate.job import encode
    from trainer.generate.prompts import read_prompts

    prompts = read_prompts(prompts_path)  # checked whole at upload
    total = longest = 0
    for prompt in prompts[:MAX_RECORDS]:
        if progress is not None:
            progress(PARAM, prompt.line)
        try:
            tokens = len(encode(prompt, tokenizer))
        except Exception as exc:  # noqa: BLE001 - a template that raises (e.g. "System role not supported")
            raise InvalidDataset(f"{PARAM}: line {prompt.line}: the model's tokenizer or chat template fails on this "
                                 f"prompt ({type(exc).__name__}: {exc}); the job would fail the same way",
                                 line=prompt.line, param=PARAM) from None
        if tokens + max_tokens > limit.tokens:
            raise too_long(prompt.line, tokens, max_tokens, limit)
        total, longest = total + tokens, max(longest, tokens)
    return {"tokens": total, "longest": longest, "capped": len(prompts) > MAX_RECORDS}


def too_long(line: int, tokens: int, max_tokens: int, limit: Limit) -> InvalidDataset:
    """The refusal of the prompt at ``line``: ``sampling.max_tokens`` is the field to change
    when the prompt alone fits, else the prompt."""
    where = f"{PARAM}: line {line}: the prompt is {tokens:,} tokens"
    if tokens >= limit.tokens:
        return InvalidDataset(f"{where}, the model holds {limit.tokens:,} ({limit.why}) with sampling.max_tokens "
                              f"({max_tokens:,}) after it; shorten the prompt", line=line, param=PARAM)
    return InvalidDataset(
        f"{where} + sampling.max_tokens {max_tokens:,} = {tokens + max_tokens:,}, over the {limit.tokens:,} the "
        f"model holds ({limit.why}); set sampling.max_tokens to at most {limit.tokens - tokens:,} or shorten the prompt",
        line=line, param="sampling.max_tokens")


def add_counts(report: dict[str, Any], counted: dict[str, Any] | None, max_tokens: int,
               limit: Limit | None) -> dict[str, Any]:
    """``report`` (``core.jobs.generation.preflight``'s) with the prompts' tokens and what was checked."""
    if counted is None or limit is None:
        return {**report, "note": f"{report['note']}; prompt lengths not checked (the model is not a local directory "
                                  "with a known context)"}
    note = (f"the longest prompt is {counted['longest']:,} tokens: with sampling.max_tokens {max_tokens:,} within "
            f"the {limit.tokens:,} the model holds ({limit.why})")
    if counted["capped"]:
        note += f"; only the first {MAX_RECORDS:,} prompts were counted"
    return {**report, "tokens": counted["tokens"], "max_seq_len": limit.tokens, "capped": counted["capped"],
            "note": f"{report['note']}; {note}"}


def _config(directory: Path) -> dict[str, Any]:
    try:
        loaded = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidInput(f"model: {directory.name}/config.json is unreadable ({exc})", param="model") from None
    return loaded if isinstance(loaded, dict) else {}
