"""``python -m trainer generate JOB.json``: a batch generation job (``trainer.generate.job``) as a process;
``python -m trainer serve SESSION.json``: a chat session (``trainer.generate.session``), requests on stdin.

As ``run``: JSON-line events on stdout (rank 0's), library prints sent to stderr, exit 0 when the
run succeeded or was cancelled, 1 when it failed, always ending with a ``done`` event. Error codes:

``config_error``   job.json does not parse, or its sampling parameters are refused
``invalid_input``  the prompts file cannot be read, or a prompt does not fit
``out_of_memory``  the device ran out of memory
``generate_error`` anything else (the message has the exception)
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from typing import Any

from trainer.events import Emitter
from trainer.generate.job_config import GenerateConfig


def add_parser(sub: Any) -> None:
    p = sub.add_parser("generate", help="complete a prompts file as a generation job.json says (JSON-lines events)")
    p.add_argument("job", help="path to job.json (trainer.generate.job_config.GenerateConfig)")
    add_serve_parser(sub)


def add_serve_parser(sub: Any) -> None:
    p = sub.add_parser("serve", help="answer chat requests (JSON lines on stdin) as a session.json says")
    p.add_argument("job", help="path to session.json (trainer.generate.session_config.SessionConfig)")


def serve_main(args: argparse.Namespace) -> int:
    """A session: ``done`` succeeded when it ended idle, cancelled when stopped, failed on an error."""
    from trainer.generate.session_config import SessionConfig

    emit = Emitter(sys.stdout)
    sys.stdout = sys.stderr
    try:
        config = SessionConfig.load(args.job)
    except (OSError, ValueError, TypeError) as exc:
        return _failed(emit, "config_error", f"{args.job}: {exc}")
    from trainer.model.imports import skip_bitsandbytes

    skip_bitsandbytes(quantized=False)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    from trainer.generate.job import _stop_on_signals
    from trainer.generate.session import IDLE, run_session

    try:
        with _stop_on_signals() as stop:
            ended = run_session(config, emit, sys.stdin, stop)
    except Exception as exc:  # noqa: BLE001 - every failure ends with a done event
        traceback.print_exc(file=sys.stderr)
        code = "out_of_memory" if "out of memory" in str(exc).lower() else "generate_error"
        return _failed(emit, code, f"{type(exc).__name__}: {exc}")
    status, message = (("succeeded", f"idle: no request for {config.idle_timeout_s:g} s") if ended == IDLE
                       else ("cancelled", "stopped: running requests drained"))
    emit("done", status=status, error_code=None, message=message, adapter_path=None, steps=0)
    return 0


def main(args: argparse.Namespace) -> int:
    return run_job(args.job, GenerateConfig, "trainer.generate.job:run_generation")


def run_job(job: str, config_type: type[GenerateConfig], runner: str) -> int:
    """Load ``job`` as ``config_type`` and run it with ``runner`` (``module:function``, imported
    after the config parses: torch loads only for a job that can run); the exit code."""
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    emit = Emitter(sys.stdout)
    sys.stdout = sys.stderr  # library prints must not interleave with events
    try:
        config = config_type.load(job)
    except (OSError, ValueError, TypeError) as exc:
        return _failed(emit, "config_error", f"{job}: {exc}")
    from trainer.model.imports import skip_bitsandbytes

    skip_bitsandbytes(quantized=False)  # bases load in bf16/fp32; before anything imports peft
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    import importlib

    from trainer.generate.prompts import PromptError

    module, _, name = runner.partition(":")
    run = getattr(importlib.import_module(module), name)
    try:
        status = run(config, emit)
    except PromptError as exc:
        return _failed(emit, "invalid_input", f"prompts_file: {exc}")
    except (ValueError, TypeError) as exc:
        code = "invalid_input" if "prompt" in str(exc) else "config_error"
        return _failed(emit, code, str(exc))
    except Exception as exc:  # noqa: BLE001 - every failure ends with a done event
        traceback.print_exc(file=sys.stderr)
        code = "out_of_memory" if "out of memory" in str(exc).lower() else "generate_error"
        return _failed(emit, code, f"{type(exc).__name__}: {exc}")
    message = None if status == "succeeded" else "stopped by a signal; resume continues at the first undone prompt"
    path = str(config.completions_path) if status == "succeeded" else None
    emit("done", status=status, error_code=None, message=message, adapter_path=None, steps=0, path=path)
    return 0


def _failed(emit: Emitter, code: str, message: str) -> int:
    emit("done", status="failed", error_code=code, message=message, adapter_path=None, steps=0, path=None)
    return 1

