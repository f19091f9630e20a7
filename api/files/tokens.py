"""``GET /v1/files/{file_id}/tokens``: token statistics of a dataset under one model's tokenizer.

The upload response counts characters only, because it does not know the model yet. Once the
user has picked one, this route tokenizes every record exactly as training will
(``trainer.dataset.tokenize_record``: the chat template, loss on assistant tokens only), so the
dashboard can show how many tokens a run would see and how many records ``max_seq_len`` cuts.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Annotated, Any

from anyio import to_thread
from fastapi import APIRouter, Query

from api.deps import StateDep
from core.errors import InvalidInput
from core.files import service
from core.jobs.model_source import ModelSource, resolve_model

MAX_RECORDS = 100_000
"""Records tokenized at most per request: enough for any dataset a dashboard user uploads by
hand, and a bound on how long one request holds a worker thread."""

TOKENIZER_CACHE_SIZE = 4
"""Tokenizers kept loaded between requests (loading one takes ~0.1-2 s; a dashboard user asks
again for the same model with every dataset or length they try)."""

_cache: OrderedDict[tuple[Any, ...], tuple[Any, threading.Lock]] = OrderedDict()
_cache_lock = threading.Lock()

router = APIRouter(tags=["files"])
"""Included by ``api.files.routes.router``, which adds the ``/v1/files`` prefix."""


@router.get(
    "/{file_id}/tokens",
    summary="Token statistics of a dataset under a model's tokenizer, tokenized as training does",
)
async def file_tokens(
    file_id: str,
    state: StateDep,
    model: Annotated[str, Query(description="The model as POST /v1/jobs accepts it")],
    max_seq_len: Annotated[
        int, Query(ge=1, description="Count the records longer than this")
    ] = 4096,
) -> dict[str, Any]:
    """Errors: 404 unknown file; 422 a model the box cannot resolve or whose tokenizer it lacks."""
    settings = state.settings

    def compute() -> dict[str, Any]:
        with state.sessions() as session:
            row = service.get_file(session, file_id)
            path, fmt = row.path, row.format
        source = resolve_model(
            model, model_root=settings.model_root, allow_hub=settings.allow_hub_models
        )
        tokenizer, lock = cached_tokenizer(model, source)
        with lock:  # a fast tokenizer must not be used by two threads at once ("Already borrowed")
            stats = dataset_token_stats(path, fmt, tokenizer, max_seq_len=max_seq_len)
        return stats | {"file_id": file_id, "model": model}

    return await to_thread.run_sync(compute)


def dataset_token_stats(
    path: str | Path, fmt: str, tokenizer: Any, *, max_seq_len: int
) -> dict[str, Any]:
    """Tokenize up to ``MAX_RECORDS`` records of ``path`` and summarize their lengths."""
    from trainer.dataset import read_records, tokenize_record

    records = read_records(path)
    capped = len(records) > MAX_RECORDS
    lengths: list[int] = []
    loss: list[int] = []
    for _, record in records[:MAX_RECORDS]:
        sample = tokenize_record(record, fmt, tokenizer)
        lengths.append(len(sample))
        loss.append(sample.num_loss_tokens)
    out: dict[str, Any] = {
        "records": len(lengths),
        "tokens": _summary(lengths),
        "loss_tokens": _summary(loss),
        "over_max_seq_len": {
            "max_seq_len": max_seq_len,
            "records": sum(1 for n in lengths if n > max_seq_len),
        },
        "capped": capped,
    }
    if capped:
        out["note"] = (
            f"only the first {MAX_RECORDS} of {len(records)} records were tokenized"
        )
    return out


def _summary(values: list[int]) -> dict[str, float | int]:
    return {
        "total": sum(values),
        "min": min(values),
        "mean": round(sum(values) / len(values), 2),
        "max": max(values),
    }


def cached_tokenizer(model: str, source: ModelSource) -> tuple[Any, threading.Lock]:
    """The tokenizer of ``source`` and the lock to hold while using it, loaded once per version.

    A local model's key includes each file's size and modification time, so replacing the
    tokenizer files on disk loads them again; a hub model is keyed by its id.
    """
    key = (source.kind, source.name_or_path, _files_fingerprint(source))
    with _cache_lock:
        hit = _cache.get(key)
        if hit is not None:
            _cache.move_to_end(key)
            return hit
    loaded = (_load_tokenizer(model, source), threading.Lock())  # outside the lock: may be slow
    with _cache_lock:
        entry = _cache.setdefault(key, loaded)
        _cache.move_to_end(key)
        while len(_cache) > TOKENIZER_CACHE_SIZE:
            _cache.popitem(last=False)
    return entry


def _files_fingerprint(source: ModelSource) -> tuple[Any, ...]:
    if source.kind != "local":
        return ()
    try:
        entries = sorted(os.scandir(source.name_or_path), key=lambda e: e.name)
    except OSError:
        return ()
    return tuple(
        (e.name, st.st_size, st.st_mtime_ns)
        for e in entries
        if e.is_file() and (st := e.stat())
    )


def _load_tokenizer(model: str, source: ModelSource) -> Any:
    from transformers import AutoTokenizer

    try:
        # Never download here: a hub model counts only if it is already in the local cache.
        return AutoTokenizer.from_pretrained(source.name_or_path, local_files_only=True)
    except (OSError, ValueError) as exc:
        where = (
            "in the local Hugging Face cache"
            if source.kind == "hub"
            else f"in {source.name_or_path}"
        )
        raise InvalidInput(
            f"model {model!r}: no tokenizer could be loaded {where} ({exc}); put the model with its "
            "tokenizer files under the model root, or download the hub model on a connected machine",
            param="model",
        ) from None
