"""A stand-in for the Hugging Face hub on localhost, in the hub's URL layout. Point ``HF_ENDPOINT`` at ``url``.

The tests cannot reach huggingface.co. ``FakeHub`` answers what ``huggingface_hub`` and
``ftq models pull`` ask, the way the hub does:

- ``HEAD|GET /{repo}/resolve/{revision}/{file}``: the file, with ``X-Repo-Commit``, ``ETag`` and
  ``Content-Length``; a ``Range: bytes=N-`` request gets ``206`` and the rest (``get_hf_file_metadata``
  at submission; the pull's downloads);
- ``GET /api/models/{repo}[/revision/{revision}]``: the model info, ``sha`` and ``siblings`` with
  sizes, git blob ids and, for ``*.safetensors``, the LFS SHA-256 (``HfApi.model_info``);
- 404 with ``X-Error-Code: RepoNotFound`` for a repository it does not hold,
  ``RevisionNotFound`` or ``EntryNotFound`` for a revision or file it does not have.

``FakeHub({"org/name"})`` holds a repository with a 2-byte config.json (enough for the metadata
probe); ``add`` puts a repository's files at a revision. ``requests`` logs each request as
``(method, path, Range header)``; ``cut(file, after)`` makes the next download of ``file`` stop
after ``after`` bytes with the connection closed, as a dropped network does.
"""

from __future__ import annotations

import hashlib
import json
import socket
import threading
from collections.abc import Iterable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit


class FakeHub:
    def __init__(self, repos: Iterable[str] = ()) -> None:
        self.commits: dict[tuple[str, str], dict[str, bytes]] = {}
        """(repo, commit) -> file name -> content."""
        self.refs: dict[tuple[str, str], str] = {}
        """(repo, branch or tag) -> commit."""
        self.requests: list[tuple[str, str, str | None]] = []
        self._cuts: dict[str, int] = {}
        self._lock = threading.Lock()
        for repo in repos:
            self.add(repo, {"config.json": b"{}"})
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def add(self, repo: str, files: Mapping[str, bytes], revision: str = "main") -> str:
        """Hold ``files`` as ``repo`` at branch or tag ``revision``; returns the commit."""
        commit = hashlib.sha1(f"{repo}@{revision}".encode()).hexdigest()
        with self._lock:
            self.commits[(repo, commit)] = dict(files)
            self.refs[(repo, revision)] = commit
        return commit

    def cut(self, name: str, after: int) -> None:
        """The next download of ``name`` sends ``after`` bytes and closes the connection."""
        with self._lock:
            self._cuts[name] = after

    def downloads(self, name: str) -> list[str | None]:
        """The ``Range`` header of each GET of a file named ``name`` (None: the whole file)."""
        return [rng for method, path, rng in self.requests if method == "GET" and "/resolve/" in path
                and path.rsplit("/", 1)[-1] == name]

    def resolve(self, repo: str, revision: str) -> str | None:
        if (repo, revision) in self.commits:
            return revision
        return self.refs.get((repo, revision))

    def has_repo(self, repo: str) -> bool:
        return any(r == repo for r, _ in self.refs)

    def take_cut(self, name: str) -> int | None:
        with self._lock:
            return self._cuts.pop(name, None)

    def __enter__(self) -> FakeHub:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()


def model_info(repo: str, commit: str, files: Mapping[str, bytes]) -> dict[str, object]:
    """``GET /api/models/{repo}/revision/{revision}?blobs=true`` as the hub answers it."""
    siblings = []
    for name, content in sorted(files.items()):
        sibling: dict[str, object] = {"rfilename": name, "size": len(content),
                                      "blobId": hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()}
        if name.endswith(".safetensors"):
            sibling["lfs"] = {"sha256": hashlib.sha256(content).hexdigest(), "size": len(content), "pointerSize": 134}
        siblings.append(sibling)
    return {"_id": commit[:24], "id": repo, "modelId": repo, "sha": commit, "private": False, "gated": False,
            "disabled": False, "downloads": 0, "likes": 0, "tags": [], "siblings": siblings}


def _handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_HEAD(self) -> None:  # noqa: N802 - http.server's name
            self._answer(body=False)

        def do_GET(self) -> None:  # noqa: N802
            self._answer(body=True)

        def _answer(self, body: bool) -> None:
            path = unquote(urlsplit(self.path).path)
            hub.requests.append((self.command, path, self.headers.get("Range")))
            if path.startswith("/api/models/"):
                self._model_info(path.removeprefix("/api/models/"))
                return
            repo, sep, rest = path.lstrip("/").partition("/resolve/")
            revision, _, name = rest.partition("/")
            if not sep or not hub.has_repo(repo):
                self._error(404, "RepoNotFound", "Repository not found")
                return
            commit = hub.resolve(repo, revision)
            if commit is None:
                self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
                return
            files = hub.commits[(repo, commit)]
            if name not in files:
                self._error(404, "EntryNotFound", f"{name} does not exist")
                return
            self._file(files[name], commit, name, body)

        def _model_info(self, rest: str) -> None:
            repo, sep, revision = rest.partition("/revision/")
            repo = repo if sep else rest
            if not hub.has_repo(repo):
                self._error(404, "RepoNotFound", "Repository not found")
                return
            commit = hub.resolve(repo, revision if sep else "main")
            if commit is None:
                self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
                return
            raw = json.dumps(model_info(repo, commit, hub.commits[(repo, commit)])).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def _file(self, content: bytes, commit: str, name: str, body: bool) -> None:
            start = 0
            rng = self.headers.get("Range")
            if rng and rng.startswith("bytes=") and rng.endswith("-"):
                start = int(rng.removeprefix("bytes=").removesuffix("-"))
            self.send_response(206 if start else 200)
            self.send_header("X-Repo-Commit", commit)
            self.send_header("ETag", f'"{hashlib.sha256(content).hexdigest()}"')
            self.send_header("Content-Length", str(len(content) - start))
            if start:
                self.send_header("Content-Range", f"bytes {start}-{len(content) - 1}/{len(content)}")
            self.end_headers()
            if not body:
                return
            cut = hub.take_cut(name)
            if cut is None:
                self.wfile.write(content[start:])
                return
            self.wfile.write(content[start:start + cut])
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_RDWR)  # the network drops mid-file
            self.close_connection = True

        def _error(self, status: int, code: str, message: str) -> None:
            self.send_response(status)
            self.send_header("X-Error-Code", code)
            self.send_header("X-Error-Message", message)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    return Handler
