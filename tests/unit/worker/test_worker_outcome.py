"""How a trainer's exit and the worker's request map to the job's state."""

from __future__ import annotations

import pytest

from core.jobs.states import JobStatus
from worker.outcome import StopReason, classify
from worker.process import TrainerExit

DONE = {
    "succeeded": {"type": "done", "status": "succeeded"},
    "cancelled": {"type": "done", "status": "cancelled"},
    "failed": {"type": "done", "status": "failed", "error_code": "nan_loss", "message": "loss became NaN"},
}


@pytest.mark.parametrize(
    ("returncode", "done", "stop", "status", "code"),
    [
        (0, "succeeded", None, JobStatus.succeeded, None),
        (0, "succeeded", StopReason.cancel, JobStatus.succeeded, None),
        (0, "cancelled", StopReason.cancel, JobStatus.cancelled, None),
        (0, "cancelled", StopReason.shutdown, JobStatus.queued, None),
        (0, "cancelled", None, JobStatus.failed, "interrupted"),
        (1, "failed", None, JobStatus.failed, "nan_loss"),
        (-9, None, StopReason.cancel, JobStatus.cancelled, None),
        (-9, None, StopReason.shutdown, JobStatus.queued, None),
        (-9, None, None, JobStatus.failed, "out_of_memory"),
        (-11, None, None, JobStatus.failed, "killed"),
        (2, None, None, JobStatus.failed, "trainer_crashed"),
        (0, None, None, JobStatus.failed, "trainer_crashed"),
        (0, "succeeded", StopReason.lost, None, None),
    ],
)
def test_classify(returncode, done, stop, status, code):
    outcome = classify(TrainerExit(returncode, ("boom",)), DONE.get(done), stop, cancel_grace_s=5)
    assert (outcome.status, outcome.error_code) == (status, code)


def test_a_signal_death_names_the_signal_and_ends_with_the_stderr_tail():
    outcome = classify(TrainerExit(-11, ("", "Fatal Python error: Segmentation fault")), None, None, cancel_grace_s=5)
    assert "SIGSEGV" in outcome.message
    assert outcome.message.endswith("--- last 1 lines of the trainer's stderr ---\nFatal Python error: Segmentation fault")


def test_a_reported_failure_without_stderr_is_just_the_message():
    outcome = classify(TrainerExit(1, ()), DONE["failed"], None, cancel_grace_s=5)
    assert outcome.message == "loss became NaN"
