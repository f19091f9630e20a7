"""Trainer failures, each with the ``error_code`` its final ``done`` event carries.

    TrainerError (internal_error)
    ├── ConfigError (config_error, also a ValueError)
    │   └── PlanError: a switch set to ``on`` cannot run on this hardware / in this build
    ├── DatasetError (dataset_error, also a ValueError): a file or line that cannot be used
    └── ModelNotFoundError (model_not_found, also an OSError)

Other exceptions map by type in ``error_code``: out-of-memory errors to ``out_of_memory``,
anything else to ``internal_error``.
"""

from __future__ import annotations


class TrainerError(Exception):
    code = "internal_error"


class ConfigError(TrainerError, ValueError):
    code = "config_error"


class PlanError(ConfigError):
    """A switch set to ``on`` cannot run; the message names the hardware and the fix."""


class DatasetError(TrainerError, ValueError):
    code = "dataset_error"


class ModelNotFoundError(TrainerError, OSError):
    code = "model_not_found"


def error_code(exc: BaseException) -> str:
    """The ``done`` event's error code for an exception that ended a run."""
    if isinstance(exc, TrainerError):
        return exc.code
    if (
        isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError"
    ):  # torch.OutOfMemoryError
        return "out_of_memory"
    return "internal_error"
