"""The OOM ladder: an out-of-memory error in a run's first steps steps the activation policy down.

The plan's memory estimate (``trainer.plan.memory``) can be wrong (another process took memory after
the plan, an allocator fragmenting worse than the margin). Then, instead of failing the job, a
``torch.OutOfMemoryError`` raised by one of the first ``WINDOW`` steps (and before the run's
first checkpoint) is caught, and:

1. everything the failed step held is freed (its gradients set to None, Python's garbage
   collected, the CUDA cache emptied);
2. the activation policy moves one rung down, ``none -> selective -> full -> full+offload``
   (selective from ``none`` checkpoints half the layers, each further selective rung half of
   the layers still kept, so a wrong estimate on a large card costs some speed, not all of it;
   ``full+offload`` only where offloading can run: a CUDA GPU with room in pinned host memory,
   one rank): ``Installation.replace_activations`` removes the installed policy and offload
   and installs the new ones;
3. a ``log`` event at level ``warning`` says what ran out, the new policy and that the step is
   retried;
4. the same step runs again on the same micro-batches with the RNG state it started with, so no
   sample is skipped or seen twice and the run follows the curve it would have followed. The
   optimizer state is untouched: the step never reached ``optimizer.step`` (an OOM inside the
   optimizer's own step, which allocates its state on the first step, is not retried: whether
   some parameters were updated cannot be told, so the run fails as before).

On several ranks (DDP over LoRA adapters, ``Parallel.can_agree``), the window's steps run every
backward without the gradient exchange and meet at the step's end (``Parallel.agree``, on the
host group): when any rank ran out, every rank frees, steps down to the same rung and retries
the step; else the gradients are exchanged once, averaged as DDP does. A one-rank retry alone
would desynchronise the ranks' collectives. The bottom rung there is ``full`` (offload needs
DDP's static graph, fixed when DDP wraps the model). Under FSDP2 (gathers inside forward and
backward) and DDP with a static graph, an OOM ends the run.

At the bottom of the ladder (or past the window, or where the ranks cannot agree) the error ends
the run with code ``out_of_memory`` and advice. Standard library and torch only; ``trainer.training.train`` calls ``Ladder.run`` for each step.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from trainer.plan import planner as planning
from trainer.features.checkpointing import policy as checkpointing
from trainer.training.install import Installation
from trainer.parallel.strategy import Parallel

T = TypeVar("T")
WINDOW = 10
"""Steps of a run (after its start or resume) whose OOM steps the policy down."""
ADVICE = (
    "lower data.batch_tokens (and max_seq_len), set max_gpu_memory_gb to what this GPU really has "
    "free, use method qlora, or run on more GPUs"
)


class Ladder:
    """Retries a step that ran out of memory under the next activation policy down."""

    def __init__(self, installed: Installation, optimizer: torch.optim.Optimizer, device: torch.device,
                 hw: Any, log: Callable[[str, str], None], enabled: bool = True,
                 parallel: Parallel | None = None) -> None:
        self.installed, self.optimizer, self.device = installed, optimizer, device
        self.hw, self.log, self.enabled = hw, log, enabled
        self.parallel = parallel
        """The run's ranks (several): its window's steps agree on an OOM (``Parallel.agree``)."""
        self.steps_run = 0
        self.open = True
        """False once the run has written a checkpoint (``close``) or left the window."""

    def close(self) -> None:
        self.open = False
        self._agree(False)

    def _agree(self, on: bool) -> None:
        if self.parallel is not None:
            self.parallel.agreeing = on

    def run(self, step: int, fn: Callable[[], T]) -> T:
        """``fn()`` (one training step), retried down the ladder on an OOM inside the window."""
        self.steps_run += 1
        if not (self.enabled and self.open and self.steps_run <= WINDOW):
            self._agree(False)
            return fn()
        self._agree(True)
        rng = _rng_state(self.device)
        state_before = len(self.optimizer.state)
        while True:
            try:
                return fn()
            except torch.OutOfMemoryError as exc:
                message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            if len(self.optimizer.state) != state_before:
                raise torch.OutOfMemoryError(
                    f"out of memory in the optimizer step of step {step} ({message}); {ADVICE}"
                )
            self._free()
            current = self.installed.plan.decision(checkpointing.NAME)
            lower = self.next_plan(self.installed.plan)
            if lower is None:
                raise torch.OutOfMemoryError(
                    f"out of memory at step {step} with the lowest activation policy here "
                    f"({current.backend}): {message}. To fit: {ADVICE}"
                )
            self.installed.replace_activations(lower)
            new = lower.decision(checkpointing.NAME)
            self.log(
                f"out of memory at step {step} with activation policy {current.backend} ({message}); "
                f"stepped down to {new.backend}: {new.reason}; retrying step {step} on the same data",
                "warning",
            )
            _set_rng_state(self.device, rng)

    def next_plan(self, plan: planning.Plan) -> planning.Plan | None:
        """``plan`` with the activation policy (and offload) one rung down; None at the bottom."""
        current = plan.decision(checkpointing.NAME)
        layers = len(self.installed.checkpointing.layers)
        why = "the OOM ladder"
        done = checkpointing.checkpointed_count(current.backend, layers)
        n = layers // 2 if current.backend == "none" else done + (layers - done) // 2
        if current.backend not in ("full", "full+offload") and done < n < layers:
            return checkpointing.with_policy(
                plan, checkpointing.selective_backend(n, layers),
                f"{why}: checkpoint {n} of {layers} layers after running out of memory",
            )
        if current.backend not in ("full", "full+offload"):
            return checkpointing.with_policy(plan, "full", f"{why}: every layer checkpointed after running out of memory")
        if (current.backend == "full+offload" or self.hw.device != "cuda" or not self.hw.pinned_memory
                or self.parallel is not None):  # offload under DDP needs its static graph, set at the start
            return None
        return checkpointing.with_policy(
            plan, "full+offload", f"{why}: every layer checkpointed and its input offloaded (synchronous "
            "reload: no room assumed for a second buffer)", reload="sync",
        )

    def _free(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def _rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def _set_rng_state(device: torch.device, state: tuple[torch.Tensor, torch.Tensor | None]) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)
