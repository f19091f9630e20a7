"""Client commands: ``ftq chat MODEL`` and ``ftq sessions``.

``chat`` talks to a model through ``/openai/v1/chat/completions`` (streamed): MODEL is a base
under the model root, a job's ``fine_tuned_model`` (``ft:...``), one of its checkpoints
(``ft:...:ckpt-step-N``), or ``job:<id>`` / ``job:<id>@<step>`` (translated by asking
``/openai/v1/models``). Interactive: a REPL that keeps the conversation (``/reset`` forgets it,
``/exit`` or Ctrl-D ends); ``-m MESSAGE``: one turn, the answer on stdout, for scripts. The first
request for a model starts a session on a worker, and waits while it loads; a 503
``session_starting`` is retried after its ``Retry-After`` until ``--wait`` seconds have passed.

``sessions`` lists the live sessions (``--all``: ended ones too); ``sessions end ID`` ends one.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx

from cli import config
from cli.client import call, check, connect
from cli.errors import CliError


def add_parsers(commands: Any) -> None:
    p = commands.add_parser("chat", help="talk to a base or a tuned model (a chat session on a worker)")
    p.add_argument("model", help="a base, ft:... (a job's fine_tuned_model or checkpoint), job:<id> or job:<id>@<step>")
    p.add_argument("-m", "--message", help="send one message, print the answer and exit")
    p.add_argument("--system", help="a system prompt")
    p.add_argument("--max-tokens", type=int)
    p.add_argument("--temperature", type=float)
    p.add_argument("--top-p", type=float)
    p.add_argument("--seed", type=int)
    p.add_argument("--project", help="the project whose models and sessions to use (OpenAI-Project)")
    p.add_argument("--wait", type=float, default=600.0, help="seconds to wait for a new session to load (default 600)")
    p.set_defaults(run=run_chat)

    p = commands.add_parser("sessions", help="the chat sessions of your projects; `sessions end ID` ends one")
    p.add_argument("action", nargs="?", choices=("list", "end"), default="list")
    p.add_argument("session_id", nargs="?")
    p.add_argument("--all", action="store_true", help="ended sessions too")
    p.set_defaults(run=run_sessions)


def run_chat(args: argparse.Namespace) -> int:
    project = args.project or config.default_project()
    with connect() as client:
        if project:
            client.headers["OpenAI-Project"] = project
        model = resolve_model(client, args.model)
        messages: list[dict[str, str]] = [{"role": "system", "content": args.system}] if args.system else []
        if args.message is not None:
            messages.append({"role": "user", "content": args.message})
            answer = _turn(client, model, messages, args, sys.stdout)
            sys.stdout.write("\n" if not answer.endswith("\n") else "")
            return 0
        print(f"chatting with {model} (/reset forgets the conversation, /exit or Ctrl-D ends)", file=sys.stderr)
        return _repl(client, model, messages, args)


def _repl(client: httpx.Client, model: str, messages: list[dict[str, str]], args: argparse.Namespace) -> int:
    system = list(messages)
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        if line.strip() in ("/exit", "/quit"):
            return 0
        if line.strip() == "/reset":
            messages[:] = system
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        try:
            answer = _turn(client, model, messages, args, sys.stdout)
        except KeyboardInterrupt:
            messages.pop()
            print("\n(interrupted)", file=sys.stderr)
            continue
        print()
        messages.append({"role": "assistant", "content": answer})


def _turn(client: httpx.Client, model: str, messages: list[dict[str, str]], args: argparse.Namespace,
          out: Any) -> str:
    """Stream one answer to ``out``; returns its text."""
    body: dict[str, Any] = {"model": model, "messages": messages, "stream": True}
    for name in ("max_tokens", "temperature", "top_p", "seed"):
        if getattr(args, name) is not None:
            body[name] = getattr(args, name)
    parts = []
    for piece in stream_chat(client, body, args.wait):
        parts.append(piece)
        out.write(piece)
        out.flush()
    return "".join(parts)


def stream_chat(client: httpx.Client, body: dict[str, Any], wait_s: float) -> Iterator[str]:
    """The answer's text pieces as they stream; a loading session is waited for up to ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            with client.stream("POST", "/openai/v1/chat/completions", json=body,
                               timeout=httpx.Timeout(30, read=None)) as response:
                if response.status_code == 503 and time.monotonic() < deadline:
                    response.read()
                    pause = float(response.headers.get("retry-after", "5"))
                    print(f"(the model is loading; retrying in {pause:g} s)", file=sys.stderr)
                    time.sleep(pause)
                    continue
                if not response.is_success:
                    response.read()
                    check(response)
                yield from _pieces(response)
                return
        except httpx.TransportError as exc:
            raise CliError(f"cannot reach the ftq API at {client.base_url} ({exc})") from exc


def _pieces(response: httpx.Response) -> Iterator[str]:
    for line in response.iter_lines():
        if not line.startswith("data: "):
            continue
        data = line.removeprefix("data: ")
        if data == "[DONE]":
            return
        chunk = json.loads(data)
        if "error" in chunk:
            raise CliError(f"the session failed while answering: {chunk['error'].get('message')}")
        for choice in chunk.get("choices", []):
            if choice.get("index", 0) == 0 and choice.get("delta", {}).get("content"):
                yield choice["delta"]["content"]


def resolve_model(client: httpx.Client, model: str) -> str:
    """``job:<id>[@<step>]`` as the ``ft:`` name ``/openai/v1/models`` lists; anything else as it is."""
    if not model.startswith("job:"):
        return model
    job_id, _, step = model.removeprefix("job:").partition("@")
    suffix = f":{job_id}" + (f":ckpt-step-{step}" if step else "")
    names = [m["id"] for m in call(client, "GET", "/openai/v1/models").json()["data"]]
    found = [name for name in names if name.endswith(suffix)]
    if not found:
        raise CliError(f"{model}: no such model among yours (a job must have succeeded, or name one of its "
                       "checkpoints: job:<id>@<step>); `ftq jobs` lists jobs")
    return found[0]


def run_sessions(args: argparse.Namespace) -> int:
    with connect() as client:
        if args.action == "end":
            if not args.session_id:
                raise CliError("name the session: ftq sessions end ID")
            out = call(client, "DELETE", f"/v1/sessions/{args.session_id}").json()
            print(f"{out['id']} {out['status']}{' (draining)' if out['status'] == 'running' else ''}")
            return 0
        rows = call(client, "GET", "/v1/sessions", params={"all": "true"} if args.all else None).json()["data"]
        if not rows:
            print("no live sessions" if not args.all else "no sessions", file=sys.stderr)
        for row in rows:
            state = "ready" if row["ready"] else row["status"]
            print(f"{row['id']}  {state:<10} {', '.join(row['models'])}")
        return 0
