"""How a trainer's exit becomes the job's next state.

    the trainer's done event     what the worker asked for    →  job
    succeeded                    anything                        succeeded
    cancelled                    cancel                          cancelled
    cancelled                    shutdown                        queued (resumes from its checkpoint)
    cancelled                    nothing                         failed  interrupted
    failed                       anything                        failed  <the trainer's code>
    none (crash, kill)           cancel                          cancelled (killed after the grace)
    none                         shutdown                        queued
    none, SIGKILL, OOM counted   nothing                         failed  out_of_memory (with advice)
    none, SIGKILL, no OOM        nothing                         queued  (retry from the last checkpoint)
                                                                 while attempt < max_attempts, then
                                                                 failed  killed
    none, exit by other signal   nothing                         failed  killed
    none, exit code              nothing                         failed  trainer_crashed

SIGKILL is what both the kernel's OOM killer and an outside ``kill -9`` send; ``worker.oom``
reads the kernel's OOM counters around the run to tell them apart. A real OOM fails at once
with advice (a smaller batch will not come from retrying; CUDA OOM is the trainer's own to
handle, and it ends with a done event). An unexplained kill (no OOM counted, or the counters
unreadable) is retried from the last checkpoint like a lost worker, and counts as an attempt.

``lost`` (the reaper gave the job to someone else) changes nothing: the job is not ours.
Failure messages end with the tail of the trainer's stderr.

Several ranks (torchrun): when one rank fails, torchrun stops the others (SIGTERM) and exits
1 with a summary of the failed ranks. The failure is then that of the rank that caused it:

    a rank killed by a signal other than torchrun's SIGTERM   as one rank's SIGKILL above, or
                                                                      failed killed, naming that rank
    otherwise, with rank 0's done event                       failed  rank 0's code (a peer's crash
                                                                      shows there as a connection error)
    otherwise                                                 failed  trainer_crashed, naming
                                                                      torchrun's first failed rank

and the message ends with that rank's own stderr tail (its log under torchrun's ``--log-dir``).
A cancel or a shutdown reads as for one rank.
"""

from __future__ import annotations

import enum
import signal
from dataclasses import dataclass
from typing import Any

from core.jobs.states import JobStatus
from worker.oom import OomVerdict
from worker.process import RankFailure, TrainerExit, signal_name


class StopReason(str, enum.Enum):
    cancel = "cancel"
    """A user asked to cancel the job."""
    shutdown = "shutdown"
    """The worker is shutting down; the job goes back to the queue."""
    lost = "lost"
    """The job is no longer this worker's (reaped after a stall, or changed by hand)."""


@dataclass(frozen=True)
class Outcome:
    status: JobStatus | None
    """The state to move to; None: leave the job alone (it is not ours any more)."""
    error_code: str | None = None
    message: str | None = None
    retry: bool = False
    """``queued`` after a failed attempt (an unexplained kill): it counts toward max_attempts,
    unlike the hand-back of a worker shutting down."""


def classify(
    exit_: TrainerExit,
    done: dict[str, Any] | None,
    stop: StopReason | None,
    *,
    cancel_grace_s: float,
    attempt: int = 1,
    max_attempts: int = 1,
) -> Outcome:
    if stop is StopReason.lost:
        return Outcome(None)
    if exit_.failures and stop is None and (done is None or done.get("status") != "succeeded"):
        return _rank_failed(exit_, done, attempt, max_attempts)
    if done is not None:
        return _from_done(exit_, done, stop)
    if stop is StopReason.cancel:
        return Outcome(
            JobStatus.cancelled,
            message=f"the trainer did not stop within cancel_grace_s={cancel_grace_s:g}s and was killed; "
            "its last checkpoint is kept",
        )
    if stop is StopReason.shutdown:
        return Outcome(JobStatus.queued, message="the worker shut down; the job resumes from its last checkpoint")
    sig = signal_name(exit_.returncode)
    if sig == "SIGKILL":
        outcome = sigkilled("the trainer", exit_, attempt, max_attempts)
        return Outcome(outcome.status, outcome.error_code, _with_tail(outcome.message or "", exit_), outcome.retry)
    if sig is not None:
        return Outcome(JobStatus.failed, "killed", _with_tail(f"the trainer was killed by {sig}", exit_))
    return Outcome(
        JobStatus.failed,
        "trainer_crashed",
        _with_tail(f"the trainer exited with code {exit_.returncode} without a final event", exit_),
    )


def _from_done(exit_: TrainerExit, done: dict[str, Any], stop: StopReason | None) -> Outcome:
    status = done.get("status")
    if status == "succeeded":
        return Outcome(JobStatus.succeeded, message=done.get("message"))
    if status == "cancelled":
        if stop is StopReason.cancel:
            return Outcome(JobStatus.cancelled, message=done.get("message") or "cancelled by request")
        if stop is StopReason.shutdown:
            return Outcome(JobStatus.queued, message="the worker shut down; the job resumes from its last checkpoint")
        return Outcome(
            JobStatus.failed,
            "interrupted",
            _with_tail("the trainer was stopped by a signal that did not come from ftq", exit_),
        )
    code = done.get("error_code") or "trainer_failed"
    text = done.get("message") or f"the trainer reported failure (exit code {exit_.returncode})"
    return Outcome(JobStatus.failed, code, _with_tail(text, exit_))


def sigkilled(who: str, exit_: TrainerExit, attempt: int, max_attempts: int, aftermath: str = "") -> Outcome:
    """A SIGKILL without a final event: a real OOM fails with advice, any other kill is retried
    from the last checkpoint until ``max_attempts``."""
    if exit_.oom is OomVerdict.oom:
        return Outcome(
            JobStatus.failed,
            "out_of_memory",
            f"{who} was killed by the kernel's out-of-memory killer (host RAM or the cgroup's memory "
            f"limit ran out; {exit_.oom_evidence}){aftermath}. Lower hyperparameters.batch_tokens or "
            "max_seq_len, use fewer data-loader workers, or free memory on the box, and submit again",
        )
    why = f"{who} was killed by SIGKILL from outside ftq ({exit_.oom_evidence}){aftermath}"
    if attempt < max_attempts:
        return Outcome(
            JobStatus.queued,
            "killed",
            f"{why}; retrying from the last checkpoint (attempt {attempt} of {max_attempts})",
            retry=True,
        )
    return Outcome(
        JobStatus.failed,
        "killed",
        f"{why}; it was killed on attempt {attempt} of {max_attempts} (FTQ_MAX_ATTEMPTS): find what "
        "kills it (a supervisor, a container runtime, an operator) and submit again",
    )


def culprit(failures: tuple[RankFailure, ...]) -> RankFailure:
    """The rank whose failure ended the run: one killed by a signal other than the SIGTERM
    torchrun sends the survivors, else torchrun's root cause (its first observed failure)."""
    killed = [f for f in failures if f.exitcode < 0 and f.exitcode != -signal.SIGTERM]
    ordered = sorted(killed or failures, key=lambda f: (not f.root_cause, f.rank))
    return ordered[0]


def _rank_failed(exit_: TrainerExit, done: dict[str, Any] | None, attempt: int, max_attempts: int) -> Outcome:
    rank = culprit(exit_.failures)
    who = f"rank {rank.rank} of {exit_.world_size}"
    tail = exit_.rank_tails.get(rank.rank, ())
    reported = ""
    if done is not None and done.get("message"):
        reported = f"; rank 0 then reported: {str(done['message']).splitlines()[0]}"
    sig = signal_name(rank.exitcode)
    if sig == "SIGKILL":
        outcome = sigkilled(who, exit_, attempt, max_attempts, "; torchrun stopped the other ranks")
        text = _rank_tail((outcome.message or "") + reported, rank, tail)
        return Outcome(outcome.status, outcome.error_code, text, outcome.retry)
    if sig is not None:
        text = f"{who} was killed by {sig}; torchrun stopped the other ranks"
        return Outcome(JobStatus.failed, "killed", _rank_tail(text + reported, rank, tail))
    if done is not None:
        code = done.get("error_code") or "trainer_failed"
        text = done.get("message") or f"the trainer reported failure (exit code {exit_.returncode})"
        return Outcome(JobStatus.failed, code, _rank_tail(f"{text} (torchrun: {who} failed first, exit code "
                                                           f"{rank.exitcode})", rank, tail))
    text = f"{who} exited with code {rank.exitcode} without a final event; torchrun stopped the other ranks"
    return Outcome(JobStatus.failed, "trainer_crashed", _rank_tail(text, rank, tail))


def _rank_tail(text: str, rank: RankFailure, tail: tuple[str, ...]) -> str:
    lines = [line for line in tail if line.strip()]
    if not lines:
        return text
    return f"{text}\n--- last {len(lines)} lines of rank {rank.rank}'s stderr ---\n" + "\n".join(lines)


def _with_tail(text: str, exit_: TrainerExit) -> str:
    lines = [line for line in exit_.stderr_tail if line.strip()]
    if not lines:
        return text
    return f"{text}\n--- last {len(lines)} lines of the trainer's stderr ---\n" + "\n".join(lines)
