"""The one error of ``trainer.graders``."""

from __future__ import annotations


class GraderError(ValueError):
    """A grader that cannot be used, or an item it cannot grade; ``param`` names the field
    (``grader.operation``, ``grader.graders.exact.input``) so the API can answer 400 naming it."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
