"""A serving loop over one ``Engine``: requests arrive from other threads while others decode, and
each streams its tokens as they are drawn (what a chat session runs, issue 26).

``Server(engine).start()`` runs the engine's steps in a thread of its own, over one scheduler that
lives as long as the server (``Engine.scheduler``, ``Engine.running``): ``submit(request)`` queues a
request behind the running ones (it is admitted into a free slot at the next step, as in
``generate``'s continuous batching) and returns its ``Stream``, an iterator of ``Delta``s: after
each step, every choice that drew a token gets one, with its new ids, the text they add, and on
its last delta the finish reason. ``Stream.cancel()`` ends the request at the next step (its
slots free, finish reason ``cancelled``); a client that goes away cancels this way. ``close()``
cancels whatever runs and stops the thread.

Text deltas: the completion's text is the tokenizer's decode of all its ids (the same text
``generate`` returns); each delta is what that text gained since the last one. Text that may still
change is held back: a trailing replacement character (a multi-byte character split between
tokens) and, for a request with ``stop`` strings, the last ``len(longest stop) - 1`` characters (a
stop string being completed is cut from the text, and must not have been streamed). The final
delta releases the rest, cut at the stop string. So the deltas of a choice always concatenate to
its final text.

Only the server's thread touches the model, the cache and the scheduler; other threads talk to it
through a lock-guarded inbox and each stream's queue. A request the scheduler refuses (a prompt
that leaves no room in ``max_len``) raises ``ValueError`` from ``submit``; an error inside a step
ends every running stream with that error (raised from its iterator) and the server stops: the
session's owner restarts it.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from trainer.generate.engine import Engine
from trainer.generate.params import Request, TokenLogprob
from trainer.generate.scheduler import Scheduler, Sequence

FINISH_CANCELLED = "cancelled"
_REPLACEMENT = "\ufffd"


@dataclass(frozen=True)
class Delta:
    """What one step added to one choice of a request."""

    choice: int
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    """Set on the choice's last delta (``stop``, ``length`` or ``cancelled``)."""
    logprobs: list[TokenLogprob] | None = None
    """One per new id, when the request asked for logprobs."""


class Stream:
    """One request's deltas, in order; iterating ends when every choice has finished."""

    def __init__(self, server: Server, request: Request) -> None:
        self.request, self._server = request, server
        self._queue: queue.Queue[Delta | BaseException] = queue.Queue()
        self.index: int | None = None
        """The request's index in the server's scheduler (set when the server takes it)."""

    def __iter__(self) -> Iterator[Delta]:
        open_choices = self.request.params.n
        while open_choices:
            item = self._queue.get()
            if isinstance(item, BaseException):
                raise item
            if item.finish_reason is not None:
                open_choices -= 1
            yield item

    def cancel(self) -> None:
        self._server.cancel(self)


@dataclass
class _Progress:
    """What a choice has streamed: its ids so far, the decode window, the text sent and held back."""

    tokens: int = 0
    prefix: int = 0
    read: int = 0
    sent: str = ""
    held: str = ""

    def advance(self, seq: Sequence, final: bool) -> str:
        """The text to send now (see the module docstring)."""
        if final:
            text = seq.stopper.decode(seq.tokens)  # the whole text once, cut at a stop string
            delta = text[len(self.sent):] if text.startswith(self.sent) else ""
            self.sent += delta
            return delta
        decode = seq.stopper.tokenizer.decode if seq.stopper.tokenizer is not None else None
        if decode is not None:
            before = decode(seq.tokens[self.prefix:self.read], skip_special_tokens=True)
            after = decode(seq.tokens[self.prefix:], skip_special_tokens=True)
            if len(after) > len(before) and not after.endswith(_REPLACEMENT):
                self.held += after[len(before):]
                self.prefix, self.read = self.read, len(seq.tokens)
        keep = max(len(stop) for stop in seq.params.stop) - 1 if seq.params.stop else 0
        cut = max(len(self.held) - keep, 0)
        delta, self.held = self.held[:cut], self.held[cut:]
        self.sent += delta
        return delta


@dataclass
class _Inbox:
    submitted: list[Stream] = field(default_factory=list)
    cancelled: list[Stream] = field(default_factory=list)
    closing: bool = False


class Server:
    """Runs ``engine``'s continuous batching for requests submitted from any thread."""

    def __init__(self, engine: Engine, *, idle_wait: float = 0.5) -> None:
        self.engine = engine
        self.idle_wait = idle_wait
        self._inbox = _Inbox()
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None
        self._streams: dict[int, Stream] = {}
        self._open: dict[int, int] = {}
        """Choices of each stream not finished yet."""
        self._progress: dict[tuple[int, int], _Progress] = {}
        self.error: BaseException | None = None

    def start(self) -> Server:
        self._thread = threading.Thread(target=self._run, name="ftq-sampler", daemon=True)
        self._thread.start()
        return self

    def submit(self, request: Request) -> Stream:
        """Queue ``request``; its ``Stream`` yields its deltas.

        Raises:
            ValueError: the prompt leaves no room in the engine's ``max_len``.
            RuntimeError: the server is closed or stopped on an error.
        """
        if len(request.prompt_ids) >= self.engine.max_len:
            raise ValueError(
                f"a prompt of {len(request.prompt_ids)} tokens leaves no room in max_len={self.engine.max_len}; "
                "shorten the prompt"
            )
        stream = Stream(self, request)
        with self._wake:
            if self._inbox.closing or self.error is not None:
                raise RuntimeError(f"the sampler is not running{f': {self.error}' if self.error else ''}")
            self._inbox.submitted.append(stream)
            self._wake.notify()
        return stream

    def cancel(self, stream: Stream) -> None:
        with self._wake:
            self._inbox.cancelled.append(stream)
            self._wake.notify()

    def close(self, timeout: float = 30.0) -> None:
        """Cancel every request and stop the thread."""
        with self._wake:
            self._inbox.closing = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        scheduler = self.engine.scheduler()
        try:
            with self.engine.running() as step:
                while self._take_inbox(scheduler):
                    if scheduler.busy:
                        step(scheduler)
                    self._publish(scheduler)
        except BaseException as exc:  # noqa: BLE001 - handed to every open stream
            self.error = exc
            for stream in self._streams.values():
                stream._queue.put(exc)
            self._streams.clear()

    def _take_inbox(self, scheduler: Scheduler) -> bool:
        """Move submissions and cancels into the scheduler; wait while there is nothing to do.
        False when the server closes (everything left is cancelled and published)."""
        with self._wake:
            if not (scheduler.busy or self._inbox.submitted or self._inbox.cancelled or self._inbox.closing):
                self._wake.wait(self.idle_wait)
            inbox, self._inbox = self._inbox, _Inbox(closing=self._inbox.closing)
        for stream in inbox.submitted:
            stream.index = scheduler.add(stream.request)
            self._streams[stream.index] = stream
            self._open[stream.index] = stream.request.params.n
        for stream in inbox.cancelled:
            if stream.index is not None and stream.index in self._streams:
                scheduler.cancel(stream.index, FINISH_CANCELLED)
        if inbox.closing:
            for index in list(self._streams):
                scheduler.cancel(index, FINISH_CANCELLED)
            self._publish(scheduler)
            return False
        return True

    def _publish(self, scheduler: Scheduler) -> None:
        """Hand each running or finished choice's news to its stream."""
        for seq in scheduler.running.values():
            self._send(seq, final=False)
        for seq in scheduler.done:
            self._send(seq, final=True)
            self._progress.pop((seq.request, seq.choice), None)
            self._open[seq.request] = self._open.get(seq.request, 1) - 1
            if self._open[seq.request] <= 0:
                self._streams.pop(seq.request, None)
                self._open.pop(seq.request, None)
        scheduler.done.clear()

    def _send(self, seq: Sequence, final: bool) -> None:
        stream = self._streams.get(seq.request)
        if stream is None:
            return
        progress = self._progress.setdefault((seq.request, seq.choice), _Progress())
        new_ids = seq.tokens[progress.tokens:]
        if not new_ids and not final:
            return
        text = progress.advance(seq, final)
        logprobs = seq.logprobs[progress.tokens:] if seq.params.logprobs else None
        progress.tokens = len(seq.tokens)
        stream._queue.put(Delta(seq.choice, list(new_ids), text, seq.finish_reason if final else None, logprobs))


def serve(engine: Engine, **kwargs: Any) -> Server:
    """``Server(engine, **kwargs).start()``."""
    return Server(engine, **kwargs).start()
