"""Which waiting jobs start now, and on which host's GPUs: the queue policy, as a pure function.

``place`` walks the queued jobs in claim order (priority, then age) over the live hosts' free
GPUs and returns the jobs that can start now with the GPUs each gets. The claim, the start
estimates and the wake-up messages all call it, so they agree by construction.

    cap       a job starts only if its owner's running GPUs plus its own fit under the owner's
              cap (0 = none). A job held back by its owner's cap, and the head (below), hold
              back that owner's later jobs: they would take the cap it waits for, so a user's
              stream of 1-GPU jobs cannot starve the same user's 4-GPU job.
    quota     the same per project (``ProjectQuotas``): a job starts only if its project's
              running GPUs plus its own fit under the project's quota (``project.max_gpus``;
              none when unset, 0 stops the project), and one held back by it, or the head of
              a project with a quota, holds back that project's later jobs.
    fit       a job of N GPUs needs N free GPUs on ONE host. Of the hosts where it fits, it
              takes the one with the fewest free GPUs (best fit: the big holes stay for big
              jobs), and on it the lowest free slots.
    head      the first job (in claim order, within its cap) that fits no host now, but would
              fit an idle one, is the head. It holds the host, among those with at least N GPUs,
              that has the most free GPUs now (ties: the host's id): no later job may take a
              free GPU of that host. Jobs there only end, so its free GPUs only grow until the
              head starts; later jobs backfill onto the other hosts' free GPUs, which the head
              could not use anyway. The hold needs no row in the store: every claim computes it
              again from the queue. The next big job waits for the head to start, then holds.
    machines  a job of ``nodes: M`` (M > 1) needs gpus/M free GPUs on each of M distinct machines
              (distinct ``address``; a host without one takes no part), all or none. Of the
              machines where its share fits, it takes the M with the fewest free GPUs (best fit).
              Its part 0, the leader (the only host that claims it), is the machine whose address
              sorts first: torch's c10d rendezvous gives node ranks in sorted address order, so
              global rank 0 lands there. As the head it holds M machines, those with the most free
              GPUs, the same way.
    pools     a job naming a pool (``pool: slurm``) starts only on a host serving that pool (a
              Slurm bridge: one host whose slots are its partition's, docs/slurm.md), and a job
              naming none never there. The cluster's scheduler places its nodes, so a pooled job
              of ``nodes: M`` takes ``gpus`` slots of that one host, as a job of one machine does.
    shared    a job whose ranks shard the model over machines (``method: full``, M > 1) writes
              its checkpoints into a directory all its machines share, so its M machines must
              be of ONE shared storage (``Host.shared``: the same FTQ_SHARED_DIR path and marker
              id); it is placed, and holds, within the one storage where it fits best. Without
              any storage of M such machines it is too big (the API refuses it at submission).
    fewer     a retry of a multi-machine job (``Waiting.shrink``, set by ``allow_shrink``: queued
              again after an attempt, and the machines of that attempt that are not live now
              stopped being live at least ``shrink_after_s`` ago) may start on fewer machines
              than ``nodes`` when no set of ``nodes`` machines it could use is live: on the most
              machines (``nodes - 1`` down to 1) that are, ``gpus / nodes`` GPUs each (within its
              checkpoints' storage, below). The
              trainer keeps the job's ``gpus`` (its global batch): fewer ranks each take more of
              a step's micro-batches. Busy machines are no reason to shrink: the job waits (and
              holds) for them as any job. A running job never grows back.
    storage   a retry whose newest checkpoint is in a shared storage and was never uploaded
              (``Waiting.storage``, core/jobs/fewer_machines.py) starts, holds and shrinks only on
              machines of that storage (``Host.shared``), whatever its method: no other machine can
              read the checkpoint. With none of them live it holds nothing and waits (the reaper
              writes the job a ``log`` event saying so); its attempts are not spent meanwhile. A
              retry whose checkpoint is in the store (written to ``output_dir``, uploaded by a
              remote worker) may start on any machine.
    too big   a job with more GPUs than any live host has, or than its owner's cap allows at all,
              is passed over and holds nothing (the API refuses both at submission; this
              covers a host that left, or a cap lowered later).

Starvation: a job is never passed by a later job of the same or lower priority for longer
than the jobs running on its held host take to end. Higher priorities go first by design
(``priority: high`` is how a user asks to jump the queue).
"""

from __future__ import annotations

import datetime as dt
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from trainer.catalog import METHODS

Owner = str | None


@dataclass(frozen=True)
class Waiting:
    """A queued job as the scheduler sees it."""

    job_id: str
    owner_id: Owner
    priority: str
    gpus: int
    model: str
    total_steps: int | None
    created_at: dt.datetime
    name: str | None = None
    nodes: int = 1
    """Machines the job's GPUs are spread over (``gpus / nodes`` each)."""
    project_id: str | None = None
    pool: str | None = None
    """The named pool it runs on (None: ftq's own hosts)."""
    method: str = "lora"
    attempts: int = 0
    """Claims so far: more than 0 on a queued job is a retry (or a hand-back)."""
    lost_since: dt.datetime | None = None
    """A retry of a multi-machine job: when the last of its previous attempt's machines that
    are not live now stopped being live (None: every one of them is live, or none is known)."""
    storage: tuple[str, str] | None = None
    """``Host.shared`` of the storage that holds its newest recorded checkpoint, which was written
    there and never uploaded (a retry: core/jobs/fewer_machines.py); None: the checkpoint is in
    the store (or there is none), any machine can resume from it."""
    checkpoint_step: int | None = None
    """The step of that newest recorded checkpoint, with ``storage`` (what the queue tells)."""
    shrink: bool = False
    """It may start on fewer machines than ``nodes`` now (``allow_shrink``)."""

    @property
    def per_node(self) -> int:
        return self.gpus // self.nodes

    @property
    def machines(self) -> int:
        """ftq hosts it spans: ``nodes``, or 1 on a pool (whose scheduler spreads the nodes)."""
        return 1 if self.pool else self.nodes

    @property
    def per_host(self) -> int:
        """Slots it takes on each of its hosts."""
        return self.gpus // self.machines

    @property
    def needs_shared(self) -> bool:
        """Its machines must share a checkpoint directory: full fine-tuning shards the model."""
        return self.machines > 1 and self.method == "full"


RESUMABLE_ON_ANY_COUNT = frozenset(METHODS)
"""Methods whose checkpoints a run on any number of ranks resumes: every one of
``trainer.catalog.METHODS`` (trainer/training/checkpoint.py: adapters are written whole by rank 0,
every DDP rank holding the same; method ``full`` and FSDP2 through DCP, whose files name every
tensor's global shape)."""


def may_shrink(job: Waiting, now: dt.datetime, shrink_after_s: float) -> bool:
    """``job`` may start on fewer machines than ``nodes`` (the ``fewer`` rule): a queued retry of
    a job over several of ftq's machines, with checkpoints any machine count resumes, whose
    missing machines have not been live for ``shrink_after_s`` (0: at once)."""
    return (job.machines > 1 and job.attempts > 0 and job.method in RESUMABLE_ON_ANY_COUNT
            and job.lost_since is not None and (now - job.lost_since).total_seconds() >= shrink_after_s)


def allow_shrink(waiting: Sequence[Waiting], now: dt.datetime, shrink_after_s: float) -> list[Waiting]:
    """``waiting`` with ``shrink`` set on each job ``may_shrink`` now."""
    return [replace(job, shrink=True) if may_shrink(job, now, shrink_after_s) else job for job in waiting]


@dataclass(frozen=True)
class Host:
    """A live worker host: all its slots, and those no job holds now."""

    worker_id: str
    slots: tuple[int, ...]
    free: tuple[int, ...]
    address: str | None = None
    """The address other machines reach it at (None: it takes no part in multi-machine jobs)."""
    pool: str | None = None
    """The named pool it serves (None: an ordinary host)."""
    shared: tuple[str, str] | None = None
    """``(shared_dir, shared_id)`` of the checkpoint directory it mounts (None: none)."""

    @property
    def size(self) -> int:
        return len(self.slots)


@dataclass(frozen=True)
class Part:
    """One machine's share of a multi-machine job: ``slots`` of host ``worker_id``."""

    worker_id: str
    slots: tuple[int, ...]
    address: str | None = None


@dataclass(frozen=True)
class Placement:
    """Job ``job_id`` starts now on ``slots`` of host ``worker_id`` (a multi-machine job: its
    leader's part) and, across machines, on ``followers``' parts too."""

    job_id: str
    worker_id: str
    slots: tuple[int, ...]
    followers: tuple[Part, ...] = ()
    address: str | None = None
    """The leader's address (multi-machine jobs only: None for a job on one machine)."""

    @property
    def parts(self) -> tuple[Part, ...]:
        """Every machine's part, the leader's (node rank 0) first, then in address order."""
        return (Part(self.worker_id, self.slots, self.address), *self.followers)

    @property
    def gpus(self) -> int:
        return sum(len(part.slots) for part in self.parts)


@dataclass(frozen=True)
class Hold:
    """The head of the queue waits for ``needed`` GPUs of host ``worker_id`` (``free`` now); a
    multi-machine head also holds the hosts ``also`` (``needed`` GPUs on each)."""

    job_id: str
    worker_id: str
    needed: int
    free: int
    also: tuple[str, ...] = ()

    @property
    def hosts(self) -> frozenset[str]:
        return frozenset((self.worker_id, *self.also))


@dataclass(frozen=True)
class Schedule:
    placements: tuple[Placement, ...]
    """Jobs that can start now, in claim order."""
    hold: Hold | None
    """The head of the queue's hold, when it cannot start now."""

    def for_host(self, worker_id: str) -> Placement | None:
        """The first job this host should claim now, if any."""
        return next((p for p in self.placements if p.worker_id == worker_id), None)


@dataclass(frozen=True)
class ProjectQuotas:
    """Each project's quota on running GPUs (a project missing from ``caps`` has none) and the
    GPUs its running jobs hold."""

    caps: Mapping[str | None, int]
    running: Mapping[str | None, int]


def cap_allows(running: int, cap: int) -> bool:
    """``running`` GPUs (this job's included) are within ``cap`` (0 = no cap)."""
    return cap == 0 or running <= cap


def place(
    waiting: Sequence[Waiting],
    hosts: Sequence[Host],
    running: Mapping[Owner, int],
    caps: Mapping[Owner, int],
    quotas: ProjectQuotas | None = None,
) -> Schedule:
    """The jobs of ``waiting`` (claim order) that start now on ``hosts``, and the head's hold.

    Args:
        waiting: queued jobs in claim order.
        hosts: the live hosts and their free slots.
        running: GPUs each owner's running jobs hold.
        caps: each owner's cap on running GPUs (0 = none); a missing owner has none.
        quotas: each project's quota on running GPUs; None: no project has one.
    """
    quotas = quotas or ProjectQuotas({}, {})
    project_used: Counter[str | None] = Counter(quotas.running)
    blocked_projects: set[str | None] = set()
    free = {host.worker_id: list(host.free) for host in hosts}
    size = {host.worker_id: host.size for host in hosts}
    address = {host.worker_id: host.address for host in hosts}
    pool_of = {host.worker_id: host.pool for host in hosts}
    shared = {host.worker_id: host.shared for host in hosts}
    used: Counter[Owner] = Counter(running)
    blocked: set[Owner] = set()
    placements: list[Placement] = []
    hold: Hold | None = None
    for job in waiting:
        cap = caps.get(job.owner_id, 0)
        fit, big_enough = _could_take(job, {w: n for w, n in size.items() if pool_of[w] == job.pool
                                            and (job.storage is None or shared[w] == job.storage)}, address, shared)
        if not big_enough or (cap and job.gpus > cap):
            continue  # too big for any live host (or set of machines) or for its owner's cap: holds nothing
        if job.owner_id in blocked or job.project_id in blocked_projects:
            continue
        quota = quotas.caps.get(job.project_id)
        if quota is not None and job.gpus > quota:
            continue  # more than its project may ever hold at once: holds nothing
        if not cap_allows(used[job.owner_id] + job.gpus, cap):
            blocked.add(job.owner_id)
            continue
        if quota is not None and project_used[job.project_id] + job.gpus > quota:
            blocked_projects.add(job.project_id)
            continue
        held = hold.hosts if hold is not None else frozenset()
        fits = [w for w in big_enough if len(free[w]) >= fit.per_host and w not in held]
        chosen = _choose(fit, fits, free, address, shared)
        if chosen:
            placements.append(_take(fit, chosen, free, address))
            used[job.owner_id] += job.gpus
            project_used[job.project_id] += job.gpus
        elif hold is None:
            target, *also = _hold_targets(fit, big_enough, free, address, shared)
            hold = Hold(job.job_id, target, fit.per_host, len(free[target]), tuple(also))
            blocked.add(job.owner_id)  # its owner's later jobs must not take the cap it needs
            if quota is not None:  # nor its project's later jobs the quota (a project without one: backfill)
                blocked_projects.add(job.project_id)
    return Schedule(tuple(placements), hold)


def _take(job: Waiting, chosen: Sequence[str], free: dict[str, list[int]],
          address: Mapping[str, str | None]) -> Placement:
    """Place ``job`` on the ``chosen`` hosts (its leader first): their first free slots are its."""
    parts = []
    for host in chosen:
        slots, free[host] = free[host][: job.per_host], free[host][job.per_host :]
        parts.append(Part(host, tuple(slots), address[host] if job.machines > 1 else None))
    leader, *followers = parts
    return Placement(job.job_id, leader.worker_id, leader.slots, tuple(followers), leader.address)


Shared = Mapping[str, "tuple[str, str] | None"]


def _could_take(job: Waiting, size: Mapping[str, int], address: Mapping[str, str | None],
                shared: Shared) -> tuple[Waiting, list[str]]:
    """``job`` as it is placed (on fewer machines when ``shrink`` and no full set is live) and the
    hosts that could ever take a part of it (empty: too big)."""
    if (hosts := _big_enough(job, size, address, shared)) or not job.shrink:
        return job, hosts
    return _fewer(job, size, address, shared)


def _fewer(job: Waiting, size: Mapping[str, int], address: Mapping[str, str | None],
           shared: Shared) -> tuple[Waiting, list[str]]:
    """``job`` on the most machines below ``nodes`` (down to 1) that could take it, ``per_node``
    GPUs each (``size``: already only its checkpoints' storage), and those machines' hosts;
    ``job`` and none when not even one could."""
    for nodes in range(job.nodes - 1, 0, -1):
        fewer = replace(job, gpus=job.per_node * nodes, nodes=nodes)
        if hosts := _big_enough(fewer, size, address, shared):
            return fewer, hosts
    return job, []



def _groups(job: Waiting, hosts: Sequence[str], shared: Shared) -> list[list[str]]:
    """``hosts`` as the sets ``job``'s machines must all come from: one set, or for a job that
    needs shared storage one per storage (hosts without one left out), in storage order."""
    if not job.needs_shared:
        return [list(hosts)]
    by_storage: dict[tuple[str, str], list[str]] = {}
    for w in hosts:
        if (storage := shared[w]) is not None:
            by_storage.setdefault(storage, []).append(w)
    return [by_storage[key] for key in sorted(by_storage)]


def _big_enough(job: Waiting, size: Mapping[str, int], address: Mapping[str, str | None],
                shared: Shared) -> list[str]:
    """The hosts that could ever take a part of ``job`` (empty: fewer machines than it needs,
    or, needing shared storage, no storage with that many)."""
    if job.machines == 1:
        return sorted(w for w in size if size[w] >= job.gpus)
    hosts = sorted(w for w in size if size[w] >= job.per_node and address[w])
    return sorted(w for group in _groups(job, hosts, shared) if len({address[h] for h in group}) >= job.nodes
                  for w in group)


def _one_per_machine(hosts: Sequence[str], address: Mapping[str, str | None], key: Any) -> list[str]:
    """The best host (lowest ``key``) of each address, in ``key`` order."""
    best: dict[str | None, str] = {}
    for w in sorted(hosts, key=key):
        best.setdefault(address[w], w)
    return sorted(best.values(), key=key)


def _choose(job: Waiting, fits: Sequence[str], free: Mapping[str, list[int]],
            address: Mapping[str, str | None], shared: Shared) -> list[str] | None:
    """The hosts ``job`` starts on (best fit; needing shared storage, within the storage where
    the fit is best), the leader first; None: it does not fit now."""
    def fewest_free(w: str) -> tuple[int, str]:
        return (len(free[w]), w)

    if job.machines == 1:
        return [min(fits, key=fewest_free)] if fits else None
    options = [machines for group in _groups(job, fits, shared)
               if len(machines := _one_per_machine(group, address, fewest_free)[: job.nodes]) == job.nodes]
    if not options:
        return None
    best = min(options, key=lambda machines: sum(len(free[w]) for w in machines))
    return sorted(best, key=lambda w: (address[w] or "", w))


def _hold_targets(job: Waiting, big_enough: Sequence[str], free: Mapping[str, list[int]],
                  address: Mapping[str, str | None], shared: Shared) -> list[str]:
    """The hosts the head holds: the one (a multi-machine job: ``nodes`` machines, of one
    storage when it needs shared storage) with the most free GPUs."""
    def most_free(w: str) -> tuple[int, str]:
        return (-len(free[w]), w)

    if job.machines == 1:
        return [min(big_enough, key=most_free)]
    options = [machines for group in _groups(job, big_enough, shared)
               if len(machines := _one_per_machine(group, address, most_free)[: job.nodes]) == job.nodes]
    return max(options, key=lambda machines: sum(len(free[w]) for w in machines))
