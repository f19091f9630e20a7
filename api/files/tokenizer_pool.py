"""Tokenizer work for ``GET /v1/files/{id}/tokens`` and the preflight, in worker processes the app state owns.

Loading a tokenizer imports transformers and takes ~0.1-2 s, and a fast tokenizer must not be
used by two threads at once ("Already borrowed"). So the API process does neither: the lifespan
creates one ``TokenizerPool`` (``AppState.tokenizers``, ``FTQ_TOKENIZER_WORKERS`` processes,
default 2, each started on first use) and shuts it down at exit. A worker process runs one task
at a time and keeps its own ``TokenizerCache`` of the tokenizers it loaded last, so each loaded
tokenizer has one user at a time::

    API process (event loop)                    worker process (one task at a time)
    file row + resolve_model  (thread)
    await TokenizerPool.run(fn, ...)  ──pipe──▶ cache.get(model, source) -> tokenizer
      (a worker by fair turn; budget)           fn(tokenizer, *args, progress=...)  line -> shared
                                     ◀──pipe──  the result, or the InvalidInput

Fairness: a request takes a worker by turn, the user with the fewest requests running first,
and one user holds at most all workers but one, so a user's slow requests leave a worker for
everybody else (with one worker, ``FTQ_TOKENIZER_WORKERS=1``, the others wait a budget at most). Each request has a time budget
(``FTQ_TOKENIZER_BUDGET_S``): past it the worker process is killed (a record it would take
minutes over cannot hold it), the request answers 422 naming the line it was on, and the next
request starts a fresh process (forked from the fork server in milliseconds).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import os
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from core.errors import InvalidInput, Unavailable
from core.jobs.model_source import ModelSource
from core.jobs.preflight import RecordBounds, tokenized

log = logging.getLogger(__name__)

_PRELOAD = (
    "api.files.tokenizer_pool", "core.jobs.preflight", "trainer.data.dataset", "torch", "transformers.modeling_utils",
    "transformers.models.auto.tokenization_auto", "transformers.tokenization_utils_tokenizers",
)
"""Modules the fork server imports once, so that pool workers start with them loaded."""

MAX_RECORDS = 100_000
"""Records tokenized at most per request: enough for any dataset a dashboard user uploads by
hand, and a bound on how long one request holds a worker process."""

TOKENIZER_CACHE_SIZE = 4
"""Tokenizers each worker process keeps loaded between requests (loading one takes ~0.1-2 s; a
dashboard user asks again for the same model with every dataset or length they try)."""

DEFAULT_BUDGET_S = 60.0
"""``Settings.tokenizer_budget_s``'s default."""

PARAMS = ("model", "file", "training_file", "validation_file", "prompts_file")
"""What a worker can be on (``progress(param, line)``), by index in the shared position."""

Progress = Callable[[str, int], None]


class TokenizerPool:
    """The processes that tokenize datasets; ``run`` awaits one without blocking the loop.

    Args:
        workers: worker processes (``Settings.tokenizer_workers``); each is started on first use.
        budget_s: seconds one request may hold a worker (``Settings.tokenizer_budget_s``).
        cache_size: tokenizers each worker process keeps loaded.
    """

    def __init__(self, workers: int, budget_s: float = DEFAULT_BUDGET_S, cache_size: int = TOKENIZER_CACHE_SIZE) -> None:
        self.workers, self.budget_s, self.cache_size = workers, budget_s, cache_size
        self._idle: list[_Worker] = []
        self._started = 0
        self._running: Counter[str] = Counter()
        self._waiting: list[_Waiter] = []
        self._order = itertools.count()
        self._closed = False

    @property
    def running(self) -> int:
        """Requests holding a worker now."""
        return sum(self._running.values())

    async def token_stats(
        self, path: str, fmt: str, model: str, source: ModelSource, *, max_seq_len: int,
        bounds: RecordBounds | None = None, user: str = "",
    ) -> dict[str, Any]:
        """The token statistics of dataset ``path`` under ``source``'s tokenizer (``token_stats``).

        Raises:
            InvalidInput: the model's tokenizer cannot be loaded (the message says what to do), a
                record is over ``bounds``, or the request ran past the budget (naming the line).
        """
        return await self.run(_token_stats_task, model, source, path, fmt, max_seq_len, bounds or RecordBounds(),
                              user=user)

    async def run(self, fn: Callable[..., Any], model: str, source: ModelSource, *args: Any, user: str = "") -> Any:
        """``fn(tokenizer, *args, progress=...)`` in a worker process with ``source``'s tokenizer
        (``fn`` must be a module-level function: it is pickled by name), e.g.
        ``core.jobs.preflight.checked_report``; ``progress(param, line)`` says where it is, for
        the message of a request that runs out of time. ``user`` shares the workers fairly.

        Raises:
            InvalidInput: the tokenizer cannot be loaded, ``fn`` raised it, or the budget ran out.
            Unavailable: the worker process died (killed for memory?) or the pool is shut down.
        """
        worker = await self._acquire(user)
        try:
            worker = worker or await asyncio.to_thread(_Worker.start, self.cache_size)
            return await worker.call((fn, model, source, args), self.budget_s, model)
        finally:
            self._release(worker, user)

    def prestart(self) -> threading.Thread:
        """Start one worker now, in the background (``Settings.tokenizer_prestart``): the first
        start launches the fork server, which imports torch and transformers (20-40 s on a busy
        2-core box), and without this the API's first submission waited for it in its preflight.
        The worker joins the idle ones; a request that comes first starts another or waits for it."""
        loop = asyncio.get_running_loop()
        self._started += 1

        def start() -> None:
            try:
                worker = _Worker.start(self.cache_size)
            except Exception:  # the first request starts one and reports what fails
                log.warning("the tokenizer pool could not start a worker ahead of use", exc_info=True)
                worker = None
            try:
                loop.call_soon_threadsafe(self._adopt, worker)
            except RuntimeError:  # the API's loop has already ended
                if worker is not None:
                    worker.stop()

        thread = threading.Thread(target=start, name="ftq-tokenizer-prestart", daemon=True)
        thread.start()
        return thread

    def _adopt(self, worker: _Worker | None) -> None:
        if worker is None or self._closed:
            if worker is not None:
                worker.stop()
            self._started -= 1
        else:
            self._idle.append(worker)
        self._dispatch()

    def shutdown(self) -> None:
        """Stop the worker processes: waiting requests are refused, a running one is ended."""
        self._closed = True
        for waiter in self._waiting:
            if not waiter.future.done():
                waiter.future.get_loop().call_soon_threadsafe(_refuse, waiter.future)
        self._waiting.clear()
        while self._idle:
            self._idle.pop().stop()

    async def _acquire(self, user: str) -> _Worker | None:
        """A worker (None: start one in the free slot) once it is ``user``'s turn."""
        if self._closed:
            raise Unavailable("the API is shutting down; try again")
        waiter = _Waiter(user, next(self._order), asyncio.get_running_loop().create_future())
        self._waiting.append(waiter)
        self._dispatch()
        try:
            return await waiter.future
        except asyncio.CancelledError:
            if waiter in self._waiting:
                self._waiting.remove(waiter)
            elif waiter.future.done() and not waiter.future.cancelled():
                self._release(waiter.future.result(), user)  # granted as it was cancelled
            raise

    def _release(self, worker: _Worker | None, user: str) -> None:
        self._running[user] -= 1
        if self._running[user] <= 0:
            del self._running[user]
        if worker is not None and worker.ready and not self._closed:
            self._idle.append(worker)
        else:  # never started, killed, dead, or cut off mid-task: the slot starts a fresh one
            if worker is not None:
                worker.stop()
            self._started -= 1
        self._dispatch()

    def _dispatch(self) -> None:
        """Hand free workers to waiting requests: the user with the fewest running first, then
        first come; no user holds more than all workers but one (so another user's request
        finds a worker free, or one within a budget)."""
        limit = max(1, self.workers - 1)
        while self._waiting and (self._idle or self._started < self.workers):
            eligible = [w for w in self._waiting if self._running[w.user] < limit]
            if not eligible:
                return
            waiter = min(eligible, key=lambda w: (self._running[w.user], w.order))
            self._waiting.remove(waiter)
            self._running[waiter.user] += 1
            if self._idle:
                worker: _Worker | None = self._idle.pop()
            else:
                worker, self._started = None, self._started + 1
            waiter.future.set_result(worker)


@dataclass
class _Waiter:
    user: str
    order: int
    future: asyncio.Future = field(compare=False)


def _refuse(future: asyncio.Future) -> None:
    if not future.done():
        future.set_exception(Unavailable("the API is shutting down; try again"))


class _Worker:
    """One worker process, its pipe and where it is (``position``: param index, line)."""

    def __init__(self, process: Any, conn: Connection, position: Any) -> None:
        self.process, self.conn, self.position = process, conn, position
        self.ready = True

    @classmethod
    def start(cls, cache_size: int) -> _Worker:
        # forkserver, not fork: the API process runs threads (anyio's, uvicorn's) that fork would
        # copy mid-flight. The fork server is a fresh process started once per API process that
        # imports transformers once (``_PRELOAD``); every worker, and each that replaces a killed
        # one, forks from it in milliseconds instead of importing transformers again (~5-10 s
        # each on a busy 2-core box: every submission preflights its data here).
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(list(_PRELOAD))
        ours, theirs = context.Pipe()
        position = context.Array("q", 2, lock=False)
        process = context.Process(target=_serve, args=(theirs, position, cache_size), daemon=True,
                                  name="ftq-tokenizer")
        process.start()
        theirs.close()
        return cls(process, ours, position)

    async def call(self, task: tuple[Any, ...], budget_s: float, model: str) -> Any:
        """Send ``task``, await its outcome for ``budget_s`` at most (then kill the process)."""
        self.ready = False
        self.position[0], self.position[1] = 0, 0
        try:
            self.conn.send(task)
        except OSError:
            raise _died() from None
        reading = asyncio.ensure_future(asyncio.to_thread(self._receive))
        try:
            outcome, value = await asyncio.wait_for(asyncio.shield(reading), budget_s)
        except TimeoutError:
            where = (PARAMS[self.position[0]], int(self.position[1]))
            await self._kill(reading)
            raise _over_budget(where, budget_s, model) from None
        except asyncio.CancelledError:  # the client went away: the task would run on unseen
            await self._kill(reading)
            raise
        if outcome == "died":
            raise _died()
        self.ready = True
        if outcome == "error":
            raise _rebuilt(*value)
        return value

    def _receive(self) -> tuple[str, Any]:
        try:
            return self.conn.recv()
        except (EOFError, OSError):
            return "died", None

    async def _kill(self, reading: asyncio.Future) -> None:
        # The reading thread ends on the pipe's EOF once the process is gone; only then is the
        # pipe closed (closing it under a blocked read could hand its descriptor to a new pipe).
        self.process.kill()
        await asyncio.shield(reading)

    def stop(self) -> None:
        """End the process (killed: it may be stuck in one record) and close the pipe."""
        self.ready = False
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=5)
        self.conn.close()


def _died() -> Unavailable:
    return Unavailable("the tokenizer process ended while working (killed for memory?); try again, "
                       "or set FTQ_TOKENIZER_WORKERS lower on a box short of memory")


class OverBudget(InvalidInput):
    """A request that held a worker past ``FTQ_TOKENIZER_BUDGET_S`` (422, naming the line it was on)."""


def _over_budget(where: tuple[str, int], budget_s: float, model: str) -> OverBudget:
    param, line = where
    if line == 0:
        return OverBudget(f"model: loading the tokenizer of {model} took longer than the {budget_s:g} s a "
                            "request may take (FTQ_TOKENIZER_BUDGET_S); try again", param="model")
    return OverBudget(
        f"{param}: line {line}: tokenizing took longer than the {budget_s:g} s a request may take "
        f"(FTQ_TOKENIZER_BUDGET_S) and was on line {line}: a record that long, or a file that large, cannot "
        "be checked here; split the record (or the file), or ask the operator to raise the budget",
        param=param)


def _serve(conn: Connection, position: Any, cache_size: int) -> None:
    """A worker process's loop: one task at a time until the pipe closes."""
    cache = TokenizerCache(cache_size)

    def progress(param: str, line: int) -> None:
        position[0], position[1] = PARAMS.index(param), line

    while True:
        try:
            fn, model, source, args = conn.recv()
        except (EOFError, OSError):
            return
        try:
            tokenizer = cache.get(model, source)
            conn.send(("ok", fn(tokenizer, *args, progress=progress)))
        except Exception as exc:  # noqa: BLE001 - sent back and raised in the API process
            conn.send(("error", (type(exc), exc.args, vars(exc))))


def _rebuilt(cls: type[BaseException], args: tuple[Any, ...], attributes: dict[str, Any]) -> BaseException:
    """The worker's exception as it was (``param``, ``line`` kept: pickling keeps only ``args``)."""
    exc = cls.__new__(cls)
    exc.args = args
    exc.__dict__.update(attributes)
    return exc


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


def token_stats(path: str | Path, fmt: str, tokenizer: Any, *, max_seq_len: int, bounds: RecordBounds | None = None,
                progress: Progress | None = None) -> dict[str, Any]:
    """Tokenize up to ``MAX_RECORDS`` records of ``path`` as training does and summarize their lengths.

    A DPO pair (format ``preference``, ``trainer.objectives.preference``) counts both of its sequences (the
    prompt with each answer) and both answers' loss tokens; it is over ``max_seq_len`` when either
    sequence is. Each record is checked against ``bounds`` before it is tokenized.

    Raises:
        InvalidInput: a record over ``bounds``, or one the tokenizer or template fails on (naming the line).
    """
    from trainer.data.dataset import read_records

    bounds = bounds or RecordBounds()
    records = read_records(path)
    capped = len(records) > MAX_RECORDS
    lengths: list[int] = []
    loss: list[int] = []
    over = 0
    for number, record in records[:MAX_RECORDS]:
        if progress is not None:
            progress("file", number)
        bounds.check(record, number, "file")
        sequences = _pair(record, tokenizer, number) if fmt == "preference" else (
            tokenized(record, fmt, tokenizer, number, "file"),)
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


def _pair(record: dict[str, Any], tokenizer: Any, number: int) -> tuple[Any, ...]:
    from trainer.objectives.preference import tokenize_pair

    try:
        return tokenize_pair(record, tokenizer).sequences
    except Exception as exc:  # noqa: BLE001 - a template that raises on this pair
        raise InvalidInput(f"file: line {number}: the model's tokenizer or chat template fails on this record "
                           f"({type(exc).__name__}: {exc}); the trainer would fail the same way", param="file") from None


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


def _token_stats_task(tokenizer: Any, path: str, fmt: str, max_seq_len: int, bounds: RecordBounds, *,
                      progress: Progress) -> dict[str, Any]:
    return token_stats(path, fmt, tokenizer, max_seq_len=max_seq_len, bounds=bounds, progress=progress)


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
