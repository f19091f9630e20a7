"""A stand-in for the Hugging Face hub's file metadata endpoint, for submission checks offline.

The tests cannot reach huggingface.co. ``FakeHub`` answers what ``huggingface_hub``'s
``get_hf_file_metadata`` asks (``HEAD /{repo}/resolve/main/config.json``) the way the hub does:
200 with the commit, etag and size headers for a repository it holds, 404 with
``X-Error-Code: RepoNotFound`` for any other. Point ``HF_ENDPOINT`` at ``url``.
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class FakeHub:
    def __init__(self, repos: set[str]) -> None:
        repos_known = repos

        class Handler(BaseHTTPRequestHandler):
            def do_HEAD(self) -> None:  # noqa: N802 - http.server's name
                repo, sep, _ = self.path.lstrip("/").partition("/resolve/")
                if sep and repo in repos_known:
                    self.send_response(200)
                    self.send_header("X-Repo-Commit", "0" * 40)
                    self.send_header("ETag", '"abc"')
                    self.send_header("Content-Length", "2")
                else:
                    self.send_response(404)
                    self.send_header("X-Error-Code", "RepoNotFound")
                    self.send_header("X-Error-Message", "Repository not found")
                    self.send_header("Content-Length", "0")
                self.end_headers()

            do_GET = do_HEAD  # noqa: N815

            def log_message(self, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> FakeHub:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
