"""Continuous batching: which sequences run in each forward, and what their tokens do to them.

Every request becomes ``n`` sequences, queued in request order. Each step builds one packed row:

1. decode: every running sequence (one per busy slot) feeds its last token at its length;
2. admit: while a slot is free, the next queued sequence takes the lowest free slot. Its prompt
   is appended to the row (positions from 0) if it fits ``max_batch_tokens`` with what is already
   there, or if it is the step's first prompt (a budget is soft for one prompt, so a long prompt
   never starves); otherwise admission waits for the next step. A later choice of a request
   whose prompt is in this row is a fork: no tokens of its own, its first token drawn from the
   same logits, and the prompt's keys copied into its slot after the forward (unshared layout)
   or referenced where they are (shared prompts, below).

Shared prompts (``prompt_slots``, ``trainer.generate.cache``'s shared-prompt layout): a prefill
also takes a prompt slot (the lowest free; admission waits while none is free, which only happens
when there are fewer prompt slots than slots), its tokens' keys go there, and every choice admitted
with it references that slot: a segment carries ``(prompt slot, prompt length)``
(``StepPlan.prompts``). A prompt slot frees when the last sequence referencing it finishes. Choices
of one request admitted in different steps (a slot freed for some of them later) each prefill the
prompt again, as in the unshared layout, so both layouts run the same forwards.

The forward then gives one logits row per sequence that ends a segment (each decode token, each
prompt's last token); each sampled sequence gets its token, and one that finishes frees its slot
at once, so the next step refills it from the queue. The scheduler is host-only (ints and lists);
``trainer.generate.engine`` runs the forward and the draws.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

from trainer.generate.params import Completion, Request, Result, SamplingParams, TokenLogprob, choice_seed
from trainer.generate.stopping import Stopper


@dataclass
class Sequence:
    """One choice of one request, from the queue to its finish."""

    request: int
    choice: int
    prompt: tuple[int, ...]
    params: SamplingParams
    stopper: Stopper
    generator: Any = None
    """Its ``torch.Generator`` (None when greedy)."""
    adapter: str | None = None
    slot: int = -1
    prompt_slot: int = -1
    """Its prompt's slot in the prompt store (shared prompts), or -1."""
    tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None

    @property
    def length(self) -> int:
        """Tokens of the sequence so far (prompt and generated)."""
        return len(self.prompt) + len(self.tokens)


@dataclass
class StepPlan:
    """One forward: the packed row, the logits it keeps, and who samples from which."""

    segments: list[tuple[int, int, int]] = field(default_factory=list)
    """``(slot, first_position, tokens)`` in row order (``trainer.generate.attention.StepState``)."""
    input_ids: list[int] = field(default_factory=list)
    keep: list[int] = field(default_factory=list)
    """Row indices whose logits are computed (the last token of each segment)."""
    sampled: list[Sequence] = field(default_factory=list)
    pick: list[int] = field(default_factory=list)
    """For each sampled sequence, its row of the kept logits."""
    forks: list[tuple[int, list[int], int]] = field(default_factory=list)
    """``(source slot, target slots, prompt length)``: prompts to copy after the forward."""
    adapters: list[str | None] = field(default_factory=list)
    """Each segment's ``Request.adapter``."""
    prompts: list[tuple[int, int]] = field(default_factory=list)
    """Shared prompts: each segment's ``(prompt slot, prompt length)``; empty in the unshared layout."""


class Scheduler:
    """The queue, the slots and the finished sequences of one ``generate`` call.

    Args:
        requests: in order; their results come back in the same order.
        slots, max_len, max_batch_tokens: the engine's shape (see ``Engine``).
        prompt_slots, prompt_len: the prompt store's slots and positions (shared prompts; 0: unshared).
        new_stopper: ``(params, prompt_length) -> Stopper`` for each sequence.
        new_generator: ``seed -> torch.Generator`` for each sampled sequence.
        draw_seed: a seed for a request that names none.
    """

    def __init__(self, requests: Seq[Request], slots: int, max_len: int, max_batch_tokens: int,
                 new_stopper: Callable[[SamplingParams, int], Stopper], new_generator: Callable[[int], Any],
                 draw_seed: Callable[[], int], prompt_slots: int = 0, prompt_len: int = 0) -> None:
        self.max_batch_tokens, self.max_len, self.prompt_len = max_batch_tokens, max_len, prompt_len
        self._new_stopper, self._new_generator, self._draw_seed = new_stopper, new_generator, draw_seed
        self.queue: deque[Sequence] = deque()
        self.running: dict[int, Sequence] = {}
        self.free = list(range(slots))
        self.shared = prompt_slots > 0
        self.free_prompts = list(range(prompt_slots))
        self.prompt_users: dict[int, int] = {}
        """Running sequences referencing each prompt slot in use."""
        self.done: list[Sequence] = []
        self.requests: list[Request] = []
        for request in requests:
            self.add(request)

    def add(self, request: Request) -> int:
        """Queue ``request``'s ``n`` sequences behind the others; returns its index.

        Raises:
            ValueError: its prompt leaves no room in ``max_len``.
        """
        index = len(self.requests)
        if len(request.prompt_ids) >= self.max_len:
            raise ValueError(
                f"request {index}: a prompt of {len(request.prompt_ids)} tokens leaves no room in "
                f"max_len={self.max_len}; raise max_len or shorten the prompt"
            )
        if self.shared and len(request.prompt_ids) > self.prompt_len:
            raise ValueError(f"request {index}: a prompt of {len(request.prompt_ids)} tokens is longer than the "
                             f"prompt store's {self.prompt_len} positions; raise SharedPrompts.prompt_len")
        self.requests.append(request)
        params = request.params
        seed = None if params.greedy else (params.seed if params.seed is not None else self._draw_seed())
        for choice in range(params.n):
            generator = None if seed is None else self._new_generator(choice_seed(seed, choice))
            stopper = self._new_stopper(params, len(request.prompt_ids))
            self.queue.append(Sequence(index, choice, request.prompt_ids, params, stopper, generator,
                                       adapter=request.adapter))
        return index

    def cancel(self, index: int, reason: str) -> None:
        """End request ``index`` now: its queued sequences leave the queue, its running ones finish
        with ``reason`` (their slots free for the next step)."""
        for seq in [s for s in self.queue if s.request == index]:
            self.queue.remove(seq)
            seq.finish_reason = reason
            self.done.append(seq)
        for seq in [s for s in self.running.values() if s.request == index]:
            self._finish(seq, reason, 0)

    @property
    def busy(self) -> bool:
        return bool(self.queue or self.running)

    def plan(self) -> StepPlan:
        """The next forward: every running sequence's token, then as many new prompts as fit."""
        plan = StepPlan()
        for slot in sorted(self.running):
            seq = self.running[slot]
            plan.segments.append((slot, seq.length - 1, 1))
            plan.adapters.append(seq.adapter)
            if self.shared:
                plan.prompts.append((seq.prompt_slot, len(seq.prompt)))
            plan.keep.append(len(plan.input_ids))
            plan.input_ids.append(seq.tokens[-1])
            plan.pick.append(len(plan.keep) - 1)
            plan.sampled.append(seq)
        self._admit(plan)
        return plan

    def _admit(self, plan: StepPlan) -> None:
        sources: dict[int, tuple[int, int]] = {}  # request -> (its prompt's slot, its kept row)
        prompts = 0
        while self.queue and self.free:
            seq = self.queue[0]
            source = sources.get(seq.request)
            fits = len(plan.input_ids) + len(seq.prompt) <= self.max_batch_tokens
            if source is None and ((prompts and not fits) or (self.shared and not self.free_prompts)):
                break
            self.queue.popleft()
            seq.slot = self.free.pop(0)
            self.running[seq.slot] = seq
            plan.sampled.append(seq)
            if source is not None:
                plan.pick.append(source[1])
                if self.shared:
                    self._refer(seq, source[0])
                else:
                    _add_fork(plan, source[0], seq.slot, len(seq.prompt))
                continue
            prompts += 1
            plan.segments.append((seq.slot, 0, len(seq.prompt)))
            plan.adapters.append(seq.adapter)
            plan.input_ids += seq.prompt
            plan.keep.append(len(plan.input_ids) - 1)
            plan.pick.append(len(plan.keep) - 1)
            if self.shared:
                self._refer(seq, self.free_prompts.pop(0))
                plan.prompts.append((seq.prompt_slot, len(seq.prompt)))
            sources[seq.request] = (seq.prompt_slot if self.shared else seq.slot, len(plan.keep) - 1)

    def _refer(self, seq: Sequence, prompt_slot: int) -> None:
        seq.prompt_slot = prompt_slot
        self.prompt_users[prompt_slot] = self.prompt_users.get(prompt_slot, 0) + 1

    def advance(self, plan: StepPlan, tokens: list[int], logprobs: list[TokenLogprob | None]) -> None:
        """Give each sampled sequence its token; finish (and free the slot of) those that end. A
        sequence that finished after ``plan`` was made (cancelled, or stopped in the step before
        when the engine runs a step ahead: ``trainer.generate.overlap``) takes nothing."""
        for seq, token, logprob in zip(plan.sampled, tokens, logprobs):
            if seq.finish_reason is not None:
                continue
            seq.tokens.append(token)
            if logprob is not None:
                seq.logprobs.append(logprob)
            reason, drop = seq.stopper.check(seq.tokens)
            if reason is not None:
                self._finish(seq, reason, drop)

    def _finish(self, seq: Sequence, reason: str, drop: int) -> None:
        if drop:
            del seq.tokens[-drop:]
            del seq.logprobs[len(seq.tokens):]
        seq.finish_reason = reason
        del self.running[seq.slot]
        self.free.append(seq.slot)
        self.free.sort()
        if seq.prompt_slot >= 0:
            self.prompt_users[seq.prompt_slot] -= 1
            if not self.prompt_users[seq.prompt_slot]:
                del self.prompt_users[seq.prompt_slot]
                self.free_prompts.append(seq.prompt_slot)
                self.free_prompts.sort()
        self.done.append(seq)

    def results(self) -> list[Result]:
        """One ``Result`` per request, in request order, its completions in choice order."""
        completions: list[list[Completion]] = [[] for _ in self.requests]
        for seq in sorted(self.done, key=lambda s: (s.request, s.choice)):
            completions[seq.request].append(Completion(
                seq.choice, list(seq.tokens), seq.stopper.decode(seq.tokens), seq.finish_reason or "",
                list(seq.logprobs) if seq.params.logprobs else None,
            ))
        return [Result(len(r.prompt_ids), c) for r, c in zip(self.requests, completions)]


def _add_fork(plan: StepPlan, source: int, target: int, length: int) -> None:
    for i, (src, targets, _) in enumerate(plan.forks):
        if src == source:
            targets.append(target)
            return
    plan.forks.append((source, [target], length))
