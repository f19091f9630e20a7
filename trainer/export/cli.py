"""``python -m trainer export JOB.json --format merged|gguf --out DIR``: the export as a process.

Like ``run``: JSON-line events on stdout (``progress``, ``log``, one final ``done``), library
prints sent to stderr, exit 0 on success and 1 on failure. The ``done`` event carries ``path``
and ``bytes`` on success, an ``error_code`` and a ``message`` that says what to change otherwise:

``config_error``  job.json does not parse            ``unsupported``    the format cannot take this model
``not_found``     the run's weights are not on disk  ``out_of_memory``  the device ran out of memory
``export_error``  anything else (the message has the exception)
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from typing import Any

from trainer.catalog import DEFAULT_QUANTIZATION, EXPORT_FORMATS, QUANTIZATIONS
from trainer.config import TrainConfig
from trainer.events import Emitter


def add_parser(sub: Any) -> None:
    p = sub.add_parser("export", help="merge the run's adapter into its base (safetensors) or write a GGUF")
    p.add_argument("job", help="the run's job.json (trainer.config.TrainConfig)")
    p.add_argument("--format", required=True, choices=EXPORT_FORMATS)
    p.add_argument("--quantization", default=DEFAULT_QUANTIZATION,
                   help=f"gguf tensor type: {', '.join(QUANTIZATIONS)} (default {DEFAULT_QUANTIZATION})")
    p.add_argument("--out", required=True, help="directory to write (replaced when the export completes)")
    p.add_argument("--weights", help="adapter or model directory (default: the run's final one)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))


def main(args: argparse.Namespace) -> int:
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    emit = Emitter(sys.stdout)
    sys.stdout = sys.stderr  # library prints must not interleave with events
    try:
        config = TrainConfig.load(args.job)
    except (OSError, ValueError, TypeError) as exc:
        emit("done", status="failed", error_code="config_error", message=f"{args.job}: {exc}", path=None, bytes=0)
        return 1
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    from trainer.export.formats import run_export
    from trainer.export.gguf import GgufError

    try:
        result = run_export(config, args.format, args.out, emit, quantization=args.quantization,
                            device=args.device, weights=args.weights)
    except GgufError as exc:
        return _failed(emit, "unsupported", str(exc))
    except FileNotFoundError as exc:
        return _failed(emit, "not_found", str(exc))
    except Exception as exc:  # noqa: BLE001 - every failure ends with a done event
        traceback.print_exc(file=sys.stderr)
        code = "out_of_memory" if "out of memory" in str(exc).lower() else "export_error"
        return _failed(emit, code, f"{type(exc).__name__}: {exc}")
    emit("done", status="succeeded", error_code=None, message=None, path=str(result.path), bytes=result.bytes,
         seconds=round(result.seconds, 3), **_peaks())
    return 0


def _peaks() -> dict[str, int | None]:
    """This process's peak host RSS and peak CUDA memory (bytes; None without CUDA)."""
    import resource

    import torch

    gpu = torch.cuda.max_memory_allocated() if torch.cuda.is_initialized() else None
    return {"host_rss_peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "gpu_mem_peak": gpu}


def _failed(emit: Emitter, code: str, message: str) -> int:
    emit("done", status="failed", error_code=code, message=message, path=None, bytes=0)
    return 1
