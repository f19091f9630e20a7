"""Helpers of the several-rank tests: a tiny job with a global batch of 2 ranks, run by one
process (``python -m trainer run``) or by ``torchrun --standalone --nproc_per_node=N`` (gloo on
the CPU), and what the runs left behind (events, weights). ``run_here`` runs the one process in the
test's own (no start-up, no imports again) where a test compares numbers, not processes. Imported
by name, like ``trainer_helpers``.

Every process runs with one torch thread (``OMP_NUM_THREADS=1``, what torchrun gives each of
several ranks anyway), so the 1-process run and the ranks compute each micro-batch with the same
matmul reduction order; what is left to differ is how the ranks' parts are summed.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from trainer_helpers import REPO_ROOT, events_of, make_job, write_jsonl

STEPS = 6
"""Optimizer steps of every job here (the schedule's length: a resumed run must share it)."""
CHECKPOINT_EVERY = 2
"""Checkpoints at steps 2, 4, 6: a resume starts from step 2 or 4."""


def job_env() -> dict[str, str]:
    # the repo first, then the caller's own path (packages installed with --target on a lent GPU machine)
    path = os.pathsep.join([str(REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    return {**os.environ, "PYTHONPATH": path, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}


FORCE_FSDP2 = Path(__file__).with_name("force_fsdp2.py")
"""A script that runs the trainer CLI with the parallelism decision forced to FSDP2."""


def command(job: Path, ranks: int, *, fsdp2: bool = False) -> list[str]:
    """``python -m trainer run job`` for one process, else torchrun's ``--standalone`` launch
    (``fsdp2``: of ``FORCE_FSDP2``, so even LoRA is sharded)."""
    trainer = [*([str(FORCE_FSDP2)] if fsdp2 else ["-m", "trainer"]), "run", str(job)]
    if ranks == 1:
        return [sys.executable, *trainer]
    launch = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
    return [sys.executable, *launch, *trainer]


def write_job(
    directory: Path,
    model_dir: Path,
    method: str,
    *,
    steps: int = STEPS,
    checkpoint_every: int = CHECKPOINT_EVERY,
    **overrides: object,
) -> Path:
    """``directory/job.json``: ``gpus: 2`` x ``grad_accum: 2`` micro-batches per step (so each of
    two ranks accumulates two, and skips the gradient exchange on its first), gradient
    checkpointing on (FSDP2 gathers again in the recompute), a small validation set (3 batches:
    two on rank 0, one on rank 1, which under FSDP2 runs a spare forward to pair the gathers), a checkpoint every ``checkpoint_every`` steps; output in ``directory/out``. ``overrides`` replace
    top-level ``TrainConfig`` fields (``device="cuda"`` on the GPU machines)."""
    from trainer.config import OptimConfig

    directory.mkdir(parents=True, exist_ok=True)
    validation = write_jsonl(
        directory / "val.jsonl",
        [
            {"messages": [{"role": "user", "content": f"What is {i} plus {i}?"},
                          {"role": "assistant", "content": f"The answer is {2 * i}, as always."}]}
            for i in range(18)
        ],
    )
    config = make_job(
        directory,
        model_dir,
        method=method,
        gpus=2,
        gradient_checkpointing=True,
        checkpoint_every=checkpoint_every,
        optim=OptimConfig(
            max_steps=steps, grad_accum=2, warmup_steps=1, learning_rate=1e-3 if method == "full" else 1e-2
        ),
        **overrides,
    )
    config = dataclasses.replace(config, data=dataclasses.replace(config.data, validation_path=str(validation)))
    config.save(directory / "job.json")
    return directory / "job.json"


@dataclass
class Finished:
    """A finished launch: exit status, events (rank 0's stdout), stderr, and its output dir."""

    returncode: int
    events: list[dict]
    stderr: str
    out: Path

    def of(self, type_: str) -> list[dict]:
        return [e for e in self.events if e["type"] == type_]

    def steps(self) -> dict[int, dict]:
        return {e["step"]: e for e in self.of("step")}

    @property
    def done(self) -> dict:
        (done,) = self.of("done")
        return done


def launch(job: Path, ranks: int, timeout: float = 150, *, fsdp2: bool = False) -> Finished:
    """Run ``job`` on ``ranks`` processes to the end (``fsdp2``: see ``command``)."""
    result = subprocess.run(
        command(job, ranks, fsdp2=fsdp2), cwd=REPO_ROOT, env=job_env(), capture_output=True, text=True,
        timeout=timeout, check=False,
    )
    return Finished(result.returncode, events_of(result.stdout), result.stderr, job.parent / "out")


def run_here(job: Path) -> Finished:
    """``launch(job, 1)`` in this process (``tests.fixtures.trainer_here``): the same events and
    output dir without a Python start and the trainer's imports; ``stderr`` is empty."""
    from tests.fixtures.trainer_here import train_here

    returncode, events = train_here(job)
    return Finished(returncode, events, "", job.parent / "out")


def resume_copy(checkpoint: Path, directory: Path, model_dir: Path, method: str, **overrides: object) -> Path:
    """A new job in ``directory`` whose output dir holds only ``checkpoint`` (what a run stopped
    at that step leaves): running it resumes there. ``overrides``: as ``write_job``'s."""
    job = write_job(directory, model_dir, method, **overrides)
    target = directory / "out" / "checkpoints" / checkpoint.name
    shutil.copytree(checkpoint, target)
    return job


def weights(directory: Path) -> dict:
    """Every tensor of the ``*.safetensors`` files in ``directory`` (an export or adapter)."""
    from safetensors.torch import load_file

    found: dict = {}
    for f in sorted(directory.glob("*.safetensors")):
        found.update(load_file(f))
    assert found, f"no safetensors in {directory}"
    return found


class Started:
    """A launch in the background: its events read line by line as they come, its process tree
    (torchrun and the ranks it started) at hand. ``close()`` ends whatever of that tree still runs
    (only those processes, by pid) and returns the finished launch."""

    def __init__(self, job: Path, ranks: int, stderr_path: Path) -> None:
        import psutil

        self.out = job.parent / "out"
        self._stderr_path = stderr_path
        self._stderr = stderr_path.open("w")
        self.process = subprocess.Popen(
            command(job, ranks), cwd=REPO_ROOT, env=job_env(), stdout=subprocess.PIPE,
            stderr=self._stderr, text=True,
        )
        self.events: list[dict] = []
        self.seen: dict[int, psutil.Process] = {self.process.pid: psutil.Process(self.process.pid)}

    def wait_for(self, type_: str) -> dict:
        """Read events until one of ``type_`` arrives (the launch must not end first)."""
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.events.extend(events_of(line))
            if self.events and self.events[-1]["type"] == type_:
                return self.events[-1]
        raise AssertionError(f"the launch ended before a {type_!r} event: {self.events[-3:]}")

    def ranks(self) -> dict[int, object]:
        """The rank processes now running under torchrun, by their ``RANK``."""
        found = {}
        for child in self.seen[self.process.pid].children(recursive=True):
            self.seen[child.pid] = child
            rank = child.environ().get("RANK")
            if rank is not None and "trainer" in child.cmdline():
                found[int(rank)] = child
        return found

    def finish(self, timeout: float = 120) -> Finished:
        """Wait for the launch to end on its own."""
        assert self.process.stdout is not None
        rest, _ = self.process.communicate(timeout=timeout)
        self.events.extend(events_of(rest))
        self._stderr.close()
        return Finished(self.process.returncode, self.events, self._stderr_path.read_text(), self.out)

    def survivors(self, timeout: float = 30) -> list:
        """The processes of this launch still running after ``timeout`` seconds."""
        import psutil

        _, alive = psutil.wait_procs(list(self.seen.values()), timeout=timeout)
        return alive

    def close(self) -> None:
        """Kill what is left of this launch (a failed test must not leave ranks behind)."""
        import psutil

        for proc in self.seen.values():
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        if self.process.poll() is None:
            self.process.wait(timeout=30)
        self._stderr.close()
