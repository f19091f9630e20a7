"""``python -m trainer serve session.json``: a chat session, the sampler's ``Server`` answering
requests that arrive as JSON lines on stdin, its answers as ``reply`` events on stdout.

The worker (``worker.session_relay``) writes each request the API queued for the session to the
process's stdin and hands each ``reply`` back to the API, so the process needs no network, no
store and no credentials. Lines in:

``{"op": "request", "id": str, "adapter": str, "messages": [...] | "prompt": str, "params": {...}}``
    ``adapter``: a name of ``SessionConfig.adapters`` or ``BASE``; ``params``: the fields of
    ``trainer.generate.params.SamplingParams`` (``stop`` a string or a list; no ``max_tokens``:
    the room the context leaves, at most ``DEFAULT_MAX_TOKENS``)
``{"op": "cancel", "id": str}``  ends that request at the next step (a client that went away)

``reply`` events out (``kind``):

``ready``     once the model is loaded: adapters, max_len, slots
``accepted``  id, prompt_tokens: the request was tokenized and queued
``delta``     id, choice, text, token_ids, finish_reason (on a choice's last delta), logprobs
              ([{token_id, token, logprob, top: [[token, logprob], ...]}] when asked)
``error``     id, code (``context_length_exceeded``, ``invalid_value``, ``model_not_found``,
              ``session_ending``, ``generate_error``), param, message: the request ends

The session ends by itself with ``done`` status ``succeeded`` (message ``idle: ...``) after
``idle_timeout_s`` with nothing running or arriving; SIGTERM / SIGINT (a cancel or a preemption)
and the end of stdin (the worker went away) refuse new requests, let the running ones finish for
up to ``drain_s``, cancel what is left and end it ``cancelled``. Prompts and outputs go only to
stdout's replies, never to stderr or a log event.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from typing import IO, Any, Callable

import torch

from trainer.generate.chat import render_messages
from trainer.generate.engine import Engine
from trainer.generate.params import BASE_ADAPTER, Request, SamplingParams, TokenLogprob
from trainer.generate.serve import Server, Stream
from trainer.generate.session_config import BASE, SessionConfig

Emit = Callable[..., Any]
IDLE, STOPPED = "idle", "stopped"
DEFAULT_MAX_TOKENS = 1024
"""New tokens of a request that sets no ``max_tokens``: the context's room, at most this."""


class RequestError(ValueError):
    """A request the session refuses: its reply's code, param and message."""

    def __init__(self, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code, self.param = code, param


class Session:
    """The requests of one session over one ``Server``; ``handle`` takes each stdin line's message."""

    def __init__(self, config: SessionConfig, server: Server, tokenizer: Any, emit: Emit, *,
                 peft: bool) -> None:
        self.config, self.server, self.tokenizer, self.emit, self.peft = config, server, tokenizer, emit, peft
        self._lock = threading.Lock()
        self._streams: dict[str, Stream] = {}
        self.closing = False
        self.last_activity = time.monotonic()

    @property
    def running(self) -> int:
        with self._lock:
            return len(self._streams)

    def idle_for(self) -> float:
        """Seconds since the last request arrived or ended; 0 while one runs."""
        return 0.0 if self.running else time.monotonic() - self.last_activity

    def handle(self, message: dict[str, Any]) -> None:
        request_id = str(message.get("id", ""))
        if message.get("op") == "cancel":
            with self._lock:
                stream = self._streams.get(request_id)
            if stream is not None:
                stream.cancel()
            return
        self.last_activity = time.monotonic()
        try:
            if self.closing:
                raise RequestError("session_ending", "the session is ending; send the request again to start another")
            request = self.build(message)
            stream = self.server.submit(request)
        except RequestError as exc:
            self.emit("reply", kind="error", id=request_id, code=exc.code, param=exc.param, message=str(exc))
            return
        except (ValueError, RuntimeError) as exc:
            self.emit("reply", kind="error", id=request_id, code="generate_error", param=None, message=str(exc))
            return
        with self._lock:
            self._streams[request_id] = stream
        self.emit("reply", kind="accepted", id=request_id, prompt_tokens=len(request.prompt_ids))
        threading.Thread(target=self._pump, args=(request_id, stream), name=f"reply-{request_id[:12]}",
                         daemon=True).start()

    def build(self, message: dict[str, Any]) -> Request:
        """The sampler's request for ``message``; ``RequestError`` naming the field otherwise."""
        adapter = message.get("adapter") or BASE
        if adapter != BASE and adapter not in self.config.adapters:
            raise RequestError("model_not_found", f"this session serves no adapter {adapter!r}", "model")
        raw = dict(message.get("params") or {})
        unbounded = raw.get("max_tokens") is None
        if unbounded:
            raw.pop("max_tokens", None)
        if isinstance(raw.get("stop"), str):
            raw["stop"] = (raw["stop"],)
        elif "stop" in raw:
            raw["stop"] = tuple(raw["stop"] or ())
        try:
            params = SamplingParams(**raw)
        except (TypeError, ValueError) as exc:
            param = str(exc).split(":", 1)[0] if ":" in str(exc) else None
            raise RequestError("invalid_value", str(exc), param) from exc
        field = "messages" if "messages" in message else "prompt"
        try:
            ids = (render_messages(self.tokenizer, message["messages"]) if field == "messages"
                   else self.tokenizer(str(message.get("prompt", "")))["input_ids"])
        except ValueError as exc:
            raise RequestError("invalid_value", str(exc), field) from exc
        if unbounded and len(ids) < self.config.max_len:  # what is left of the context, as OpenAI's chat does
            params = dataclasses.replace(params, max_tokens=min(self.config.max_len - len(ids), DEFAULT_MAX_TOKENS))
        if len(ids) + params.max_tokens > self.config.max_len:
            raise RequestError(
                "context_length_exceeded",
                f"This model's maximum context length is {self.config.max_len} tokens. However, you requested "
                f"{len(ids) + params.max_tokens} tokens ({len(ids)} in the {field}, {params.max_tokens} for the "
                "completion). Please reduce the length of the messages or the completion.", field)
        if not ids:
            raise RequestError("invalid_value", f"{field}: empty after tokenization", field)
        name = (BASE_ADAPTER if adapter == BASE else adapter) if self.peft else None
        return Request(tuple(ids), params, adapter=name)

    def _pump(self, request_id: str, stream: Stream) -> None:
        try:
            for delta in stream:
                self.emit("reply", kind="delta", id=request_id, choice=delta.choice, text=delta.text,
                          token_ids=delta.token_ids, finish_reason=delta.finish_reason,
                          logprobs=self._logprobs(delta.logprobs))
        except BaseException as exc:  # noqa: BLE001 - the request's client is told, the session goes on
            self.emit("reply", kind="error", id=request_id, code="generate_error", param=None,
                      message=f"{type(exc).__name__}: {exc}")
        finally:
            with self._lock:
                self._streams.pop(request_id, None)
            self.last_activity = time.monotonic()

    def _logprobs(self, entries: list[TokenLogprob] | None) -> list[dict[str, Any]] | None:
        if entries is None:
            return None
        token = self._token_text
        return [{"token_id": e.token_id, "token": token(e.token_id), "logprob": e.logprob,
                 "top": [[token(t), lp] for t, lp in e.top]} for e in entries]

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else str(token_id)

    def drain(self, seconds: float) -> None:
        """Refuse new requests and wait up to ``seconds`` for the running ones."""
        self.closing = True
        deadline = time.monotonic() + seconds
        while self.running and time.monotonic() < deadline:
            time.sleep(0.05)


def run_session(config: SessionConfig, emit: Emit, inbox: IO[str], stop: threading.Event,
                *, poll_s: float = 0.1) -> str:
    """Serve until idle (returns ``IDLE``) or stopped by ``stop`` or the end of ``inbox`` (``STOPPED``)."""
    from trainer.generate.job import _device_type

    device = torch.device(_device_type(config.device))
    model, tokenizer = load_session_model(config, device)
    engine = Engine(model, tokenizer, slots=config.slots, max_len=config.max_len, device=device, cuda_graphs="auto")
    server = Server(engine).start()
    session = Session(config, server, tokenizer, emit, peft=bool(config.adapters))
    ended = threading.Event()
    threading.Thread(target=_read, args=(inbox, session, ended), name="session-inbox", daemon=True).start()
    emit("log", level="info", message=f"session ready on {device}: {config.model}"
         + (f" + adapters {', '.join(sorted(config.adapters))}" if config.adapters else ""))
    emit("reply", kind="ready", adapters=[BASE, *config.adapters], max_len=config.max_len, slots=config.slots)
    try:
        while not (stop.is_set() or ended.is_set()):
            if session.idle_for() >= config.idle_timeout_s:
                return IDLE
            stop.wait(poll_s)
        session.drain(config.drain_s)
        return STOPPED
    finally:
        server.close()


def _read(inbox: IO[str], session: Session, ended: threading.Event) -> None:
    for line in inbox:
        if line.strip():
            try:
                session.handle(json.loads(line))
            except ValueError:
                continue  # not JSON: nobody to answer
    ended.set()


def load_session_model(config: SessionConfig, device: torch.device) -> tuple[Any, Any]:
    """The base on ``device`` in eval mode with every adapter loaded under its name, unmerged, and
    the trainer's kernels (``trainer.generate.kernels``: fused LoRA layers, fused ops)."""
    from trainer.generate.job import load_base

    model, tokenizer, _ = load_base(config.model, config.dtype, config.trust_remote_code, device, config.tokenizer)
    if config.adapters:
        import warnings

        from peft import PeftModel

        (first, path), *rest = config.adapters.items()
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            model = PeftModel.from_pretrained(model, path, adapter_name=first)
            for name, other in rest:
                model.load_adapter(other, adapter_name=name)
        model.set_adapter(first)
    from trainer.generate import kernels

    kernels.install(model)
    return model.eval(), tokenizer
