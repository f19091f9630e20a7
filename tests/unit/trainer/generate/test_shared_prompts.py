"""The shared-prompt cache layout (``trainer.generate.cache.SharedPrompts``) against the unshared one.

The same requests go through two engines of one shape, one copying each prompt into every choice's
slot (``KVCache.copy_prefix``), one prefilling it once into a prompt slot that its choices read:
tiny random-weight Llama, Qwen3 and GPT-OSS (a sliding window of 8, shorter than most sequences
here, so windows start inside the prompt; sinks drawn non-zero), without and with a LoRA adapter,
the eight prompts of 1 to 30 tokens with ``n = 3`` through 5 slots (choices of one request admitted
in different steps, finished slots refilled, ``max_len`` cutting the long prompts). fp32 on CPU:
the torch backend gathers the two stores into the unshared layout's order before the same ops, so
tokens and logprobs are equal to the bit (``==``, no tolerance), greedy and sampled (seeded, so
each choice draws its own tokens after the shared prompt).

Also hand-checked: the scheduler's prompt slots (taken by a prefill, referenced by its choices,
freed by the last one, admission waiting while none is free) and which steps a CUDA graph takes.
"""

from __future__ import annotations

import pytest
import torch

from trainer.features.lora_kernel import fused as lora_fused
from trainer.generate.cache import KVCache, SharedPrompts
from trainer.generate.engine import Engine
from trainer.generate.graphs import DecodeGraphs
from trainer.generate.params import Request, SamplingParams
from trainer.generate.scheduler import Scheduler, StepPlan
from trainer.generate.stopping import Stopper

from tests.fixtures.sampler_models import TEXTS, sampler_model

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"),
]

SLOTS, MAX_LEN, MAX_TOKENS, CHOICES = 5, 36, 12, 3


def _generate(model, tokenizer, prompts, params, shared: SharedPrompts | None, lora: bool) -> tuple[list, int]:
    """Each request's completions as (tokens, logprobs) and how many prompt copies the cache made."""
    copies = []
    copy_prefix = KVCache.copy_prefix
    KVCache.copy_prefix = lambda self, *a: copies.append(len(a[1])) or copy_prefix(self, *a)
    installed = lora_fused.install(model) if lora else None
    try:
        engine = Engine(model, tokenizer, slots=SLOTS, max_len=MAX_LEN, shared_prompts=shared)
        results = engine.generate([Request(tuple(p), params) for p in prompts])
    finally:
        KVCache.copy_prefix = copy_prefix
        if installed is not None:
            installed.uninstall()
    assert (engine.cache.prompt_keys_PHLD != []) == (shared is not None)
    completions = [[(c.token_ids, [(t.logprob, t.top) for t in c.logprobs]) for c in r.completions] for r in results]
    return completions, sum(copies)


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
@pytest.mark.parametrize("lora", [False, True], ids=["base", "lora"])
@pytest.mark.parametrize("arch", ["llama", "qwen3", "gpt_oss"])
def test_shared_prompts_give_the_unshared_tokens_and_logprobs_exactly(arch: str, lora: bool,
                                                                      temperature: float) -> None:
    model, tokenizer = sampler_model(arch, lora)
    prompts = [tokenizer(text)["input_ids"] for text in TEXTS]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=temperature, seed=7, n=CHOICES, logprobs=True,
                            top_logprobs=2)
    unshared, copied = _generate(model, tokenizer, prompts, params, None, lora)
    shared_prompts = SharedPrompts(slots=SLOTS, prompt_len=max(map(len, prompts)), new_len=MAX_LEN)
    shared, copied_shared = _generate(model, tokenizer, prompts, params, shared_prompts, lora)
    assert copied > 0 and copied_shared == 0  # the unshared run copied prompts; the shared one read them
    assert shared == unshared
    if temperature:
        assert any(len({tuple(c[0]) for c in request}) > 1 for request in shared)  # choices drew apart


def test_fewer_prompt_slots_than_slots_wait_and_give_the_same_greedy_tokens() -> None:
    """Two prompt slots for five slots: admission waits for a prompt slot (another schedule, so the
    logprobs may differ in the last bits of another batch's matmuls; the tokens may not)."""
    model, tokenizer = sampler_model("llama", False)
    prompts = [tokenizer(text)["input_ids"] for text in TEXTS]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, n=2, logprobs=True)
    unshared, _ = _generate(model, tokenizer, prompts, params, None, False)
    shared, _ = _generate(model, tokenizer, prompts, params, SharedPrompts(2, 30, MAX_LEN), False)
    assert [[c[0] for c in r] for r in shared] == [[c[0] for c in r] for r in unshared]
    for want, got in zip(unshared, shared):
        for (_, want_logprobs), (_, got_logprobs) in zip(want, got):
            assert [g for g, _ in got_logprobs] == pytest.approx([w for w, _ in want_logprobs], abs=1e-5)


def _scheduler(requests: list[Request], slots: int, prompt_slots: int) -> Scheduler:
    return Scheduler(requests, slots, 32, 100, lambda p, n: Stopper(p, frozenset(), None, 32 - n),
                     lambda seed: None, lambda: 0, prompt_slots=prompt_slots, prompt_len=8)


def _greedy(prompt: tuple[int, ...], max_tokens: int, n: int = 1) -> Request:
    return Request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, n=n))


class TestPromptSlots:
    def test_choices_reference_their_prefills_prompt_slot_until_the_last_finishes(self) -> None:
        # A (3 tokens, 2 choices of 1 and 2 new tokens... greedy: both 2), B (1 token, 1 new), C waits
        scheduler = _scheduler([_greedy((1, 2, 3), 2, n=2), _greedy((4,), 1), _greedy((5, 6), 1)], 4, 2)
        plan = scheduler.plan()
        assert plan.segments == [(0, 0, 3), (2, 0, 1)] and plan.pick == [0, 0, 1] and plan.forks == []
        assert plan.prompts == [(0, 3), (1, 1)]  # A's choices 0 and 1 read prompt slot 0; B slot 1
        assert scheduler.free_prompts == [] and scheduler.prompt_users == {0: 2, 1: 1}
        scheduler.advance(plan, [9, 9, 9], [None] * 3)  # B is done: prompt slot 1 frees
        plan = scheduler.plan()
        assert plan.segments == [(0, 3, 1), (1, 3, 1), (2, 0, 2)]  # C takes slot 2 and prompt slot 1
        assert plan.prompts == [(0, 3), (0, 3), (1, 2)]
        scheduler.advance(plan, [8, 8, 8], [None] * 3)  # A's choices and C are done
        assert scheduler.free_prompts == [0, 1] and scheduler.prompt_users == {} and not scheduler.busy

    def test_a_prefill_waits_for_a_prompt_slot_and_choices_of_the_same_prefill_do_not(self) -> None:
        scheduler = _scheduler([_greedy((1, 2), 3, n=3), _greedy((3,), 1)], 4, 1)
        plan = scheduler.plan()
        assert plan.segments == [(0, 0, 2)] and len(plan.sampled) == 3  # the second request waits
        assert scheduler.free == [3] and [s.request for s in scheduler.queue] == [1]

    def test_a_prompt_longer_than_the_prompt_store_is_refused(self) -> None:
        with pytest.raises(ValueError, match="prompt store's 8 positions; raise SharedPrompts.prompt_len"):
            _scheduler([_greedy(tuple(range(9)), 1)], 2, 1)

    def test_a_completion_ends_at_the_own_slots_length(self) -> None:
        model, tokenizer = sampler_model("llama", False)
        engine = Engine(model, tokenizer, slots=2, max_len=40, shared_prompts=SharedPrompts(2, 8, 5))
        [result] = engine.generate([Request((1, 2, 3), SamplingParams(max_tokens=20, ignore_eos=True))])
        assert [len(c.token_ids) for c in result.completions] == [5]


def test_a_graph_takes_decodes_but_not_a_one_token_prompts_prefill() -> None:
    graphs = DecodeGraphs(4, shared=True)
    decode = StepPlan(segments=[(0, 3, 1), (1, 5, 1)], input_ids=[1, 2], keep=[0, 1], prompts=[(0, 3), (1, 2)])
    prefill = StepPlan(segments=[(0, 3, 1), (1, 0, 1)], input_ids=[1, 2], keep=[0, 1], prompts=[(0, 3), (1, 1)])
    assert graphs.takes(decode) and not graphs.takes(prefill)


def test_a_steps_tokens_go_to_the_prompt_store_below_the_prompt_length_and_to_the_own_slot_above() -> None:
    from trainer.generate.attention import StepState

    cache = KVCache(1, 4, 1, 8, 2, torch.float32, "cpu", SharedPrompts(3, 12, 8))
    # a decode of slot 0 past its prompt of 5; a prompt of 11 prefilled from 9 (9, 10 in it; 11, 12 past it)
    state = StepState.build(cache, [(0, 7, 1), (2, 9, 4)], torch.device("cpu"), prompts=[(1, 5), (2, 11)])
    assert (state.prompt.rows.tolist(), state.prompt.slots.tolist(), state.prompt.positions.tolist()) == (
        [1, 2], [2, 2], [9, 10])
    assert (state.own.rows.tolist(), state.own.slots.tolist(), state.own.positions.tolist()) == (
        [0, 3, 4], [0, 2, 2], [2, 0, 1])
    assert state.position_T.tolist() == [7, 9, 10, 11, 12]
    assert state.groups[0].prompt_lens.tolist() == [5] and state.groups[1].prompt_slots.tolist() == [2]
