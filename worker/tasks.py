"""The worker's Celery tasks. Each takes ids only and re-reads the store (the source of truth)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from celery.exceptions import Reject

from core.queue import TASK_REAP, TASK_RUN_JOB, TASK_RUN_NODE
from worker.exports import register_export_task
from worker.follower import run_part
from worker.reaper import reap
from worker.runner import run_job

if TYPE_CHECKING:
    from celery import Celery

    from worker.runtime import Runtime


def register_tasks(app: Celery, runtime_of: Any) -> None:
    """Define ``jobs.run``, ``jobs.run_node``, ``jobs.reap`` and ``exports.run`` on ``app``; ``runtime_of()`` gives the process's Runtime."""
    register_export_task(app, runtime_of)

    @app.task(name=TASK_RUN_JOB, ignore_result=True, shared=False)
    def run(job_id: str) -> str:
        """Claim ``job_id`` (queued → running) and train it; a redelivered message is a no-op."""
        runtime: Runtime = runtime_of()
        result = run_job(runtime, job_id)
        if result == "deferred":
            raise Reject(f"worker shutting down; job {job_id} stays queued", requeue=True)
        return result

    @app.task(name=TASK_RUN_NODE, ignore_result=True, shared=False)
    def run_node(job_id: str, attempt: int, node_rank: int, rdzv_endpoint: str) -> str:
        """Run this host's part of a multi-machine job (worker/follower.py); a redelivery is a no-op."""
        return run_part(runtime_of(), job_id, attempt, node_rank, rdzv_endpoint)

    @app.task(name=TASK_REAP, ignore_result=True, shared=False)
    def reap_jobs() -> dict[str, list[str]]:
        """Retry or fail jobs whose worker is gone (see worker/reaper.py)."""
        runtime: Runtime = runtime_of()
        report = reap(
            runtime.sessionmaker,
            runtime.settings,
            enqueue=runtime.enqueue,
            publish=runtime.publish,
            host=runtime.worker_id,
            resend_after_s=runtime.options.resend_queued_after_s,
        )
        return {"requeued": report.requeued, "failed": report.failed, "cancelled": report.cancelled,
                "resent": report.resent, "signalled": report.signalled}
