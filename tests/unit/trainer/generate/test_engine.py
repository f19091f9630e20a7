"""The engine's machinery: the schedule (hand-checked), one cache allocation, each token fed once."""

from __future__ import annotations

import pytest
import torch

from trainer.generate.attention import ATTN_IMPLEMENTATION, model_reason
from trainer.generate.cache import KVCache
from trainer.generate.engine import Engine
from trainer.generate.params import FINISH_LENGTH, Request, SamplingParams
from trainer.generate.scheduler import Scheduler
from trainer.generate.stopping import Stopper
from trainer.model.tiny import build_tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny():
    model, tokenizer = build_tiny_model("llama", seed=0)
    return model.eval(), tokenizer


def _scheduler(requests: list[Request], slots: int, max_batch_tokens: int = 100) -> Scheduler:
    return Scheduler(requests, slots, 32, max_batch_tokens, lambda p, n: Stopper(p, frozenset(), None, 32 - n),
                     lambda seed: None, lambda: 0)


def _greedy(prompt: tuple[int, ...], max_tokens: int, n: int = 1) -> Request:
    return Request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, n=n))


class TestScheduler:
    def test_finished_slots_are_refilled_from_the_queue(self) -> None:
        # A (3 tokens, 1 new), B (2 tokens, 3 new), C (4 tokens, 2 new) on 2 slots
        scheduler = _scheduler([_greedy((1, 2, 3), 1), _greedy((4, 5), 3), _greedy((6, 7, 8, 9), 2)], slots=2)
        rows = []
        while scheduler.busy:
            plan = scheduler.plan()
            rows.append((plan.segments, plan.input_ids, plan.keep))
            scheduler.advance(plan, [100 + len(rows)] * len(plan.sampled), [None] * len(plan.sampled))
        assert rows == [
            ([(0, 0, 3), (1, 0, 2)], [1, 2, 3, 4, 5], [2, 4]),  # both prompts; A is done after 1 token
            ([(1, 2, 1), (0, 0, 4)], [101, 6, 7, 8, 9], [0, 4]),  # B decodes at position 2, C takes slot 0
            ([(0, 4, 1), (1, 3, 1)], [102, 102], [0, 1]),  # both decode; B and C are done
        ]
        assert [[c.token_ids for c in r.completions] for r in scheduler.results()] == [[[101]], [[101, 102, 103]],
                                                                                       [[102, 103]]]

    def test_a_prompt_waits_when_the_step_is_full_but_the_first_always_goes(self) -> None:
        scheduler = _scheduler([_greedy((1,) * 6, 2), _greedy((2,) * 3, 2)], slots=2, max_batch_tokens=4)
        first = scheduler.plan()
        assert first.segments == [(0, 0, 6)]  # over the budget, but alone
        scheduler.advance(first, [9], [None])
        assert scheduler.plan().segments == [(0, 6, 1), (1, 0, 3)]  # 1 + 3 tokens fit

    def test_choices_of_one_prompt_fork_from_its_prefill(self) -> None:
        scheduler = _scheduler([_greedy((1, 2, 3), 2, n=3), _greedy((4,), 2)], slots=3)
        plan = scheduler.plan()
        assert plan.segments == [(0, 0, 3)] and plan.keep == [2] and plan.pick == [0, 0, 0]
        assert plan.forks == [(0, [1, 2], 3)]  # the last request waits for a slot


class TestEngine:
    def test_the_cache_is_allocated_once_and_each_token_is_fed_once(self, tiny, monkeypatch) -> None:
        model, tokenizer = tiny
        built = []
        init = KVCache.__init__
        monkeypatch.setattr(KVCache, "__init__", lambda self, *a, **k: built.append(a) or init(self, *a, **k))
        fed: list[int] = []
        hook = model.get_input_embeddings().register_forward_pre_hook(lambda _, args: fed.append(args[0].numel()))
        engine = Engine(model, tokenizer, slots=3, max_len=48)
        prompts = [tuple(tokenizer(t)["input_ids"]) for t in ("The cat", "Once upon a time", "A", "Hello", "Yes")]
        budgets = [7, 3, 9, 4, 5]
        requests = [Request(p, SamplingParams(max_tokens=m, ignore_eos=True)) for p, m in zip(prompts, budgets)]
        try:
            engine.generate(requests)
            pointers = [t.data_ptr() for t in engine.cache.keys_SHLD + engine.cache.values_SHLD]
            results = engine.generate(requests)
        finally:
            hook.remove()
        assert len(built) == engine.stats.caches_allocated == 1  # for two calls of many steps each
        assert pointers == [t.data_ptr() for t in engine.cache.keys_SHLD + engine.cache.values_SHLD]
        assert [len(r.completions[0].token_ids) for r in results] == budgets
        # each prompt once, then each generated token but the last: no step re-runs a prompt
        assert sum(fed) == 2 * (sum(map(len, prompts)) + sum(budgets) - len(budgets))
        assert fed[0] == sum(map(len, prompts[:3]))  # three slots: three prompts in the first row
        assert len(fed) == engine.stats.forwards and sum(fed) == engine.stats.forward_tokens

    def test_lockstep_runs_idle_forwards_until_every_rank_is_done_and_samples_the_same(self, tiny) -> None:
        """A rank done before the others (``lockstep`` says another is busy for 3 more steps) keeps
        stepping on one-token idle forwards, so it runs as many forwards as the busiest rank; its
        own completions are those of a plain run; a rank with no requests only idles."""
        model, tokenizer = tiny
        requests = [Request((1, 40, 41), SamplingParams(max_tokens=4, seed=7, n=2))]
        plain = Engine(model, tokenizer, slots=2, max_len=16)
        want = plain.generate(requests)
        asked: list[bool] = []

        def others_busy_for(extra: int):  # noqa: ANN202 - the any-rank callable
            def any_rank(busy: bool) -> bool:
                asked.append(busy)
                return busy or asked.count(False) <= extra
            return any_rank

        engine = Engine(model, tokenizer, slots=2, max_len=16)
        got = engine.generate(requests, others_busy_for(3))
        assert [[c.token_ids for c in r.completions] for r in got] == [[c.token_ids for c in r.completions] for r in want]
        assert engine.stats.forwards == plain.stats.forwards + 3 and engine.stats.idle_forwards == 3
        assert asked == [True] * plain.stats.forwards + [False] * 4  # asked each step, once more to stop
        asked.clear()
        idle = Engine(model, tokenizer, slots=1, max_len=16)
        assert idle.generate([], others_busy_for(2)) == [] and idle.stats.idle_forwards == 2

    def test_max_len_cuts_a_sequence_and_a_prompt_that_fills_it_is_refused(self, tiny) -> None:
        model, tokenizer = tiny
        engine = Engine(model, tokenizer, slots=2, max_len=8)
        [result] = engine.generate([Request((1, 40, 41, 42, 43), SamplingParams(max_tokens=10, ignore_eos=True))])
        assert len(result.completions[0].token_ids) == 3 and result.completions[0].finish_reason == FINISH_LENGTH
        with pytest.raises(ValueError, match="max_len=8"):
            engine.generate([Request(tuple(range(1, 9)))])

    def test_the_attention_implementation_is_restored_even_after_an_error(self, tiny) -> None:
        model, tokenizer = tiny
        before = model.config._attn_implementation
        engine = Engine(model, None, slots=1, max_len=16)
        with pytest.raises(ValueError, match="stop strings need a tokenizer"):
            engine.generate([Request((1, 2), SamplingParams(stop=("x",)))])
        calls = []

        def fail(*args, **kwargs):
            calls.append(model.config._attn_implementation)
            raise RuntimeError("boom")

        engine._step = fail
        with pytest.raises(RuntimeError, match="boom"):
            engine.generate([Request((1, 2))])
        assert calls == [ATTN_IMPLEMENTATION] and model.config._attn_implementation == before

    def test_models_with_other_layer_state_are_refused(self) -> None:
        from transformers import Qwen3Config

        config = Qwen3Config(num_hidden_layers=2, layer_types=["full_attention", "linear_attention"])
        assert "linear_attention" in model_reason(config)
        assert model_reason(Qwen3Config(num_hidden_layers=2)) is None


class TestSamplingParams:
    @pytest.mark.parametrize(("field", "value"), [("max_tokens", 0), ("temperature", -1.0), ("top_p", 0.0),
                                                  ("top_k", -1), ("n", 0), ("stop", ("",))])
    def test_bad_values_name_the_field(self, field: str, value: object) -> None:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**{field: value})

    def test_top_logprobs_needs_logprobs(self) -> None:
        with pytest.raises(ValueError, match="logprobs=True"):
            SamplingParams(top_logprobs=2)
