"""Slurm's job states as ftq sees them: waiting, running or ended; the exit the runner judges
(worker/outcome.py); and the executor's last word (``settle``) where Slurm knows more.

    Slurm state                       ftq
    PENDING, CONFIGURING, REQUEUED    running (ftq's claim) with Slurm's reason logged on the job page
    RUNNING, COMPLETING               running
    COMPLETED, FAILED                 the trainer's done event, else the batch script's exit code
                                      (128+N, or ExitCode's signal: killed by signal N)
    OUT_OF_MEMORY                     failed out_of_memory (Slurm's cgroup said so)
    CANCELLED                         by ftq: cancelled; by someone else: the trainer's checkpoint
                                      then a retry (as TIMEOUT)
    NODE_FAIL, PREEMPTED, BOOT_FAIL   queued again (retry from the last checkpoint) until
                                      FTQ_MAX_ATTEMPTS, then failed node_fail / preempted
    TIMEOUT, DEADLINE                 the same: --signal=TERM@S let the trainer checkpoint first
    a trainer stopped by a TERM       the same (Slurm's time-limit signal, a preemption's grace
    ftq did not send                  or an operator's scancel --signal)
    PENDING for a reason that never   the executor cancels it: failed slurm_refused, naming the
    clears (NEVER: a partition, QOS   reason (no job waits forever on limits it can never meet)
    or account limit the job exceeds)
    ended before the trainer ran      failed slurm_not_started (an operator's scancel, ...)
    a command of --environment failed failed slurm_environment, naming it (worker/slurm/script.py)
"""

from __future__ import annotations

from core.jobs.states import JobStatus
from worker.oom import OomVerdict
from worker.outcome import Outcome
from worker.process import TrainerExit
from worker.slurm.commands import JobState

WAITING = frozenset({"PENDING", "CONFIGURING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD",
                     "SUSPENDED", "RESIZING", "SIGNALING", "STAGE_OUT"})
RUNNING = frozenset({"RUNNING", "COMPLETING"})
NEVER = frozenset({
    "PartitionNodeLimit", "PartitionTimeLimit", "PartitionConfig", "BadConstraints", "InvalidQOS", "InvalidAccount",
    "AccountNotAllowed", "QOSNotAllowed", "DependencyNeverSatisfied", "QOSMaxNodePerJobLimit", "QOSMaxGRESPerJob",
    "QOSMaxCpuPerJobLimit", "QOSMaxWallDurationPerJobLimit", "AssocMaxNodesPerJobLimit", "AssocMaxGRESPerJob",
    "AssocMaxCpuPerJobLimit", "AssocMaxWallDurationPerJobLimit", "QOSMinGRES",
})
"""Pending reasons Slurm gives a job it will never start as submitted (its limits, not its load)."""
LOST_MACHINE = {"NODE_FAIL": "node_fail", "PREEMPTED": "preempted", "BOOT_FAIL": "node_fail"}
OUT_OF_TIME = {"TIMEOUT": "time_limit", "DEADLINE": "time_limit"}


def phase(state: str) -> str:
    """``waiting``, ``running`` or ``ended`` (every state Slurm has not listed above ends the job)."""
    if state in WAITING:
        return "waiting"
    return "running" if state in RUNNING else "ended"


def trainer_exit(job: JobState, stderr_tail: tuple[str, ...], world_size: int, *, started: bool) -> TrainerExit:
    """The batch script's exit as the runner reads a process's (``-N``: killed by signal N)."""
    if not started:
        return TrainerExit(returncode=-1, stderr_tail=stderr_tail, world_size=world_size)
    if job.state == "OUT_OF_MEMORY":
        return TrainerExit(returncode=-9, stderr_tail=stderr_tail, world_size=world_size, oom=OomVerdict.oom,
                           oom_evidence="Slurm ended the job OUT_OF_MEMORY: its nodes' memory limit ran out")
    if job.exit_signal:
        code = -job.exit_signal
    elif job.exit_code > 128:
        code = -(job.exit_code - 128)  # the shell's status of a child killed by a signal
    else:
        code = job.exit_code
    evidence = f"Slurm job state {job.state}, reason {job.reason}"
    return TrainerExit(returncode=code, stderr_tail=stderr_tail, world_size=world_size,
                       oom=OomVerdict.not_oom if code == -9 else OomVerdict.unknown, oom_evidence=evidence)


def settle(outcome: Outcome, job: JobState | None, slurm_job_id: str | None, *, attempt: int,
           max_attempts: int, ran: bool = True, refused: str | None = None,
           environment_failed: str | None = None) -> Outcome:
    """``outcome`` (worker/outcome.py's verdict) corrected by what Slurm says ended the job
    (``ran``: the trainer started; ``refused``: the pending reason the executor cancelled it for;
    ``environment_failed``: the batch script's ``ENV_FAILED`` line, its --environment failed)."""
    if job is None or outcome.status is None or outcome.status in (JobStatus.succeeded, JobStatus.cancelled):
        return outcome
    if refused is not None:
        return Outcome(JobStatus.failed, "slurm_refused", f"Slurm would never start job {slurm_job_id} as submitted "
                       f"(pending reason {refused}: a limit of the partition, QOS or account that the job exceeds), so "
                       "the bridge cancelled it; lower gpus, nodes or the bridge's --time, or ask the cluster's admins")
    if environment_failed is not None and outcome.status is JobStatus.failed:
        return Outcome(JobStatus.failed, "slurm_environment", f"Slurm job {slurm_job_id} ended before the trainer "
                       f"started: {environment_failed.removeprefix('ftq: ')}")
    if not ran and outcome.status is JobStatus.failed:
        return Outcome(JobStatus.failed, "slurm_not_started", f"Slurm job {slurm_job_id} ended {job.state} (reason "
                       f"{job.reason}) before the trainer started; resume the job once the cluster takes it again")
    code = LOST_MACHINE.get(job.state) or OUT_OF_TIME.get(job.state)
    if code is None and outcome.error_code == "interrupted":
        code = "slurm_signal"
    if code is None or outcome.status is JobStatus.queued:
        return outcome
    why = {
        "node_fail": f"a node of Slurm job {slurm_job_id} failed ({job.state}, nodes {job.nodes or '?'})",
        "preempted": f"Slurm preempted job {slurm_job_id}",
        "time_limit": f"Slurm job {slurm_job_id} reached its time limit ({job.state})",
        "slurm_signal": f"Slurm signalled the trainer of job {slurm_job_id} (its time limit's --signal, a preemption's "
                        "grace or an operator's scancel) and it stopped at a checkpoint",
    }[code]
    if attempt < max_attempts:
        return Outcome(JobStatus.queued, code, f"{why}; retrying from the last checkpoint (attempt {attempt} of "
                       f"{max_attempts})", retry=True)
    return Outcome(JobStatus.failed, code, f"{why} on attempt {attempt} of {max_attempts} (FTQ_MAX_ATTEMPTS); "
                   "raise the time limit or FTQ_MAX_ATTEMPTS, or ask why the nodes fail, and resume the job")
