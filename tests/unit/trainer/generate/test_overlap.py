"""Decode steps launched one ahead (``trainer.generate.overlap``): the same completions as without.

On the CPU the engine runs the overlap through its eager path (``overlap=True`` without CUDA
graphs): the schedule, the device-fed ids, the dropped rows of sequences that stopped and the
flush at the block's end are all exercised; on CUDA the same path replays graphs
(tests/gpu/test_sampler_gpu.py). fp32 on the CPU: the tokens and logprobs are compared exactly.
"""

from __future__ import annotations

import pytest
import torch

from trainer.generate.engine import Engine
from trainer.generate.overlap import Ahead, follow, may_defer
from trainer.generate.params import FINISH_LENGTH, FINISH_STOP, Request, SamplingParams
from trainer.generate.scheduler import Scheduler
from trainer.generate.serve import FINISH_CANCELLED
from trainer.generate.stopping import Stopper
from trainer.model.tiny import build_tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny():
    model, tokenizer = build_tiny_model("llama", seed=0)
    return model.eval(), tokenizer


def _prompts(tokenizer) -> list[tuple[int, ...]]:
    texts = ["The cat", "Once upon a time, there lived", "A", "What is the capital of France?", "In the end"]
    return [tuple(tokenizer(t)["input_ids"]) for t in texts]


def _run(model, tokenizer, requests: list[Request], overlap: bool, slots: int = 3) -> tuple[list, Engine]:
    engine = Engine(model, tokenizer, slots=slots, max_len=48, max_batch_tokens=64, overlap=overlap)
    results = engine.generate(requests)
    return [[(c.token_ids, c.finish_reason, c.logprobs) for c in r.completions] for r in results], engine


def test_greedy_and_seeded_completions_equal_the_engine_without_overlap(tiny) -> None:
    """More requests than slots (admissions between overlapped runs), lengths that end at
    different steps, seeded sampling with top-k/top-p, n > 1: the same tokens either way."""
    model, tokenizer = tiny
    prompts = _prompts(tokenizer)
    requests = [
        Request(prompts[0], SamplingParams(max_tokens=9, temperature=0.0)),
        Request(prompts[1], SamplingParams(max_tokens=4, temperature=0.8, top_k=20, top_p=0.9, seed=3, n=2)),
        Request(prompts[2], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)),
        Request(prompts[3], SamplingParams(max_tokens=6, temperature=1.0, seed=11)),
        Request(prompts[4], SamplingParams(max_tokens=7, temperature=0.0)),
    ]
    plain, _ = _run(model, tokenizer, requests, overlap=False)
    overlapped, engine = _run(model, tokenizer, requests, overlap=True)
    assert overlapped == plain
    assert engine.stats.overlapped_steps > 0
    assert all(len(c[0]) == r.params.max_tokens or c[1] != FINISH_LENGTH
               for r, result in zip(requests, overlapped) for c in result)


def test_a_sequence_that_stops_on_a_token_mid_run_is_dropped_from_the_step_already_queued(tiny) -> None:
    """A stop id drawn while a step is ahead: that step's row for it is dropped (its token never
    appended), the others go on, and the forward count shows the one row run for nothing."""
    model, tokenizer = tiny
    prompts = _prompts(tokenizer)[:3]
    free = [Request(p, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)) for p in prompts]
    reference, _ = _run(model, tokenizer, free, overlap=False)
    first = reference[0][0][0]
    cut = next(i for i in range(2, len(first) - 1) if first[i] not in first[:i])  # a token not drawn before
    stop_id = first[cut]
    stopping = [Request(prompts[0], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True,
                                                   stop_token_ids=((stop_id,),))), *free[1:]]
    plain, plain_engine = _run(model, tokenizer, stopping, overlap=False)
    overlapped, engine = _run(model, tokenizer, stopping, overlap=True)
    assert overlapped == plain
    assert plain[0][0][0] == first[:cut] and plain[0][0][1] == FINISH_STOP  # the stop id is dropped
    assert engine.stats.overlapped_steps > 0
    # the overlapped run fed the stopped sequence once more (its row in the step queued ahead)
    assert engine.stats.forward_tokens == plain_engine.stats.forward_tokens + 1


def test_steps_that_return_logprobs_are_not_run_ahead(tiny) -> None:
    model, tokenizer = tiny
    requests = [Request(p, SamplingParams(max_tokens=5, temperature=0.0, logprobs=True, top_logprobs=2))
                for p in _prompts(tokenizer)[:2]]
    plain, _ = _run(model, tokenizer, requests, overlap=False)
    overlapped, engine = _run(model, tokenizer, requests, overlap=True)
    assert overlapped == plain and engine.stats.overlapped_steps == 0


def test_a_cancel_while_a_step_is_ahead_keeps_the_tokens_applied_before_it(tiny) -> None:
    """The serving loop's order: a step, then a cancel between steps, then more steps. The
    cancelled request keeps what it had when cancelled; the pending token is not appended."""
    model, tokenizer = tiny
    prompts = _prompts(tokenizer)[:2]
    engine = Engine(model, tokenizer, slots=2, max_len=48, overlap=True)
    scheduler = engine.scheduler([Request(p, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
                                  for p in prompts])
    with engine.running() as step:
        for _ in range(4):  # the prefill, then decode steps: the last leaves one ahead
            step(scheduler)
        assert engine._ahead is not None
        kept = list(scheduler.running[0].tokens)
        scheduler.cancel(0, FINISH_CANCELLED)
        while scheduler.busy:
            step(scheduler)
    first, second = scheduler.results()
    assert first.completions[0].token_ids == kept and first.completions[0].finish_reason == FINISH_CANCELLED
    assert len(second.completions[0].token_ids) == 12 and engine._ahead is None


def test_a_prompt_submitted_while_a_step_is_ahead_is_admitted_by_the_step_after_it(tiny) -> None:
    model, tokenizer = tiny
    prompts = _prompts(tokenizer)[:2]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    engine = Engine(model, tokenizer, slots=2, max_len=48, overlap=True)
    scheduler = engine.scheduler([Request(prompts[0], params)])
    with engine.running() as step:
        step(scheduler)
        step(scheduler)  # a decode step left ahead
        assert engine._ahead is not None
        scheduler.add(Request(prompts[1], params))
        step(scheduler)  # applies the pending tokens; queues nothing ahead while a prompt waits
        assert engine._ahead is None and scheduler.queue
        while scheduler.busy:
            step(scheduler)
    alone, _ = _run(model, tokenizer, [Request(prompts[1], params)], overlap=False)
    first, second = scheduler.results()
    assert len(first.completions[0].token_ids) == 6
    assert second.completions[0].token_ids == alone[0][0][0]


def test_follow_leaves_out_finished_sequences_and_those_ending_with_the_pending_token() -> None:
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    scheduler = Scheduler([Request((1, 2), params)] * 3, 3, 16, 64, lambda p, n: Stopper(p, frozenset(), None, 16 - n),
                          lambda seed: None, lambda: 0)
    scheduler.advance(scheduler.plan(), [5, 6, 7], [None] * 3)
    plan = scheduler.plan()  # every sequence decodes its first token at position 2
    assert may_defer(plan, scheduler)
    scheduler.running[0].tokens.append(8)  # sequence 0 now ends with the pending token (3 of 3)
    scheduler.cancel(1, FINISH_CANCELLED)  # sequence 1 is finished
    ahead = Ahead.of(plan, torch.tensor([40, 41, 42]))
    followed = follow(ahead, torch.device("cpu"))
    assert followed is not None
    nxt, ids = followed
    assert nxt.segments == [(2, 3, 1)] and ids.tolist() == [42] and nxt.sampled == [scheduler.running[2]]
    scheduler.cancel(2, FINISH_CANCELLED)
    assert follow(ahead, torch.device("cpu")) is None


def test_may_defer_refuses_a_step_after_which_a_prompt_could_be_admitted_or_logprobs_are_read() -> None:
    def make(params: SamplingParams, slots: int) -> Scheduler:
        return Scheduler([Request((1, 2), params)] * 2, slots, 16, 64, lambda p, k: Stopper(p, frozenset(), None, 16 - k),
                         lambda seed: None, lambda: 0)

    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    full = make(greedy, 1)  # the second request waits for the only slot: nothing can be admitted
    full.advance(full.plan(), [5], [None])
    assert full.queue and not full.free and may_defer(full.plan(), full)
    roomy = make(greedy, 3)  # both running, a slot free: a prompt queued now would be admitted
    roomy.advance(roomy.plan(), [5, 6], [None, None])
    plan = roomy.plan()
    assert may_defer(plan, roomy)
    roomy.add(Request((3, 4), greedy))
    assert not may_defer(plan, roomy)
    logprobs = make(SamplingParams(max_tokens=4, temperature=0.0, logprobs=True), 2)
    logprobs.advance(logprobs.plan(), [5, 6], [None, None])
    assert not may_defer(logprobs.plan(), logprobs)
