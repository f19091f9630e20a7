"""Job states and the transitions allowed between them, as data.

    queued ──► running ──► succeeded
      │           │──────► failed
      │           └──────► cancelled
      │           └──────► queued      (retry from the last checkpoint after a lost worker)
      ├─────────────────► cancelled    (cancel while waiting: the job never runs)
      └─────────────────► failed       (refused before it ran, e.g. its files vanished)

Transitions are applied by ``core.jobs.service.transition`` as one conditional
``UPDATE ... WHERE status IN (allowed sources)`` so two processes can never both win.
"""

from __future__ import annotations

import enum


class JobStatus(str, enum.Enum):
    queued = "queued"
    """Accepted and waiting for a worker."""
    running = "running"
    """Claimed by a worker; the trainer process is (or is about to be) running."""
    succeeded = "succeeded"
    """The trainer finished every step and wrote the final adapter."""
    failed = "failed"
    """The trainer or its worker failed; error_code and error_message say why."""
    cancelled = "cancelled"
    """Cancelled by a user, before or during the run."""


FINISHED_STATUSES = frozenset({JobStatus.succeeded, JobStatus.failed, JobStatus.cancelled})
CANCELABLE_STATUSES = frozenset({JobStatus.queued, JobStatus.running})
ACTIVE_STATUSES = frozenset({JobStatus.queued, JobStatus.running})

ALLOWED_TRANSITIONS: dict[JobStatus, frozenset[JobStatus]] = {
    JobStatus.queued: frozenset({JobStatus.running, JobStatus.cancelled, JobStatus.failed}),
    JobStatus.running: frozenset(
        {JobStatus.succeeded, JobStatus.failed, JobStatus.cancelled, JobStatus.queued}
    ),
    JobStatus.succeeded: frozenset(),
    JobStatus.failed: frozenset(),
    JobStatus.cancelled: frozenset(),
}


def sources_of(target: JobStatus) -> frozenset[JobStatus]:
    """Every status from which ``target`` may be entered."""
    return frozenset(src for src, dsts in ALLOWED_TRANSITIONS.items() if target in dsts)
