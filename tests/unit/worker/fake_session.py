"""A stand-in for ``python -m trainer serve SESSION.json`` that the worker's unit tests drive (no torch).

Emits ``reply`` ``ready``, then answers each request line on stdin with ``accepted`` (prompt_tokens:
the prompt's words) and one ``delta`` (text ``ok``, finish_reason ``length``); after
``idle_timeout_s`` without a line it ends ``done`` succeeded (``idle: ...``); SIGTERM ends it
``done`` cancelled. Anything else on argv is refused.
"""

from __future__ import annotations

import json
import select
import signal
import sys
import time


def emit(type_: str, **payload: object) -> None:
    print(json.dumps({"type": type_, "time": time.time(), **payload}), flush=True)


def main() -> int:
    assert sys.argv[1] == "serve", sys.argv
    config = json.load(open(sys.argv[2]))
    stopped: list[int] = []
    signal.signal(signal.SIGTERM, lambda *_: stopped.append(1))
    emit("reply", kind="ready", adapters=["base"], max_len=config["max_len"], slots=config["slots"])
    last = time.monotonic()
    while not stopped:
        if time.monotonic() - last >= config["idle_timeout_s"]:
            emit("done", status="succeeded", error_code=None, message="idle: no request", adapter_path=None, steps=0)
            return 0
        ready, _, _ = select.select([sys.stdin], [], [], 0.05)
        if not ready:
            continue
        line = sys.stdin.readline()
        if not line:
            break
        message, last = json.loads(line), time.monotonic()
        if message["op"] == "request":
            emit("reply", kind="accepted", id=message["id"], prompt_tokens=len(message["prompt"].split()))
            emit("reply", kind="delta", id=message["id"], choice=0, text="ok", token_ids=[1], finish_reason="length",
                 logprobs=None)
    emit("done", status="cancelled", error_code=None, message="stopped", adapter_path=None, steps=0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
