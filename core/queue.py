"""The Celery app both sides use: the API sends ``jobs.run`` by name, the worker runs it.

Every worker host consumes two queues: ``ftq.jobs``, shared by all, and its own
(``host_queue``). A message for a job that can start now goes to the queue of the host the
policy placed it on (core/jobs/scheduling.py), so the host that can run it is the one woken;
a message with no known host (a job that must wait) goes to the shared queue.

The store is the source of truth and the broker only signals: a task carries a job id and
nothing else, and the worker claims the job with a compare-and-set before doing anything.
Tasks are acknowledged late and rejected when the worker process is lost, so a task killed
by the OOM killer is redelivered (and then finds the job already claimed, or reaped).
"""

from __future__ import annotations

import hashlib
import re

from celery import Celery

from core.settings import Settings

TASK_RUN_JOB = "jobs.run"
TASK_REAP = "jobs.reap"
TASK_RUN_NODE = "jobs.run_node"
"""One follower machine's part of a multi-machine job (worker/nodes.py), sent by its leader."""
TASK_EXPORT = "exports.run"
QUEUE = "ftq.jobs"


def make_celery(settings: Settings) -> Celery:
    app = Celery("ftq", broker=settings.broker_url, set_as_current=False)
    app.conf.update(
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        worker_concurrency=1,
        task_default_queue=QUEUE,
        task_ignore_result=True,
        task_track_started=False,
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
        worker_send_task_events=False,
    )
    if (settings.broker_url or "").startswith(("redis://", "rediss://")):
        # A training job can run for days: the broker must not redeliver it while it runs.
        # (Redis' visibility timeout; the claim CAS makes a redelivery harmless anyway.)
        # Only for Redis: kombu's SQLAlchemy transport passes its transport options to
        # create_engine(), which refuses unknown keywords.
        app.conf.broker_transport_options = {"visibility_timeout": 7 * 24 * 3600}
    return app


def host_queue(worker_id: str) -> str:
    """The queue only worker host ``worker_id`` consumes (a name safe for ``celery -Q``: no commas)."""
    readable = re.sub(r"[^A-Za-z0-9_.@-]+", "_", worker_id)[:60]
    return f"{QUEUE}.{readable}.{hashlib.sha1(worker_id.encode()).hexdigest()[:8]}"


def enqueue_job(celery: Celery, job_id: str, host: str | None = None) -> None:
    """Signal that ``job_id`` waits, to worker host ``host`` (None: to any); call only after the
    job row is committed."""
    celery.send_task(TASK_RUN_JOB, args=[job_id], queue=QUEUE if host is None else host_queue(host))


def enqueue_export(celery: Celery, export_id: str, host: str | None = None) -> None:
    """Signal export ``export_id`` to worker host ``host`` (the one holding the job's files;
    None: any); call only after the export row is committed."""
    celery.send_task(TASK_EXPORT, args=[export_id], queue=QUEUE if host is None else host_queue(host))


def enqueue_node(celery: Celery, job_id: str, attempt: int, node_rank: int, rdzv_endpoint: str, host: str) -> None:
    """Start node ``node_rank`` of ``job_id``'s attempt ``attempt`` on follower host ``host``;
    call only after the claim and its ``job_node`` rows are committed."""
    celery.send_task(TASK_RUN_NODE, args=[job_id, attempt, node_rank, rdzv_endpoint], queue=host_queue(host))
