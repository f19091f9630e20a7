"""Decode steps launched one ahead: the next forward is queued before this step's tokens reach the host.

Why: a decode step's host work (reading the tokens back, the stop rules, the next plan and its
inputs) ran while the GPU waited. On one H200, Llama-3.1-8B shape, batch 256, that was 1.0-1.8 ms
of a 14 ms step, batch 64 0.6 ms of 8.6 (``python -m bench.sampler_profile --cuda-graphs
--graph-profile``: a step's wall time less its graph's replay alone).

How (``Engine``'s ``overlap``): a decode-only step whose tokens nobody needs on the host before the
next forward (no prompt the next step could admit: none queued or no slot free; no fork, no
logprobs asked, no cross-rank agreement)
leaves its tokens on the device and starts copying them to pinned host memory (``Ahead``). The
engine's next step feeds them to the next forward on the device (``follow``) and queues it before
the host reads them; the host then applies them (stop rules, finishes) while the GPU runs that
forward. So the host's work hides behind the GPU's, and each token reaches the host one step later.

What stays the same: every sequence gets the tokens it gets without overlap (its logits, its own
generator's draws, one per step); a finish is decided on the same token. What differs: a sequence
that stops on a token (end of sequence, a stop id or string, a cancel) has already been fed to the
next forward, whose row for it is dropped (its slot's position past its end is written and never
read: a slot is filled from position 0 by its next sequence). A sequence that certainly ends with
the pending token (its length limit) is left out of the next forward. A prompt that arrives while
a step is ahead and finds a free slot waits for that step (at most one) and is admitted by the
step after; a slot freed by the pending tokens while prompts are queued is refilled one step later
than without overlap (a long generation job keeps its slots busy, so it keeps the overlap).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from trainer.generate.scheduler import Scheduler, StepPlan
from trainer.generate.transfer import to_device


@dataclass
class Ahead:
    """A step whose forward and draws are queued and whose tokens are not yet applied."""

    plan: StepPlan
    tokens_R: torch.Tensor
    """The drawn tokens on the device (the next forward's input ids)."""
    host_R: torch.Tensor
    """Their copy in pinned host memory (the tensor itself on the CPU)."""
    ready: Any = None
    """A CUDA event recorded after the copy (None on the CPU)."""

    @classmethod
    def of(cls, plan: StepPlan, tokens_R: torch.Tensor) -> Ahead:
        """Start copying ``tokens_R`` to the host without waiting for it."""
        if tokens_R.device.type != "cuda":
            return cls(plan, tokens_R, tokens_R)
        host_R = torch.empty(tokens_R.shape, dtype=tokens_R.dtype, pin_memory=True)
        host_R.copy_(tokens_R, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(tokens_R.device))
        return cls(plan, tokens_R, host_R, ready)

    def tokens(self) -> list[int]:
        """The tokens on the host (waits for this step's copy only, not for a forward queued after)."""
        if self.ready is not None:
            self.ready.synchronize()
        return self.host_R.tolist()

    def apply(self, scheduler: Scheduler) -> None:
        """Give the step's sequences their tokens (``Scheduler.advance``; no logprobs were asked)."""
        scheduler.advance(self.plan, self.tokens(), [None] * len(self.plan.sampled))


def admits_nothing(scheduler: Scheduler) -> bool:
    """Whether the next step could admit no prompt: none is queued, or no slot is free (a slot that
    frees with the pending tokens is refilled one step later than without overlap)."""
    return not scheduler.queue or not scheduler.free


def may_defer(plan: StepPlan, scheduler: Scheduler) -> bool:
    """Whether ``plan``'s tokens may stay on the device until the next step is queued: a
    decode-only step (one token per sequence, every sequence sampled from its own row), no prompt
    the next step could admit (``admits_nothing``), no logprobs to read."""
    return (admits_nothing(scheduler) and not plan.forks and len(plan.segments) == len(plan.sampled)
            and all(count == 1 for _, _, count in plan.segments) and plan.pick == list(range(len(plan.sampled)))
            and not any(seq.params.logprobs for seq in plan.sampled))


def follow(ahead: Ahead, device: torch.device) -> tuple[StepPlan, torch.Tensor] | None:
    """The step after ``ahead`` (not yet applied): each of its sequences still running that may
    continue after the pending token, one position on, fed that token on the device; None when
    none may. Ids in the plan are placeholders (the device tensor carries them)."""
    plan, rows = StepPlan(), []
    for row, (seq, (slot, position, _)) in enumerate(zip(ahead.plan.sampled, ahead.plan.segments)):
        if seq.finish_reason is not None or len(seq.tokens) + 1 >= seq.stopper.limit:
            continue  # finished in an applied step (or cancelled), or ends with the pending token
        rows.append(row)
        plan.segments.append((slot, position + 1, 1))
        plan.adapters.append(ahead.plan.adapters[row])
        if ahead.plan.prompts:
            plan.prompts.append(ahead.plan.prompts[row])
        plan.sampled.append(seq)
    if not rows:
        return None
    plan.keep = plan.pick = list(range(len(rows)))
    plan.input_ids = [0] * len(rows)
    if len(rows) == len(ahead.plan.sampled):
        return plan, ahead.tokens_R
    return plan, ahead.tokens_R.index_select(0, to_device(rows, torch.long, device))
