"""A remote worker's side of a chat session, a generation job or an eval run: the weights they load
come down through the API, and a generation's output lines go up to the API's store.

    config      weights_fetcher: ``job:<id>`` (its final ``adapter/`` or ``model/``), ``job:<id>@<step>``
                (``checkpoints/step-N``) and ``export:<id>`` (``exports/<id>``) are downloaded with
                the worker key (``core.workers.access`` allows exactly what the running job names)
                and cached under <data_dir>/cache/artifacts/<job id>/<path>: those artifacts never
                change once they can be named, so a second job on the same weights downloads
                nothing. The prompts file comes down as a dataset (worker/remote.py
                ``fetch_datasets``); the base is resolved on this machine's model root or hub, and
                so is the base that lends its tokenizer to a full job's ``model/`` saved without
                one (``core.jobs.generation.ResolvedModel.tokenizer``): it is never downloaded.
    resume      fetch_parts: the part files the API holds (``completions.parts``, from an earlier
                attempt, maybe on another machine) are merged into this machine's, so the trainer
                skips every prompt whose line reached the API
    run         GenerationOutputs: each ``progress`` event (written after each chunk) is held back
                until ``completions.parts`` is uploaded, so the progress the store shows is what
                the API holds; a resume elsewhere redoes only the chunk in flight when the worker
                was lost (its lines were not uploaded). At the end ``completions.jsonl`` goes up
                before the job may be ``succeeded``; a run that ends otherwise uploads its parts
                once more (a cancelled job resumes from them)

A session's relay already goes through the store (core/sessions/relay.py): it needs only the weights.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from core.jobs.states import JobStatus
from trainer.generate import outputs as lines_on_disk
from trainer.training import layout
from worker.outcome import Outcome
from worker.remote import RemoteOutputs, client_for, fetch_datasets
from worker.transfer import TransferClient, TransferError, TransferNotFound

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

    from core.jobs.generation import Fetch, Files
    from core.settings import Settings
    from worker.claim import Claim
    from worker.recorder import EventRecorder
    from worker.runtime import Runtime

log = logging.getLogger(__name__)

GENERATION_KINDS = ("generate", "eval")
FETCHED_PART = "rank-fetched.jsonl"
"""The part file holding the lines an earlier attempt uploaded that this machine lacks (read as
every ``rank-*.jsonl``; no rank appends to it)."""


def weights_fetcher(settings: Settings) -> Fetch:
    """``core.jobs.generation.Fetch`` of a remote worker: download once, then the cached copy."""
    def fetch(job_id: str, path: str) -> Path:
        target = settings.data_dir / "cache" / "artifacts" / job_id / layout.check_artifact_path(path)
        if not target.is_dir():
            with client_for(settings) as client:
                client.download_artifact(job_id, path, target)
            log.info("fetched %s of job %s from the API", path, job_id)
        return target

    return fetch


def prompts_fetcher(settings: Settings) -> Files:
    """``core.jobs.generation.Files`` of a remote worker: the prompts file's cached download."""
    def files(session: Session, file_ids: list[str]) -> dict[str, str]:
        return fetch_datasets(session, settings, file_ids)

    return files


def fetch_parts(client: TransferClient, claim: Claim) -> int:
    """Merge the part files the API holds for this job into this machine's; the lines added.

    Lines are keyed by prompt index; only those this machine lacks are appended, to
    ``FETCHED_PART``, so no prompt is counted twice. A torn last line is skipped, as the trainer does.
    """
    parts_dir = claim.output_dir / layout.COMPLETION_PARTS
    completions = claim.output_dir / layout.COMPLETIONS
    claim.output_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=claim.output_dir, prefix=".parts-") as work:
        fetched = Path(work) / "parts"
        try:
            client.download_artifact(claim.job_id, layout.COMPLETION_PARTS, fetched)
        except TransferNotFound:
            return 0  # nothing uploaded yet: a first attempt
        theirs = lines_on_disk.read_lines(Path(work) / "none.jsonl", fetched)
    ours = lines_on_disk.read_lines(completions, parts_dir)
    missing = [theirs[i] for i in sorted(theirs) if i not in ours]
    if missing:
        parts_dir.mkdir(parents=True, exist_ok=True)
        with (parts_dir / FETCHED_PART).open("a", encoding="utf-8") as handle:
            handle.write("".join(json.dumps(line, ensure_ascii=False) + "\n" for line in missing))
            handle.flush()
            os.fsync(handle.fileno())
    return len(missing)


class GenerationOutputs(RemoteOutputs):
    """``RemoteOutputs`` of a generation job or eval run: its lines, rather than checkpoints, go up."""

    def add(self, event: dict[str, Any]) -> None:
        if event.get("type") == "progress" and event.get("stage") == "generate":
            self._queue.put(event)
        else:
            super().add(event)

    def _loop(self) -> None:
        while (event := self._queue.get()) is not None:
            if event.get("type") == "progress":
                self._upload_parts()
            self._recorder.add(event)

    def _upload_parts(self) -> bool:
        parts = self._claim.output_dir / layout.COMPLETION_PARTS
        merged = self._claim.output_dir / layout.COMPLETIONS
        if merged.is_file() or not parts.is_dir():  # merged into completions.jsonl (uploaded at the end)
            return True
        try:
            self._client.upload_artifact(self._claim.job_id, layout.COMPLETION_PARTS, parts)
        except (TransferError, OSError) as exc:
            if merged.is_file():  # the trainer merged (and removed) the parts while they were read
                return True
            log.warning("job %s: its finished lines were not uploaded (a resume on another machine would make "
                        "them again): %s", self._claim.job_id, exc)
            return False
        return True

    def finish(self, outcome: Outcome) -> Outcome:
        """Upload ``completions.jsonl`` of a succeeded run before job.json (``RemoteOutputs.finish``);
        a run that ended otherwise uploads its parts once more."""
        if outcome.status is not JobStatus.succeeded:
            self._upload_parts()
            return super().finish(outcome)
        try:
            self._client.upload_artifact(self._claim.job_id, layout.COMPLETIONS,
                                         self._claim.output_dir / layout.COMPLETIONS)
        except (TransferError, OSError) as exc:
            self._client.close()
            message = f"the completions were generated, but could not be uploaded to the API: {exc}"
            log.warning("job %s: %s", self._claim.job_id, message)
            if self._claim.attempt < self._max_attempts:
                return Outcome(JobStatus.queued, "upload_failed", message, retry=True)
            return Outcome(JobStatus.failed, "upload_failed", message)
        return super().finish(outcome)


def generation_outputs(runtime: Runtime, claim: Claim, recorder: EventRecorder) -> GenerationOutputs:
    """The runner's handle on a remote generation job's lines; first merges what the API holds.

    Raises:
        TransferError: the API's parts could not be downloaded (the attempt is retried rather
            than generating again what is already done).
    """
    client = client_for(runtime.settings)
    try:
        added = fetch_parts(client, claim)
    except BaseException:
        client.close()
        raise
    if added:
        log.info("job %s: %d finished line(s) fetched from the API", claim.job_id, added)
    return GenerationOutputs(client, claim, recorder, max_attempts=runtime.settings.max_attempts)
