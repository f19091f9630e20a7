"""How a trainer's exit becomes the job's next state.

    the trainer's done event     what the worker asked for    →  job
    succeeded                    anything                        succeeded
    cancelled                    cancel                          cancelled
    cancelled                    shutdown                        queued (resumes from its checkpoint)
    cancelled                    nothing                         failed  interrupted
    failed                       anything                        failed  <the trainer's code>
    none (crash, kill)           cancel                          cancelled (killed after the grace)
    none                         shutdown                        queued
    none, exit by SIGKILL        nothing                         failed  out_of_memory
    none, exit by other signal   nothing                         failed  killed
    none, exit code              nothing                         failed  trainer_crashed

``lost`` (the reaper gave the job to someone else) changes nothing: the job is not ours.
Failure messages end with the tail of the trainer's stderr.

Several ranks (torchrun): when one rank fails, torchrun stops the others (SIGTERM) and exits
1 with a summary of the failed ranks. The failure is then that of the rank that caused it:

    a rank killed by a signal other than torchrun's SIGTERM   failed  out_of_memory (SIGKILL)
                                                                      or killed, naming that rank
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


def classify(
    exit_: TrainerExit,
    done: dict[str, Any] | None,
    stop: StopReason | None,
    *,
    cancel_grace_s: float,
) -> Outcome:
    if stop is StopReason.lost:
        return Outcome(None)
    if exit_.failures and stop is None and (done is None or done.get("status") != "succeeded"):
        return _rank_failed(exit_, done)
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
        return Outcome(
            JobStatus.failed,
            "out_of_memory",
            _with_tail(
                "the trainer was killed by SIGKILL without a final event: most likely the kernel's "
                "out-of-memory killer (host RAM ran out). Lower hyperparameters.batch_tokens or "
                "max_seq_len, or free memory on the box, and submit again",
                exit_,
            ),
        )
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


def culprit(failures: tuple[RankFailure, ...]) -> RankFailure:
    """The rank whose failure ended the run: one killed by a signal other than the SIGTERM
    torchrun sends the survivors, else torchrun's root cause (its first observed failure)."""
    killed = [f for f in failures if f.exitcode < 0 and f.exitcode != -signal.SIGTERM]
    ordered = sorted(killed or failures, key=lambda f: (not f.root_cause, f.rank))
    return ordered[0]


def _rank_failed(exit_: TrainerExit, done: dict[str, Any] | None) -> Outcome:
    rank = culprit(exit_.failures)
    who = f"rank {rank.rank} of {exit_.world_size}"
    tail = exit_.rank_tails.get(rank.rank, ())
    reported = ""
    if done is not None and done.get("message"):
        reported = f"; rank 0 then reported: {str(done['message']).splitlines()[0]}"
    sig = signal_name(rank.exitcode)
    if sig == "SIGKILL":
        text = (f"{who} was killed by SIGKILL without a final event: most likely the kernel's "
                "out-of-memory killer (host RAM ran out); torchrun stopped the other ranks. Lower "
                "hyperparameters.batch_tokens or max_seq_len, or free memory on the box, and submit again")
        return Outcome(JobStatus.failed, "out_of_memory", _rank_tail(text + reported, rank, tail))
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
