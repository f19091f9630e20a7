"""A generation job's output as the API serves it: ``completions.jsonl`` in the job's artifact
store (``core.jobs.artifact_store``), downloadable once the job has succeeded, and its first
lines as a preview at any time (while it runs, from the parts its ranks have written:
``trainer.generate.outputs``).
"""

from __future__ import annotations

import json
from itertools import islice
from pathlib import Path
from typing import Any

from core.errors import Conflict, InvalidInput, NotFound
from core.jobs import artifact_store
from core.jobs.models import Job
from core.jobs.states import JobStatus
from core.settings import Settings
from trainer.generate import outputs
from trainer.generate.job_config import COMPLETIONS, PARTS

MAX_PREVIEW = 100


def _require_generation(job: Job) -> None:
    if job.kind not in ("generate", "eval"):
        raise InvalidInput(f"job {job.job_id} is a {job.kind} job; completions belong to generation jobs "
                           "(kind: generate)", param="job_id")


def completions_file(settings: Settings, job: Job) -> Path:
    """The finished ``completions.jsonl`` of ``job``.

    Raises:
        InvalidInput: ``job`` is not a generation job.
        Conflict: it has not succeeded (its preview shows what is done).
        NotFound: it succeeded but the file is not on disk.
    """
    _require_generation(job)
    if job.status != JobStatus.succeeded.value:
        raise Conflict(f"job {job.job_id} is {job.status}; its completions can be downloaded once it has succeeded "
                       f"(GET /v1/jobs/{job.job_id}/completions/preview shows the first ones now)", param="job_id")
    path = artifact_store.job_store_dir(settings, job.job_id) / COMPLETIONS
    if not path.is_file():
        raise NotFound(f"job {job.job_id} succeeded but its {COMPLETIONS} is not on disk", param="job_id")
    return path


def preview(settings: Settings, job: Job, limit: int) -> list[dict[str, Any]]:
    """The first ``limit`` completion lines written so far, in prompt order (contiguous from the
    first prompt: a running job's ranks finish out of order)."""
    _require_generation(job)
    if not 1 <= limit <= MAX_PREVIEW:
        raise InvalidInput(f"limit: between 1 and {MAX_PREVIEW}, got {limit}", param="limit")
    root = artifact_store.job_store_dir(settings, job.job_id)
    final = root / COMPLETIONS
    if final.is_file():
        with final.open(encoding="utf-8") as handle:
            return [json.loads(line) for line in islice(handle, limit) if line.strip()]
    done = outputs.read_lines(root / "missing.jsonl", root / PARTS)
    lines = []
    for index in range(limit):
        if index not in done:
            break
        lines.append(done[index])
    return lines
