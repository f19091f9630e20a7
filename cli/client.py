"""The HTTP side of the client commands: one ``httpx.Client`` on the API, errors made readable.

The API is found at ``FTQ_API_URL``, else the config file's ``api_url``, else
``http://FTQ_HOST:FTQ_PORT`` (the local ``ftq up``). The key, ``FTQ_API_KEY`` or the config
file's ``api_key`` (``cli/config.py``; ``ftq login`` writes it), is sent as
``Authorization: Bearer``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from cli import config, hints
from cli.errors import CliError


def api_url() -> str:
    url = os.environ.get("FTQ_API_URL")
    if url:
        return url.rstrip("/")
    url = config.configured_url()
    if url:
        return url.rstrip("/")
    host = os.environ.get("FTQ_HOST", "127.0.0.1")
    host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    return f"http://{host}:{os.environ.get('FTQ_PORT', '8000')}"


def connect(base_url: str | None = None, api_key: str | None = None) -> httpx.Client:
    """A client on the API (``base_url`` or ``api_url()``) sending ``api_key`` or the configured key."""
    headers = {}
    key = api_key or config.api_key()
    if key:
        headers["Authorization"] = f"Bearer {key}"
    return httpx.Client(base_url=base_url or api_url(), headers=headers, timeout=httpx.Timeout(30, read=120))


def call(client: httpx.Client, method: str, path: str, **kwargs: Any) -> httpx.Response:
    """Send a request; a transport failure or an API error becomes a ``CliError`` with its message."""
    try:
        response = client.request(method, path, **kwargs)
    except httpx.TransportError as exc:
        raise CliError(f"cannot reach the ftq API at {client.base_url} ({exc}); start it with `ftq up` "
                       "or set FTQ_API_URL") from exc
    check(response)
    return response


def download(client: httpx.Client, path: str, out: Path) -> None:
    """Stream ``GET path`` to ``out``, through ``out.part`` renamed when complete (an API error: a
    ``CliError``, and no file left)."""
    part = out.with_name(out.name + ".part")
    try:
        with client.stream("GET", path) as response:
            if not response.is_success:
                response.read()
                check(response)
            with part.open("wb") as f:
                for chunk in response.iter_bytes():
                    f.write(chunk)
        part.replace(out)
    finally:
        part.unlink(missing_ok=True)


def check(response: httpx.Response) -> None:
    """Raise a ``CliError`` for an API error: its message, route hints said as ``ftq`` commands
    (``cli/hints.py``), and for a 401 where the key came from and how to get one."""
    if response.is_success:
        return
    try:
        error = response.json()["error"]
        where = f" ({error['param']})" if error.get("param") else ""
        detail = f"{hints.translate(error['message'])}{where}"
    except (ValueError, KeyError, TypeError):
        detail = response.text[:500]
    if response.status_code == 401:
        detail = key_hint(response.request, detail)
    raise CliError(f"{response.request.method} {response.request.url.path} → {response.status_code}: {detail}")


GET_A_KEY = ("the first `ftq up` on the box prints the admin key and saves it for the CLI; with a key, "
             "run `ftq login --key KEY` or export FTQ_API_KEY=KEY; an admin makes keys with "
             "`ftq users create NAME` (or `ftq users key NAME`)")


def key_hint(request: httpx.Request, detail: str) -> str:
    """A refused request's message with where its key came from (or that none was found) and how to get one."""
    sent = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
    path = config.config_path()
    if not sent:
        where = "has no api_key" if path.exists() else "does not exist"
        return f"no API key: FTQ_API_KEY is not set and the config file {path} {where}; {GET_A_KEY}"
    if sent == os.environ.get("FTQ_API_KEY"):
        source = "FTQ_API_KEY"
    elif path.exists() and sent == config.load_config(path).get("api_key"):
        source = str(path)
    else:
        source = "the command line"
    return f"{detail} (the key from {source}; {GET_A_KEY})"


def sse_events(response: httpx.Response) -> Iterator[tuple[int, str, dict[str, Any]]]:
    """``(id, event, data)`` for each event of a Server-Sent-Events response."""
    fields: dict[str, str] = {}
    for line in response.iter_lines():
        if not line:
            if "id" in fields and "data" in fields:
                yield int(fields["id"]), fields.get("event", "message"), json.loads(fields["data"])
            fields = {}
        elif not line.startswith(":"):
            key, _, value = line.partition(":")
            fields[key] = value.removeprefix(" ")
