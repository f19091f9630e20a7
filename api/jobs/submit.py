"""The API's ports for the one submission path (``core.jobs.submit``): what a submission needs
from this process. Every route that queues a job (``POST /v1/jobs``, ``/clone``, ``/resume``,
``/openai/v1/fine_tuning/jobs`` and its ``resume``) calls ``core.jobs.submit.submit(ApiPorts(state), ...)``.

    preflight   ``api.jobs.preview.preflight_for``: files, model, and the dataset under the
                model's own tokenizer, in a tokenizer-pool process; a generation job's
                (``generation_report``): its prompts file and model, and each prompt's length
                against the model's context in the same pool
    wake        after the commit: wake the worker host the queue policy places the job on
                (``api.jobs.wakeups``: one thread for the process)
    notify      after the commit: tell the job's viewers (Redis pub/sub)
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from anyio import to_thread
from sqlalchemy.orm import Session

from api.jobs.preview import preflight_for
from api.state import AppState
from core.jobs import generation, live, prompt_lengths, scheduling
from core.jobs.generate_spec import GenerateSpec
from core.jobs.service import AnySpec
from core.queue import enqueue_job
from core.settings import Settings
from core.users import access
from core.users.service import Caller

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ApiPorts:
    """``core.jobs.submit.Ports`` over the app's state."""

    state: AppState

    @property
    def settings(self) -> Settings:
        return self.state.settings

    def sessions(self) -> AbstractContextManager[Session]:
        return self.state.sessions()

    async def preflight(self, spec: AnySpec, owner: Caller) -> dict[str, Any]:
        if isinstance(spec, GenerateSpec):
            return await generation_report(self.state, spec, owner)
        return await preflight_for(self.state, spec, owner)

    def wake(self, job_id: str) -> None:
        enqueue(self.state, job_id)

    async def notify(self, job_id: str, seq: int) -> None:
        await notify(self.state, job_id, seq)


async def generation_report(state: AppState, spec: GenerateSpec, owner: Caller) -> dict[str, Any]:
    """``core.jobs.generation.preflight`` in the project the job will belong to, then, for a local
    model, each prompt's tokens against its context in a tokenizer-pool process (``core.jobs.prompt_lengths``).

    Raises:
        InvalidInput: the prompts file or the model; a prompt too long for the model with
            ``sampling.max_tokens`` (``InvalidDataset``, naming its line).
    """
    report, located = await to_thread.run_sync(_generation_preflight, state, spec, owner)
    counted = None
    if located is not None:
        assert state.tokenizers is not None, "the lifespan creates the tokenizer pool"
        counted = await state.tokenizers.run(prompt_lengths.count, spec.model, located.source, located.prompts_path,
                                             spec.sampling.max_tokens, located.limit, user=owner.user_id)
    return prompt_lengths.add_counts(report, counted, spec.sampling.max_tokens,
                                     located.limit if located is not None else None)


def _generation_preflight(state: AppState, spec: GenerateSpec,
                          owner: Caller) -> tuple[dict[str, Any], prompt_lengths.Located | None]:
    with state.sessions() as session:
        project_id = access.project_for_create(session, owner, spec.project)
        report = generation.preflight(session, spec, settings=state.settings, project_id=project_id)
        return report, prompt_lengths.locate(session, spec, settings=state.settings, project_id=project_id)


def enqueue(state: AppState, job_id: str) -> None:
    """Wake the host the policy places ``job_id`` on now (a job that must wait: any host), from
    the process's wake-up thread (api/jobs/wakeups.py: one queue replay for many submissions)."""
    if state.wakeups is not None:
        state.wakeups.note(job_id)
        return
    try:  # a state built by hand (tests) has no wake-up thread
        with state.sessions() as session:
            placed = [p for p in scheduling.signal_targets(session, state.settings) if p.job_id == job_id]
        enqueue_job(state.celery, job_id, placed[0].worker_id if placed else None)
    except Exception as exc:  # the broker is down: the job stays queued for the reaper
        log.warning("job %s committed but not signalled to the workers (broker: %s)", job_id, exc)


async def notify(state: AppState, job_id: str, seq: int) -> None:
    """Tell the job's live viewers (SSE, other API processes) that events up to ``seq`` exist."""
    if state.redis is None:
        return
    try:
        await state.redis.publish(live.channel(job_id), live.message(seq))
    except Exception as exc:  # viewers fall back to re-reading the store
        log.warning("could not publish job %s event %s to Redis: %s", job_id, seq, exc)
