"""The archives the API packs for a download (checkpoints, adapters, exports, a worker's
artifacts): temporary files under ``<data_dir>/tmp``, removed however the response ends.

Starlette's ``FileResponse`` runs a ``BackgroundTask`` only after a response that went through:
a ``Range`` the file cannot satisfy (416) or a malformed one (400) returns before it, and a
client that disconnects mid-body raises past it, so each left its archive behind (issue 23).
``TemporaryFileResponse`` removes the file in a ``finally``; what a crash leaves is removed at
the API's start (``sweep_temporaries``).
"""

from __future__ import annotations

import time
from pathlib import Path

from fastapi.responses import FileResponse
from starlette.types import Receive, Scope, Send

from core.settings import Settings

STALE_S = 3600.0
"""A temporary archive this old at the API's start belongs to no response any more."""


def temporaries_dir(settings: Settings) -> Path:
    return settings.data_dir / "tmp"


class TemporaryFileResponse(FileResponse):
    """A ``FileResponse`` that removes its file once sent, refused, or cut off."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            Path(self.path).unlink(missing_ok=True)  # a syscall: no thread, so a cancelled response removes it too


def sweep_temporaries(settings: Settings, *, older_than_s: float = STALE_S) -> list[Path]:
    """Remove the temporary archives a crashed API left; returns what was removed. Younger ones
    may be another API process's, about to be sent (once open, removing one would not matter)."""
    cutoff = time.time() - older_than_s
    removed = []
    for path in temporaries_dir(settings).glob("*"):
        try:
            if path.is_file() and not path.is_symlink() and path.lstat().st_mtime < cutoff:
                path.unlink()
                removed.append(path)
        except OSError:  # gone meanwhile
            continue
    return removed
