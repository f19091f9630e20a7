"""The Celery app both sides use: the API sends ``jobs.run`` by name, the worker runs it.

The store is the source of truth and the broker only signals: a task carries a job id and
nothing else, and the worker claims the job with a compare-and-set before doing anything.
Tasks are acknowledged late and rejected when the worker process is lost, so a task killed
by the OOM killer is redelivered (and then finds the job already claimed, or reaped).
"""

from __future__ import annotations

from celery import Celery

from core.settings import Settings

TASK_RUN_JOB = "jobs.run"
TASK_REAP = "jobs.reap"
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


def enqueue_job(celery: Celery, job_id: str) -> None:
    """Signal the workers that ``job_id`` waits; call only after the job row is committed."""
    celery.send_task(TASK_RUN_JOB, args=[job_id], queue=QUEUE)
