"""Executors: what runs a claimed job's trainer (the protocol: worker/executors/base.py).

    local          the trainer itself, one process on the job's one GPU        local.py
    torchrun       one rank per reserved GPU of this host                      torchrun.py
    multi_machine  this machine's ranks of a job over several machines         multi_machine.py

``choose`` picks one from the claim's placement, unless the worker host names one for all its
jobs (``WorkerOptions.executor``); the runner builds it by name (``get``). A new executor (Slurm,
Kubernetes) is one module with a class implementing ``Executor`` and one ``register`` call, here
for those that ship with ftq, or in the code that starts the worker for one that does not.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from worker.executors.base import Executor, OnEvent, Signal
from worker.executors.local import LocalExecutor
from worker.executors.multi_machine import MultiMachineExecutor
from worker.executors.torchrun import TorchrunExecutor

if TYPE_CHECKING:
    from core.jobs.placement import Placement
    from worker.runtime import WorkerOptions

__all__ = ["Executor", "OnEvent", "Signal", "choose", "get", "register", "unregister"]

_REGISTRY: dict[str, type[Executor]] = {}


def register(name: str, executor: type[Executor]) -> None:
    """Make ``executor`` the one called ``name``.

    Raises:
        ValueError: another executor has that name already.
    """
    if _REGISTRY.get(name, executor) is not executor:
        raise ValueError(f"executor {name!r} is registered already ({_REGISTRY[name].__qualname__}); "
                         "give the new one another name")
    _REGISTRY[name] = executor


def unregister(name: str) -> None:
    """Forget the executor called ``name`` (none: nothing happens)."""
    _REGISTRY.pop(name, None)


def get(name: str) -> type[Executor]:
    """The executor called ``name``.

    Raises:
        ValueError: none is registered under that name.
    """
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"executor {name!r}: none is registered under that name (registered: "
                         f"{', '.join(sorted(_REGISTRY))}); register it (worker/executors/__init__.py) "
                         "or leave WorkerOptions.executor unset") from None


def choose(options: WorkerOptions, placement: Placement) -> str:
    """The name of the executor that runs ``placement`` on this host: the host's own
    (``options.executor``), else ``multi_machine`` for a job over several machines,
    ``torchrun`` for several GPUs of this one, ``local`` for one.

    Raises:
        ValueError: ``options.executor`` names no registered executor.
    """
    if options.executor is not None:
        get(options.executor)
        return options.executor
    if placement.followers:
        return "multi_machine"
    return "torchrun" if len(placement.slots) > 1 else "local"


register("local", LocalExecutor)
register("torchrun", TorchrunExecutor)
register("multi_machine", MultiMachineExecutor)
