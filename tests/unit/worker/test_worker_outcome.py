"""How a trainer's exit and the worker's request map to the job's state."""

from __future__ import annotations

from dataclasses import replace

import pytest

from core.jobs.states import JobStatus
from worker.oom import OomVerdict
from worker.outcome import StopReason, classify, culprit
from worker.process import RankFailure, TrainerExit, parse_torchrun_failures

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
        (-9, None, None, JobStatus.failed, "killed"),
        (-11, None, None, JobStatus.failed, "killed"),
        (2, None, None, JobStatus.failed, "trainer_crashed"),
        (0, None, None, JobStatus.failed, "trainer_crashed"),
        (0, "succeeded", StopReason.lost, None, None),
    ],
)
def test_classify(returncode, done, stop, status, code):
    outcome = classify(TrainerExit(returncode, ("boom",)), DONE.get(done), stop, cancel_grace_s=5)
    assert (outcome.status, outcome.error_code) == (status, code)


class TestSigkill:
    """SIGKILL is what both the OOM killer and an outside ``kill -9`` send (issue 10)."""

    def test_a_counted_oom_fails_at_once_with_advice_and_the_evidence(self):
        exit_ = TrainerExit(-9, ("boom",), oom=OomVerdict.oom, oom_evidence="/proc/vmstat oom_kill 0 -> 1")
        outcome = classify(exit_, None, None, cancel_grace_s=5, attempt=1, max_attempts=3)
        assert (outcome.status, outcome.error_code, outcome.retry) == (JobStatus.failed, "out_of_memory", False)
        assert "oom_kill 0 -> 1" in outcome.message and "batch_tokens" in outcome.message

    @pytest.mark.parametrize("oom", [OomVerdict.not_oom, OomVerdict.unknown])
    def test_an_unexplained_kill_is_retried_until_max_attempts(self, oom):
        exit_ = TrainerExit(-9, ("boom",), oom=oom, oom_evidence="counters")
        first = classify(exit_, None, None, cancel_grace_s=5, attempt=1, max_attempts=2)
        assert (first.status, first.error_code, first.retry) == (JobStatus.queued, "killed", True)
        assert "from outside ftq" in first.message and "attempt 1 of 2" in first.message
        last = classify(exit_, None, None, cancel_grace_s=5, attempt=2, max_attempts=2)
        assert (last.status, last.error_code, last.retry) == (JobStatus.failed, "killed", False)
        assert "attempt 2 of 2" in last.message and last.message.endswith("boom")


def test_a_signal_death_names_the_signal_and_ends_with_the_stderr_tail():
    outcome = classify(TrainerExit(-11, ("", "Fatal Python error: Segmentation fault")), None, None, cancel_grace_s=5)
    assert "SIGSEGV" in outcome.message
    assert outcome.message.endswith("--- last 1 lines of the trainer's stderr ---\nFatal Python error: Segmentation fault")


def test_a_reported_failure_without_stderr_is_just_the_message():
    outcome = classify(TrainerExit(1, ()), DONE["failed"], None, cancel_grace_s=5)
    assert outcome.message == "loss became NaN"


SUMMARY = """\
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
======================================================
trainer FAILED
------------------------------------------------------
Failures:
[1]:
  time      : 2026-11-23_23:08:49
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 3459)  (SIGTERM)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 3459
------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-23_23:08:49
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 3460)  (SIGKILL)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 3460
======================================================
""".splitlines()
"""What torchrun 2.13 prints when rank 1 of 2 is SIGKILLed (captured from a CPU run)."""


class TestRanks:
    def test_torchruns_summary_parses_to_the_failed_ranks_root_cause_first(self):
        assert parse_torchrun_failures(SUMMARY) == (RankFailure(1, -9, True), RankFailure(0, -15, False))
        assert parse_torchrun_failures(["no summary here"]) == ()

    def test_a_rank_killed_by_sigkill_is_the_cause_even_after_rank_0_reported_the_broken_peer(self):
        exit_ = TrainerExit(1, ("torchrun noise",), 2, parse_torchrun_failures(SUMMARY),
                            {1: ("rank 1: loading", "rank 1: about to be killed")})
        done = {"status": "failed", "error_code": "internal_error", "message": "rank 0: RuntimeError: Connection reset by peer"}
        outcome = classify(exit_, done, None, cancel_grace_s=1)
        assert (outcome.status, outcome.error_code) == (JobStatus.failed, "killed")
        assert outcome.message.startswith("rank 1 of 2 was killed by SIGKILL from outside ftq")
        assert "torchrun stopped the other ranks" in outcome.message
        oom = replace(exit_, oom=OomVerdict.oom, oom_evidence="/proc/vmstat oom_kill 4 -> 5")
        outcome = classify(oom, done, None, cancel_grace_s=1, attempt=1, max_attempts=3)
        assert (outcome.status, outcome.error_code) == (JobStatus.failed, "out_of_memory")
        assert outcome.message.startswith("rank 1 of 2 was killed by the kernel's out-of-memory killer")
        assert "rank 0 then reported: rank 0: RuntimeError: Connection reset by peer" in outcome.message
        assert outcome.message.endswith("--- last 2 lines of rank 1's stderr ---\nrank 1: loading\nrank 1: about to be killed")

    def test_the_torchrun_sigterm_of_the_survivors_is_never_the_cause(self):
        failures = (RankFailure(0, -15, True), RankFailure(1, 1, False))
        assert culprit(failures) == RankFailure(0, -15, True)  # no other: torchrun's root cause
        assert culprit((RankFailure(0, -15, True), RankFailure(1, -11, False))) == RankFailure(1, -11, False)

    def test_a_rank_exiting_with_a_code_and_no_done_is_a_crash_naming_it(self):
        exit_ = TrainerExit(1, (), 4, (RankFailure(2, 1, True), RankFailure(0, -15, False)), {2: ("Traceback", "ValueError: x")})
        outcome = classify(exit_, None, None, cancel_grace_s=1)
        assert outcome.error_code == "trainer_crashed" and "rank 2 of 4 exited with code 1" in outcome.message
        assert outcome.message.endswith("ValueError: x")

    def test_rank_0s_own_reported_failure_keeps_its_code(self):
        exit_ = TrainerExit(1, (), 2, (RankFailure(0, 1, True), RankFailure(1, 1, False)), {0: ("config: bad",)})
        outcome = classify(exit_, DONE["failed"], None, cancel_grace_s=1)
        assert outcome.error_code == "nan_loss" and "rank 0 of 2 failed first" in outcome.message

    def test_a_cancel_reads_as_for_one_rank(self):
        exit_ = TrainerExit(1, (), 2, (RankFailure(1, -15, True),), {})
        outcome = classify(exit_, DONE["cancelled"], StopReason.cancel, cancel_grace_s=1)
        assert outcome.status is JobStatus.cancelled
