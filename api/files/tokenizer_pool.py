"""Tokenizer work for ``GET /v1/files/{id}/tokens``, in worker processes the app state owns.

Loading a tokenizer imports transformers and takes ~0.1-2 s, and a fast tokenizer must not be
used by two threads at once ("Already borrowed"). So the API process does neither: the lifespan
creates one ``TokenizerPool`` (``AppState.tokenizers``, ``FTQ_TOKENIZER_WORKERS`` processes,
default 1, started on first use) and shuts it down at exit. A worker process runs one task at a
time and keeps its own ``TokenizerCache`` of the tokenizers it loaded last, so each loaded
tokenizer has one user at a time::

    API process (event loop)                    worker process (one task at a time)
    file row + resolve_model  (thread)
    await TokenizerPool.token_stats  ───────▶   cache.get(model, source) -> tokenizer
                                                token_stats(path, fmt, tokenizer, max_seq_len)
                                     ◀───────   stats dict, or the InvalidInput (pickled)
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any

from core.errors import InvalidInput, Unavailable
from core.jobs.model_source import ModelSource

_PRELOAD = (
    "api.files.tokenizer_pool", "core.jobs.preflight", "trainer.dataset", "torch", "transformers.modeling_utils",
    "transformers.models.auto.tokenization_auto", "transformers.tokenization_utils_tokenizers",
)
"""Modules the fork server imports once, so that pool workers start with them loaded."""

MAX_RECORDS = 100_000
"""Records tokenized at most per request: enough for any dataset a dashboard user uploads by
hand, and a bound on how long one request holds a worker process."""

TOKENIZER_CACHE_SIZE = 4
"""Tokenizers each worker process keeps loaded between requests (loading one takes ~0.1-2 s; a
dashboard user asks again for the same model with every dataset or length they try)."""


class TokenizerPool:
    """The processes that tokenize datasets; ``token_stats`` awaits one without blocking the loop.

    Args:
        workers: worker processes (``Settings.tokenizer_workers``); each is started on first use.
        cache_size: tokenizers each worker process keeps loaded.
    """

    def __init__(self, workers: int, cache_size: int = TOKENIZER_CACHE_SIZE) -> None:
        self.workers, self.cache_size = workers, cache_size
        self._executor = self._new_executor()

    async def token_stats(
        self, path: str, fmt: str, model: str, source: ModelSource, *, max_seq_len: int
    ) -> dict[str, Any]:
        """The token statistics of dataset ``path`` under ``source``'s tokenizer (``token_stats``).

        Raises:
            InvalidInput: the model's tokenizer cannot be loaded (the message says what to do).
        """
        executor = self._executor
        try:
            future = executor.submit(_token_stats_in_worker, path, fmt, model, source, max_seq_len)
            return await asyncio.wrap_future(future)
        except BrokenProcessPool:
            if self._executor is executor:  # the next request gets fresh processes
                self._executor = self._new_executor()
            raise Unavailable(
                "the tokenizer process ended while tokenizing (killed for memory?); try again, "
                "or set FTQ_TOKENIZER_WORKERS lower on a box short of memory"
            ) from None

    async def run(self, fn: Callable[..., Any], model: str, source: ModelSource, *args: Any) -> Any:
        """``fn(tokenizer, *args)`` in a worker process with ``source``'s tokenizer (``fn`` must be a
        module-level function: it is pickled by name), e.g. ``core.jobs.preflight.report``.

        Raises:
            InvalidInput: the tokenizer cannot be loaded, or ``fn`` raised it.
        """
        executor = self._executor
        try:
            return await asyncio.wrap_future(executor.submit(_run_in_worker, fn, model, source, args))
        except BrokenProcessPool:
            if self._executor is executor:
                self._executor = self._new_executor()
            raise Unavailable("the tokenizer process ended while working (killed for memory?); try again") from None

    def shutdown(self) -> None:
        """Stop the worker processes: queued requests are cancelled, a running one finishes."""
        self._executor.shutdown(wait=True, cancel_futures=True)

    def _new_executor(self) -> ProcessPoolExecutor:
        # forkserver, not fork: the API process runs threads (anyio's, uvicorn's) that fork would
        # copy mid-flight. The fork server is a fresh process started once per API process that
        # imports transformers once (``_PRELOAD``); every pool worker, and a new pool after a
        # broken one, forks from it in milliseconds instead of importing transformers again
        # (~5-10 s each on a busy 2-core box: every submission preflights its data here).
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(list(_PRELOAD))
        return ProcessPoolExecutor(
            max_workers=self.workers,
            mp_context=context,
            initializer=_start_worker,
            initargs=(self.cache_size,),
        )


class TokenizerCache:
    """The tokenizers loaded last, at most ``size``, one entry per model version.

    A local model's key includes each file's size and modification time, so replacing the
    tokenizer files on disk loads them again; a hub model is keyed by its id. A failed load is
    not kept.
    """

    def __init__(self, size: int = TOKENIZER_CACHE_SIZE, load: Callable[[str, ModelSource], Any] | None = None) -> None:
        self.size = size
        self._load = load or load_tokenizer
        self._entries: OrderedDict[tuple[Any, ...], Any] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, model: str, source: ModelSource) -> Any:
        key = (source.kind, source.name_or_path, _files_fingerprint(source))
        if key in self._entries:
            self._entries.move_to_end(key)
            return self._entries[key]
        tokenizer = self._entries[key] = self._load(model, source)
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)
        return tokenizer


def token_stats(path: str | Path, fmt: str, tokenizer: Any, *, max_seq_len: int) -> dict[str, Any]:
    """Tokenize up to ``MAX_RECORDS`` records of ``path`` as training does and summarize their lengths.

    A DPO pair (format ``preference``, ``trainer.preference``) counts both of its sequences (the
    prompt with each answer) and both answers' loss tokens; it is over ``max_seq_len`` when either
    sequence is.
    """
    from trainer.dataset import read_records, tokenize_record
    from trainer.preference import tokenize_pair

    records = read_records(path)
    capped = len(records) > MAX_RECORDS
    lengths: list[int] = []
    loss: list[int] = []
    over = 0
    for _, record in records[:MAX_RECORDS]:
        sequences = tokenize_pair(record, tokenizer).sequences if fmt == "preference" else (
            tokenize_record(record, fmt, tokenizer),)
        lengths.append(sum(len(s) for s in sequences))
        loss.append(sum(s.num_loss_tokens for s in sequences))
        over += any(len(s) > max_seq_len for s in sequences)
    out: dict[str, Any] = {
        "records": len(lengths),
        "tokens": _summary(lengths),
        "loss_tokens": _summary(loss),
        "over_max_seq_len": {
            "max_seq_len": max_seq_len,
            "records": over,
        },
        "capped": capped,
    }
    if capped:
        out["note"] = f"only the first {MAX_RECORDS} of {len(records)} records were tokenized"
    return out


def load_tokenizer(model: str, source: ModelSource) -> Any:
    """``source``'s tokenizer from local files only; InvalidInput naming where it looked."""
    from transformers import AutoTokenizer

    try:
        # Never download here: a hub model counts only if it is already in the local cache.
        return AutoTokenizer.from_pretrained(source.name_or_path, local_files_only=True)
    except (OSError, ValueError) as exc:
        where = "in the local Hugging Face cache" if source.kind == "hub" else f"in {source.name_or_path}"
        raise InvalidInput(
            f"model {model!r}: no tokenizer could be loaded {where} ({exc}); put the model with its "
            "tokenizer files under the model root, or download the hub model on a connected machine",
            param="model",
        ) from None


_worker_cache: TokenizerCache | None = None
"""Set in each worker process by ``_start_worker`` (the per-process set-up); None in the API."""


def _start_worker(cache_size: int) -> None:
    global _worker_cache
    _worker_cache = TokenizerCache(cache_size)


def _token_stats_in_worker(path: str, fmt: str, model: str, source: ModelSource, max_seq_len: int) -> dict[str, Any]:
    assert _worker_cache is not None, "runs only in a TokenizerPool worker process"
    return token_stats(path, fmt, _worker_cache.get(model, source), max_seq_len=max_seq_len)


def _run_in_worker(fn: Callable[..., Any], model: str, source: ModelSource, args: tuple[Any, ...]) -> Any:
    assert _worker_cache is not None, "runs only in a TokenizerPool worker process"
    return fn(_worker_cache.get(model, source), *args)


def _summary(values: list[int]) -> dict[str, float | int]:
    return {
        "total": sum(values),
        "min": min(values),
        "mean": round(sum(values) / len(values), 2),
        "max": max(values),
    }


def _files_fingerprint(source: ModelSource) -> tuple[Any, ...]:
    if source.kind != "local":
        return ()
    try:
        entries = sorted(os.scandir(source.name_or_path), key=lambda e: e.name)
    except OSError:
        return ()
    return tuple((e.name, st.st_size, st.st_mtime_ns) for e in entries if e.is_file() and (st := e.stat()))
