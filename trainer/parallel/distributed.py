"""Several ranks under torchrun: who this process is, its share of each global step, what crosses ranks.

Launch: ``torchrun --standalone --nproc_per_node=N -m trainer run job.json`` (``--nnodes``,
``--node_rank`` and ``--rdzv_endpoint`` for several machines). torchrun sets ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK`` and the rendezvous address; ``World.from_env`` reads them and
``Comm.start`` joins the process group: NCCL on CUDA (device ``cuda:LOCAL_RANK``), gloo on the
CPU. A second, gloo group carries the small host-side values (per-rank timings and memory, the
stop flag), so gathering them never waits on a GPU stream: no host sync per step.

The global step: a job's global batch is ``gpus x grad_accum`` packed micro-batches per optimizer
step (``TrainConfig.global_micro_batches``), scheduled identically on every rank from the host
lengths (``trainer.data.packing.BatchSchedule``). ``share`` hands each rank a disjoint, deterministic,
token-balanced part of the step's micro-batches, so no rank waits for a long tail. Every
micro-batch's loss is divided by the step's global label count (a host int every rank computes
alike: no all-reduce of counts), and the rank's loss is multiplied by the world size because DDP
and FSDP average gradients over ranks; the average is then the step's mean, exactly as one rank
computes it over the whole step. The epoch position (``data_position``) counts global
micro-batches, so a run resumed on another number of ranks continues the same sample order.

Shapes (legend): ``W`` ranks, ``M`` micro-batches in a global step.
"""

from __future__ import annotations

import datetime
import os
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from trainer.errors import ConfigError


@dataclass(frozen=True)
class World:
    """This process's place among the job's ranks (one rank, world size 1, without torchrun)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @classmethod
    def from_env(cls) -> World:
        """Read torchrun's ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` (absent: a single process)."""
        try:
            world = cls(
                rank=int(os.environ.get("RANK", "0")),
                world_size=int(os.environ.get("WORLD_SIZE", "1")),
                local_rank=int(os.environ.get("LOCAL_RANK", "0")),
            )
        except ValueError as exc:
            raise ConfigError(f"RANK/WORLD_SIZE/LOCAL_RANK must be integers (torchrun sets them): {exc}") from exc
        if not 0 <= world.rank < world.world_size:
            raise ConfigError(f"RANK={world.rank} is outside WORLD_SIZE={world.world_size}")
        return world

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that emits events and writes what is written once."""
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1


def share(micro_batch_tokens: Sequence[int], world_size: int) -> list[list[int]]:
    """Split a step's micro-batches over ranks: positions per rank, token-balanced, deterministic.

    Longest first, each to the rank with the fewest tokens so far (ties: fewer micro-batches,
    then the lower rank); each rank keeps its micro-batches in step order. A step with fewer
    micro-batches than ranks (the short last step of an epoch) leaves the last ranks empty:
    ``train_step`` gives them a zero-weighted stand-in so the collectives still pair.
    """
    load = [0] * world_size
    parts: list[list[int]] = [[] for _ in range(world_size)]
    order = sorted(range(len(micro_batch_tokens)), key=lambda i: (-micro_batch_tokens[i], i))
    for i in order:
        rank = min(range(world_size), key=lambda r: (load[r], len(parts[r]), r))
        parts[rank].append(i)
        load[rank] += micro_batch_tokens[i]
    return [sorted(p) for p in parts]


class Comm:
    """The job's process groups, or (one rank) a twin whose collectives return their input.

    Args:
        world: this process's rank and the world size.
        device: the training device (``cuda:LOCAL_RANK`` or ``cpu``): NCCL for CUDA, gloo for CPU.
        timeout_s: how long a collective waits for a rank that is gone before it raises.
    """

    def __init__(self, world: World, device: torch.device, timeout_s: float = 600.0) -> None:
        self.world = world
        self.device = device
        self.backend = "nccl" if device.type == "cuda" else "gloo"
        self._host_group: Any = None
        self._timeout = datetime.timedelta(seconds=timeout_s)

    def start(self) -> Comm:
        """Join the process group (a no-op for one rank); returns ``self``."""
        if not self.world.is_distributed:
            return self
        import torch.distributed as dist

        if not dist.is_initialized():
            kwargs: dict[str, Any] = {"backend": self.backend, "timeout": self._timeout}
            if self.device.type == "cuda":
                kwargs["device_id"] = self.device
            dist.init_process_group(**kwargs)
        self._host_group = dist.new_group(backend="gloo", timeout=self._timeout)
        return self

    def close(self) -> None:
        if self.world.is_distributed:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over ranks in place on its device (queued on the stream: no host sync)."""
        if self.world.is_distributed:
            import torch.distributed as dist

            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def broadcast_from_first(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` as rank 0 holds it, on every rank (in place on its device; queued, no host sync)."""
        if self.world.is_distributed:
            import torch.distributed as dist

            dist.broadcast(tensor, src=0)
        return tensor

    def gather_host(self, values: Sequence[float], purpose: str) -> list[list[float]]:
        """Every rank's ``values`` (host floats, same length on each), over the gloo group.

        ``purpose`` names the call site (``"stop vote"``, ``"oom agree"``, ...): it travels with
        the values, and ranks that meet in gathers of different purposes (out of step: one made a
        host collective the other did not) raise ``RuntimeError`` naming both, where gathers of
        the same shape would otherwise pair silently and the ranks go on diverging.
        """
        if not self.world.is_distributed:
            return [list(values)]
        import torch.distributed as dist

        tag = _purpose_tag(purpose)
        mine = torch.tensor([tag, *values], dtype=torch.float64)
        out = [torch.empty_like(mine) for _ in range(self.world.world_size)]
        dist.all_gather(out, mine, group=self._host_group)
        rows = [t.tolist() for t in out]
        if any(row[0] != tag for row in rows):
            where = ", ".join(f"rank {r} at {_PURPOSES.get(row[0], f'tag {row[0]:.0f}')!r}" for r, row in enumerate(rows))
            raise RuntimeError(f"ranks out of step in a host collective: {where}")
        return [row[1:] for row in rows]

    def any_rank(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is true on any (the stop flag: all ranks stop together)."""
        if not self.world.is_distributed:
            return flag
        return max(v[0] for v in self.gather_host([1.0 if flag else 0.0], "stop vote")) > 0

    def barrier(self) -> None:
        if self.world.is_distributed:
            import torch.distributed as dist

            dist.barrier(group=self._host_group)


HOST_GATHERS = ("stop vote", "oom agree", "step metrics", "rank index", "eval loss", "free memory",
                "grpo token counts", "grpo flops")
"""The trainer's ``gather_host`` purposes, known to every rank so a mismatch names the other's too."""


def _purpose_tag(purpose: str) -> float:
    """A stable number for ``purpose`` (the same on every rank and run: crc32, exact in a float64)."""
    tag = float(zlib.crc32(purpose.encode()) & 0xFFFFFF)
    _PURPOSES[tag] = purpose
    return tag


_PURPOSES: dict[float, str] = {}
"""Tags back to their names: ``HOST_GATHERS`` and any other purpose this process has used."""
for _purpose in HOST_GATHERS:
    _purpose_tag(_purpose)


def device_for(world: World, device_type: str) -> torch.device:
    """The rank's training device: ``cuda:LOCAL_RANK`` on CUDA (set as current), else the CPU."""
    if device_type != "cuda":
        return torch.device("cpu")
    if world.local_rank >= torch.cuda.device_count():
        raise ConfigError(
            f"LOCAL_RANK={world.local_rank} but this process sees {torch.cuda.device_count()} CUDA "
            "device(s); set CUDA_VISIBLE_DEVICES to as many GPUs as --nproc_per_node"
        )
    torch.cuda.set_device(world.local_rank)
    return torch.device("cuda", world.local_rank)
