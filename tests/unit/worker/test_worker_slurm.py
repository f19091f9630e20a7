"""The Slurm executor's pure parts: Slurm's states as ftq's exit and outcome, the batch script
of an attempt, the bridge's configuration and its checks at start (a fake ``bin`` directory
stands for Slurm's commands; the real cluster runs in tests/integration/e2e/test_slurm_e2e.py)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from core.jobs.states import JobStatus
from core.settings import Settings
from worker.oom import OomVerdict
from worker.outcome import Outcome
from worker.slurm import bridge, states
from worker.slurm.commands import JobState, Partition, SlurmCli, gres_gpus, parse_fields
from worker.slurm.config import BridgeConfig
from worker.slurm.script import ENV_FAILED, SHUTDOWN_MARGIN_S, Attempt, batch_script


@pytest.mark.parametrize(("state", "phase"), [("PENDING", "waiting"), ("CONFIGURING", "waiting"),
                                              ("RUNNING", "running"), ("COMPLETING", "running"),
                                              ("COMPLETED", "ended"), ("NODE_FAIL", "ended"), ("UNKNOWN", "ended")])
def test_phases(state, phase):
    assert states.phase(state) == phase


def test_exit_codes_and_signals_read_as_a_process_exit():
    def exit_of(job: JobState, started: bool = True) -> int:
        return states.trainer_exit(job, ("tail",), 1, started=started).returncode

    assert exit_of(JobState("COMPLETED")) == 0
    assert exit_of(JobState("FAILED", "NonZeroExitCode", 3)) == 3
    assert exit_of(JobState("FAILED", "NonZeroExitCode", 137)) == -9, "the shell's 128+9: killed by SIGKILL"
    assert exit_of(JobState("CANCELLED", "None", 0, 15)) == -15
    assert exit_of(JobState("CANCELLED"), started=False) == -1
    oom = states.trainer_exit(JobState("OUT_OF_MEMORY"), (), 1, started=True)
    assert oom.returncode == -9 and oom.oom is OomVerdict.oom and "OUT_OF_MEMORY" in oom.oom_evidence
    assert states.trainer_exit(JobState("FAILED", "x", 137), (), 1, started=True).oom is OomVerdict.not_oom


FAILED = Outcome(JobStatus.failed, "killed", "the trainer was killed by SIGTERM")


@pytest.mark.parametrize(("state", "code"), [("NODE_FAIL", "node_fail"), ("PREEMPTED", "preempted"),
                                             ("BOOT_FAIL", "node_fail"), ("TIMEOUT", "time_limit")])
def test_a_lost_node_preemption_or_time_limit_is_a_retry_until_max_attempts(state, code):
    retried = states.settle(FAILED, JobState(state, nodes="n2"), "41", attempt=1, max_attempts=3)
    assert (retried.status, retried.error_code, retried.retry) == (JobStatus.queued, code, True)
    assert "41" in (retried.message or "") and "retrying from the last checkpoint" in (retried.message or "")
    last = states.settle(FAILED, JobState(state), "41", attempt=3, max_attempts=3)
    assert (last.status, last.error_code) == (JobStatus.failed, code)


def test_a_trainer_stopped_by_slurms_own_term_resumes_and_ftqs_verdicts_stand():
    interrupted = Outcome(JobStatus.failed, "interrupted", "stopped by a signal that did not come from ftq")
    settled = states.settle(interrupted, JobState("COMPLETED"), "7", attempt=1, max_attempts=2)
    assert (settled.status, settled.error_code) == (JobStatus.queued, "slurm_signal")
    for kept in (Outcome(JobStatus.succeeded), Outcome(JobStatus.cancelled), Outcome(None),
                 Outcome(JobStatus.failed, "trainer_crashed", "exit 1")):
        assert states.settle(kept, JobState("FAILED", "NonZeroExitCode", 1), "7", attempt=1, max_attempts=2) is kept
    assert states.settle(FAILED, None, None, attempt=1, max_attempts=2) is FAILED


def config(tmp_path: Path, **fields) -> BridgeConfig:
    return BridgeConfig(partition="gpu", shared_dir=tmp_path, python="/opt/ftq/bin/python", **fields)


def attempt(tmp_path: Path, nodes: int, per_node: int) -> Attempt:
    return Attempt("job-1", 2, nodes, per_node, tmp_path / "job.json", tmp_path / "out", "ftq:bridge")


def test_one_rank_is_the_trainer_itself_under_srun(tmp_path):
    script = batch_script(config(tmp_path), attempt(tmp_path, 1, 1))
    assert script.startswith("#!/bin/bash\n")
    for option in ("--job-name=ftq-job-1", "--comment=ftq:bridge", "--partition=gpu", "--nodes=1",
                   "--ntasks-per-node=1", "--cpus-per-task=1", "--signal=TERM@120", "--no-requeue",
                   f"--output={tmp_path}/ftq-jobs/job-1/attempt-2/events.jsonl",
                   f"--error={tmp_path}/ftq-jobs/job-1/attempt-2/stderr.log", f"--chdir={tmp_path}/out"):
        assert f"#SBATCH {option}\n" in script, option
    assert f"srun --nodes=1 --ntasks=1 /opt/ftq/bin/python -m trainer run {tmp_path}/job.json\nexit $?" in script
    assert "torch.distributed.run" not in script and "--account" not in script and "--time" not in script


def test_several_nodes_run_one_torchrun_each_meeting_at_the_first_node(tmp_path):
    cfg = config(tmp_path, gpus_per_node=8, account="lab", qos="high", time_limit="1-00:00:00", signal_s=300,
                 environment="module load cuda\nsource /opt/ftq/bin/activate", container="nvcr.io/ftq:1")
    script = batch_script(cfg, attempt(tmp_path, 4, 8))
    for option in ("--nodes=4", "--gpus-per-node=8", "--account=lab", "--qos=high", "--time=1-00:00:00",
                   "--signal=TERM@300"):
        assert f"#SBATCH {option}\n" in script, option
    assert "--cpus-per-task" not in script
    assert script.index("module load cuda\nsource /opt/ftq/bin/activate") < script.index("srun ")
    launch = script[script.index("srun "):]
    assert launch.startswith("srun --nodes=4 --ntasks-per-node=1 --kill-on-bad-exit=1 --container-image=nvcr.io/ftq:1 bash -c ")
    for arg in ("--nnodes=4", "--nproc-per-node=8", "--rdzv-backend=c10d", '--rdzv-endpoint="$FTQ_RDZV"',
                "--rdzv-id=ftq-job-1-2", "--rdzv-conf=is_host=$((SLURM_NODEID == 0 ? 1 : 0))", "-m trainer run"):
        assert arg in launch, arg
    assert 'NodeAddr' in script and 'export FTQ_RDZV="${addr:-$head}:$port"' in script
    assert "TORCH_ELASTIC_SHUTDOWN_TIMEOUT" not in batch_script(cfg, attempt(tmp_path, 1, 1))


def test_torchrun_waits_for_its_ranks_past_the_stop_grace(tmp_path):
    """A TERM reaches torchrun too, which SIGKILLs its ranks shutdown_timeout later (30 s by
    default): the script sets it past the grace, so a long checkpoint is not cut (e2e tested)."""
    several = Attempt("job-1", 2, 2, 2, tmp_path / "job.json", tmp_path / "out", "ftq:bridge", stop_grace_s=600)
    script = batch_script(config(tmp_path), several)
    assert f"export TORCH_ELASTIC_SHUTDOWN_TIMEOUT={600 + SHUTDOWN_MARGIN_S}\n" in script
    assert script.index("TORCH_ELASTIC_SHUTDOWN_TIMEOUT") < script.index("\nsrun ")


PROFILE = """# as sites' profile scripts do: read variables that may be unset, run tests that fail
if [ -n "$MODULEPATH_ROOT" ]; then export MODULEPATH="$MODULEPATH_ROOT"; fi
[ -z "$CONDA_SHLVL" ] && false
ftq_module() { false; return 0; }
"""


def run_environment(tmp_path: Path, environment: str) -> subprocess.CompletedProcess[str]:
    """The generated script up to its launch, run by bash (srun is the e2e tests' business), in an
    environment without MODULEPATH_ROOT or CONDA_SHLVL; it prints FTQ_ENV_READY at the end."""
    (tmp_path / "profile.sh").write_text(PROFILE)
    script = batch_script(config(tmp_path, environment=environment), attempt(tmp_path, 1, 1))
    head = tmp_path / "head.sh"
    head.write_text(script[:script.index("\nsrun ")] + '\necho "FTQ_ENV_READY=${FTQ_ENV_READY:-unset}"\n')
    env = {k: v for k, v in os.environ.items() if k not in ("MODULEPATH_ROOT", "CONDA_SHLVL")}
    return subprocess.run(["bash", str(head)], capture_output=True, text=True, env=env, timeout=30, check=False)


def test_the_environment_runs_without_set_u_before_the_launch_that_has_it(tmp_path):
    """``source /etc/profile.d/modules.sh``, ``module load``, ``conda activate`` read unset
    variables and run failing tests; under ``set -u`` (or ``set -e``) the batch script would abort."""
    environment = f"source {tmp_path}/profile.sh\nftq_module load cuda\nif [ -n \"$UNSET_TOO\" ]; then :; fi\n" \
                  "export FTQ_ENV_READY=yes"
    done = run_environment(tmp_path, environment)
    assert (done.returncode, done.stdout, done.stderr) == (0, "FTQ_ENV_READY=yes\n", "")
    script = batch_script(config(tmp_path, environment=environment), attempt(tmp_path, 1, 1))
    assert script.index("export FTQ_ENV_READY=yes") < script.index("\nset -u\n") < script.index("srun ")


def test_a_failing_environment_command_ends_the_job_naming_it(tmp_path):
    done = run_environment(tmp_path, f"source {tmp_path}/profile.sh\nsource {tmp_path}/venv/bin/activate\n"
                                     "export FTQ_ENV_READY=yes")
    assert done.returncode == 1 and "FTQ_ENV_READY" not in done.stdout
    (line,) = [line for line in done.stderr.splitlines() if line.startswith(ENV_FAILED)]
    assert f"`source {tmp_path}/venv/bin/activate` (line " in line and "exited with status 1" in line, line
    harmless = run_environment(tmp_path, f"source {tmp_path}/venv/bin/activate || true\nexport FTQ_ENV_READY=yes")
    assert harmless.returncode == 0 and harmless.stdout == "FTQ_ENV_READY=yes\n"
    settled = states.settle(Outcome(JobStatus.failed, "trainer_crashed", "exit 1"), JobState("FAILED", "x", 1), "9",
                            attempt=1, max_attempts=3, environment_failed=line)
    assert settled.error_code == "slurm_environment" and "Slurm job 9 ended before the trainer started: the Slurm " \
        "bridge's --environment failed: `source" in (settled.message or "")
    cancelled = Outcome(JobStatus.cancelled)
    assert states.settle(cancelled, JobState("CANCELLED"), "9", attempt=1, max_attempts=3,
                         environment_failed=line) is cancelled


@pytest.mark.parametrize(("fields", "message"), [
    ({"partition": "gpu;rm"}, "partition: 'gpu;rm' is not a Slurm name"),
    ({"gpus_per_node": -1}, "gpus_per_node: must be >= 0"),
    ({"time_limit": "tomorrow"}, "time_limit: 'tomorrow' is not a Slurm time"),
    ({"shared_dir": Path("relative")}, "shared_dir: relative must be an absolute path"),
    ({"shared_dir": Path("/mnt/lab share")}, "shared_dir: '/mnt/lab share' has whitespace or '%'"),
    ({"shared_dir": Path("/mnt/100%")}, "shared_dir: '/mnt/100%' has whitespace or '%'"),
])
def test_bad_configuration_names_the_field(tmp_path, fields, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        BridgeConfig(**{"partition": "gpu", "shared_dir": tmp_path, **fields})


def test_parsers():
    assert gres_gpus("gpu:a100:8(S:0-1)") == 8 and gres_gpus("gpu:4,gpu:v100:2") == 6 and gres_gpus("(null)") == 0
    assert parse_fields("JobId=5 JobName=ftq job Reason=None ExitCode=0:9") == {
        "JobId": "5", "JobName": "ftq job", "Reason": "None", "ExitCode": "0:9"}


def fake_slurm(tmp_path: Path, sinfo_output: str) -> SlurmCli:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("sbatch", "squeue", "scancel", "scontrol"):
        (bin_dir / name).write_text("#!/bin/sh\nexit 0\n")
    names = " ".join(line.split("|")[0] for line in sinfo_output.split("\\n") if line)
    (bin_dir / "sinfo").write_text(f"#!/bin/sh\ncase \"$*\" in *'%P|'*) printf '{sinfo_output}';; *) echo {names};; esac\n")
    for script in bin_dir.iterdir():
        script.chmod(0o755)
    return SlurmCli(bin_dir)


def test_the_bridge_refuses_to_start_without_sbatch_or_its_partition(tmp_path):
    settings = Settings(data_dir=tmp_path / "data").resolved()
    with pytest.raises(bridge.BridgeError, match="sbatch is not in .*--slurm-bin"):
        bridge.check(config(tmp_path), SlurmCli(tmp_path / "nowhere"), settings)
    cli = fake_slurm(tmp_path, "cpu*|2|4|(null)|up\\n")
    with pytest.raises(bridge.BridgeError, match=r"partition 'gpu' does not exist .*\(its partitions: cpu\)"):
        bridge.check(config(tmp_path), cli, settings)


def test_the_bridge_refuses_more_than_the_nodes_have_and_a_data_dir_off_the_shared_one(tmp_path):
    cli = fake_slurm(tmp_path, "gpu|3|64|gpu:h100:4(S:0-1)|up\\n")
    inside = Settings(data_dir=tmp_path / "data").resolved()
    assert bridge.check(config(tmp_path, gpus_per_node=4), cli, inside) == Partition("gpu", 3, 64, 4, True)
    with pytest.raises(bridge.BridgeError, match="--gpus-per-node 8: the nodes of partition 'gpu' have 4 GPUs"):
        bridge.check(config(tmp_path, gpus_per_node=8), cli, inside)
    (tmp_path / "data").mkdir()
    outside = Settings(data_dir=tmp_path.parent / "elsewhere").resolved()
    with pytest.raises(bridge.BridgeError, match="FTQ_DATA_DIR .* is outside --shared-dir"):
        bridge.check(config(tmp_path / "data", gpus_per_node=4), cli, outside)
    options = bridge.worker_options(config(tmp_path, gpus_per_node=4), cli, Partition("gpu", 3, 64, 4, True), "b")
    assert (options.slots, options.executor, options.pool_name) == (12, "slurm", "slurm")


def test_a_slurm_claims_checkpoints_live_in_the_clusters_shared_directory(tmp_path: Path) -> None:
    """The executor's ``shared_home`` is the claim's (worker/runner.py): a bridge with a worker key
    then records each checkpoint where the ranks wrote it instead of uploading ``output_dir``'s,
    which the trainer never writes; the layout is ftq's own shared storage's (``<shared>/jobs/<id>``),
    which an API host mounting the directory serves."""
    from core.jobs.artifact_store import shared_job_dir
    from worker.executors.base import Executor
    from worker.executors.slurm import SlurmExecutor

    bound = SlurmExecutor.bound(config(tmp_path), SlurmCli())
    assert bound.shared_home("job-1") == shared_job_dir(tmp_path, "job-1") == tmp_path / "jobs" / "job-1"
    assert Executor.shared_home("job-1") is None, "other executors leave it to the claim"


def test_the_bridges_jobs_are_its_users_named_ftq_and_commented(tmp_path: Path) -> None:
    """``SlurmCli.jobs``: ``squeue --me``, and of its lines only jobs named ``ftq-...`` with the
    bridge's comment (the leftovers the bridge cancels at start); a job of another name with the
    same comment is not the bridge's."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    squeue = bin_dir / "squeue"
    squeue.write_text('#!/bin/sh\ncase "$*" in *--me*) ;; *) exit 1;; esac\n'
                      "printf '11|ftq-job-1|PENDING|Resources|ftq:b1\\n12|sweep|RUNNING|None|ftq:b1\\n"
                      "13|ftq-job-2|RUNNING|None|ftq:b2\\n'\n")
    squeue.chmod(0o755)
    assert SlurmCli(bin_dir).jobs("ftq:b1") == [
        {"slurm_job_id": "11", "name": "ftq-job-1", "state": "PENDING", "reason": "Resources"}]
