"""Plain helpers the dashboard tests share (not fixtures; those are in conftest.py): the model
name, a proxy that can drop every connection at once, where screenshots go."""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path

MODEL = "tiny-llama"


def screenshot_dir() -> Path | None:
    raw = os.environ.get("FTQ_DASHBOARD_SCREENSHOTS")
    if not raw:
        return None
    path = Path(raw)
    path.mkdir(parents=True, exist_ok=True)
    return path


class CuttableProxy:
    """Forwards 127.0.0.1:<port> to the API; ``cut()`` closes every open connection at once."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self.cuts = 0
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def cut(self) -> None:
        with self._lock:
            sockets, self._sockets = self._sockets, []
            self.cuts += 1
        for sock in sockets:
            _close(sock)

    def close(self) -> None:
        _close(self._listener)
        self.cut()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=10)
                upstream.settimeout(None)
            except OSError:
                _close(client)
                continue
            with self._lock:
                self._sockets += [client, upstream]
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while chunk := src.recv(65536):
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            _close(src)
            _close(dst)


def _close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


def cancel_and_wait(api, job_id: str, timeout: float = 120.0) -> None:
    """Cancel ``job_id`` and wait until it is ``cancelled``: a queued job is removed at once (200),
    one the worker already claimed stops after its current step (202)."""
    import time

    response = api.post(f"/v1/jobs/{job_id}/cancel")
    assert response.status_code in (200, 202), response.text
    deadline = time.monotonic() + timeout
    while api.get(f"/v1/jobs/{job_id}").json()["status"] != "cancelled":
        assert time.monotonic() < deadline, f"{job_id} not cancelled after {timeout} s"
        time.sleep(0.2)
