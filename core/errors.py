"""Domain errors shared by the API and the worker. Free of HTTP: ``api/errors.py`` maps them.

    FtqError
    ├── NotFound            an id that names nothing (job, file, checkpoint)
    ├── InvalidInput        a request or file that cannot be accepted; says what to fix
    │   ├── InvalidDataset  a dataset line that does not parse (line number + reason)
    │   ├── TooLarge        an upload over the size limit
    │   ├── Unsupported     a valid request this box cannot run
    │   ├── ChecksumMismatch  a transfer whose bytes do not match their sha256 or length
    │   └── UnsafeArchive   an uploaded tar with a member that could land outside its directory
    ├── Conflict            the object is in a state that forbids the action
    ├── Unauthenticated     no valid API key (missing, unknown, revoked, disabled user)
    ├── Forbidden           a valid caller who may not do this (someone else's job, admin-only)
    └── Unavailable         a dependency (store, broker) cannot be reached
"""

from __future__ import annotations


class FtqError(Exception):
    code = "error"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class NotFound(FtqError):
    code = "not_found"


class ModelNotFound(NotFound):
    """A model name nobody may use, or the caller may not (alike): OpenAI's ``model_not_found``."""

    code = "model_not_found"


class InvalidInput(FtqError):
    code = "invalid_input"


class InvalidDataset(InvalidInput):
    code = "invalid_dataset"

    def __init__(self, message: str, *, line: int | None = None, param: str | None = None) -> None:
        super().__init__(message, param=param)
        self.line = line


class Conflict(FtqError):
    code = "conflict"


class Unauthenticated(FtqError):
    """The request carries no valid API key (HTTP 401).

    ``key_id``: the public id (``ftq_<prefix>``, ``ftqw_<prefix>``) of a stored key the request
    named and that was refused (wrong secret, revoked, disabled user); None when no stored key
    has that id, or the key is missing or malformed. ``api.auth_throttle`` counts by it.
    """

    code = "unauthenticated"

    def __init__(self, message: str, *, param: str | None = None, key_id: str | None = None) -> None:
        super().__init__(message, param=param)
        self.key_id = key_id


class Forbidden(FtqError):
    """The caller is known but may not do this (HTTP 403); the message names who may."""

    code = "forbidden"


class Unavailable(FtqError):
    code = "unavailable"


class TooLarge(InvalidInput):
    """An upload over ``FTQ_MAX_UPLOAD_BYTES`` (HTTP 413)."""

    code = "too_large"


class Unsupported(InvalidInput):
    """A valid request for something this box cannot run (e.g. qlora without bitsandbytes)."""

    code = "unsupported"


class ChecksumMismatch(InvalidInput):
    """A transfer whose bytes differ from the sha256 (or length) it was sent with: truncated or
    corrupted on the way; the sender retries."""

    code = "checksum_mismatch"


class UnsafeArchive(InvalidInput):
    """An uploaded tar with an absolute or ``..`` member, a link, a device or a fifo."""

    code = "unsafe_archive"
