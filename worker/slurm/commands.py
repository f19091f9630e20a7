"""Slurm's client commands, run and parsed: what the bridge and its executor ask the cluster.

Every command runs with a timeout and its output is parsed here only. A job's state comes from
``scontrol show job`` (slurmctld keeps a finished job for ``MinJobAge``, 300 s by default), then
from ``sacct`` (accounting) once slurmctld forgot it; neither: the job is ``UNKNOWN``.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

TIMEOUT_S = 30.0
GRES_GPUS = re.compile(r"(?:^|,)gpu(?::[^:,()]+)?:(\d+)")


class SlurmError(RuntimeError):
    """A Slurm command failed or is missing; the message names the command and what it said."""


@dataclass(frozen=True)
class Partition:
    name: str
    nodes: int
    cpus_per_node: int
    gpus_per_node: int
    available: bool
    """The partition is ``up``."""


@dataclass(frozen=True)
class NodeUse:
    """What the partition's nodes hold now (``sinfo -N``), summed."""

    nodes: dict[str, int] = field(default_factory=dict)
    """Nodes by state group: ``idle``, ``allocated`` (alloc or mix), ``other`` (down, drained, ...)."""
    cpus: dict[str, int] = field(default_factory=dict)
    gpus: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class JobState:
    state: str
    """Slurm's state (``PENDING``, ``RUNNING``, ``COMPLETED``, ``NODE_FAIL``, ...; ``UNKNOWN``: not found)."""
    reason: str = "None"
    """Why it waits or ended (``Resources``, ``Priority``, ``NonZeroExitCode``, ...)."""
    exit_code: int = 0
    """The batch script's exit status."""
    exit_signal: int = 0
    """The signal that ended it (0: none)."""
    nodes: str = ""


def gres_gpus(gres: str) -> int:
    """GPUs in an sinfo ``%G`` value (``gpu:4``, ``gpu:a100:8(S:0-1)``, ``(null)``: 0)."""
    return sum(int(n) for n in GRES_GPUS.findall(re.sub(r"\([^)]*\)", "", gres)))


def parse_fields(line: str) -> dict[str, str]:
    """``Key=value Key2=value2`` (``scontrol -o``) as a dict; a value ends at the next `` Key=``."""
    return dict(re.findall(r"(\S+?)=(.*?)(?= \S+?=|$)", line.strip()))


class SlurmCli:
    """Slurm's commands on this host (found on PATH, or in ``bin_dir``)."""

    def __init__(self, bin_dir: Path | None = None, timeout_s: float = TIMEOUT_S) -> None:
        self.bin_dir = bin_dir
        self.timeout_s = timeout_s

    def which(self, command: str) -> str | None:
        if self.bin_dir is not None:
            path = self.bin_dir / command
            return str(path) if path.is_file() else None
        return shutil.which(command)

    def run(self, command: str, *args: str, check: bool = True,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        path = self.which(command)
        if path is None:
            where = f"in {self.bin_dir}" if self.bin_dir else "on PATH"
            raise SlurmError(f"{command} is not {where}: run the bridge on a host where Slurm's client commands "
                             "work (a login node), or give --slurm-bin DIR")
        try:
            done = subprocess.run([path, *args], capture_output=True, text=True, timeout=self.timeout_s, check=False,
                                  env=env)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise SlurmError(f"{command} {' '.join(args)} did not run: {exc}") from exc
        if check and done.returncode != 0:
            said = (done.stderr or done.stdout).strip().splitlines()
            raise SlurmError(f"{command} {' '.join(args)} exited with {done.returncode}: {' | '.join(said[-3:])}")
        return done

    def partition(self, name: str) -> Partition | None:
        """The partition ``name`` (None: Slurm has none of that name)."""
        out = self.run("sinfo", "-h", "-p", name, "-o", "%P|%D|%c|%G|%a").stdout
        rows = [line.split("|") for line in out.splitlines() if line.strip()]
        rows = [r for r in rows if len(r) == 5 and r[0].rstrip("*") == name]
        if not rows:
            return None
        return Partition(
            name=name,
            nodes=sum(int(r[1]) for r in rows),
            cpus_per_node=min(int(re.sub(r"\D.*", "", r[2]) or 0) for r in rows),
            gpus_per_node=min(gres_gpus(r[3]) for r in rows),
            available=all(r[4] == "up" for r in rows),
        )

    def node_use(self, partition: str) -> NodeUse:
        """Nodes, CPUs and GPUs of ``partition`` idle and allocated now."""
        out = self.run("sinfo", "-h", "-N", "-p", partition, "-O", "NodeList:|,StateLong:|,CPUsState:|,Gres:|,GresUsed:").stdout
        nodes = {"idle": 0, "allocated": 0, "other": 0}
        cpus = {"idle": 0, "allocated": 0, "total": 0}
        gpus = {"idle": 0, "allocated": 0, "total": 0}
        for line in out.splitlines():
            parts = [p.strip() for p in line.split("|")]
            if len(parts) < 5:
                continue
            state = parts[1].rstrip("*~#!%$@^-")
            group = "idle" if state == "idle" else "allocated" if state in ("allocated", "mixed", "completing") else "other"
            nodes[group] += 1
            alloc, idle, _other, total = (int(x) for x in parts[2].split("/"))
            cpus["allocated"] += alloc
            cpus["idle"] += idle
            cpus["total"] += total
            have, used = gres_gpus(parts[3]), gres_gpus(parts[4])
            gpus["total"] += have
            gpus["allocated"] += used
            gpus["idle"] += have - used if group != "other" else 0
        return NodeUse(nodes, cpus, gpus)

    def submit(self, script: Path, env: dict[str, str] | None = None) -> str:
        """``sbatch --parsable script`` in ``env`` (the job's environment: sbatch exports it); the Slurm job id."""
        out = self.run("sbatch", "--parsable", str(script), env=env).stdout.strip()
        job_id = out.split(";")[0]
        if not job_id.isdigit():
            raise SlurmError(f"sbatch printed {out!r}, not a job id")
        return job_id

    def state(self, slurm_job_id: str) -> JobState:
        done = self.run("scontrol", "-o", "show", "job", slurm_job_id, check=False)
        if done.returncode == 0 and done.stdout.strip():
            fields = parse_fields(done.stdout.splitlines()[0])
            code, _, sig = fields.get("ExitCode", "0:0").partition(":")
            return JobState(fields.get("JobState", "UNKNOWN"), fields.get("Reason", "None"), int(code or 0),
                            int(sig or 0), fields.get("NodeList", ""))
        return self._accounted(slurm_job_id)

    def _accounted(self, slurm_job_id: str) -> JobState:
        if self.which("sacct") is None:
            return JobState("UNKNOWN")
        done = self.run("sacct", "-n", "-P", "-X", "-j", slurm_job_id, "-o", "State,ExitCode,Reason,NodeList",
                        check=False)
        rows = [line.split("|") for line in done.stdout.splitlines() if line.count("|") == 3]
        if done.returncode != 0 or not rows:
            return JobState("UNKNOWN")
        state, exit_code, reason, nodes = rows[-1]
        code, _, sig = exit_code.partition(":")
        return JobState(state.split()[0], reason or "None", int(code or 0), int(sig or 0), nodes)

    def jobs(self, comment: str) -> list[dict[str, str]]:
        """The bridge user's own jobs (``--me``) named ``ftq-...`` and carrying ``--comment=<comment>``:
        id, name, state, reason. Another user's job with the same comment is never one of them (the
        bridge cancels its leftovers at start)."""
        out = self.run("squeue", "-h", "--me", "-o", "%i|%j|%T|%r|%k").stdout
        found = []
        for line in out.splitlines():
            parts = line.split("|", 4)
            if len(parts) == 5 and parts[4].strip() == comment and parts[1].startswith("ftq-"):
                found.append({"slurm_job_id": parts[0], "name": parts[1], "state": parts[2], "reason": parts[3]})
        return found

    def cancel(self, slurm_job_id: str, *, signal: str | None = None) -> bool:
        """``scancel`` (``signal``: to the job's steps only, e.g. ``TERM``); whether Slurm took it."""
        args: Sequence[str] = (f"--signal={signal}", slurm_job_id) if signal else (slurm_job_id,)
        return self.run("scancel", *args, check=False).returncode == 0
