"""Sampling: the processed distribution, seeded draws, stops, ``n``, logprobs (tiny Llama, fp32, CPU).

Support checks recompute each position's distribution with a plain forward of the whole
sequence (the model's own attention, no cache) and test the drawn token against it; logprobs
against that forward within 1e-4 (the sampler's cached fp32 attention sums in another order).
"""

from __future__ import annotations

import math

import pytest
import torch

from trainer.generate.engine import Engine
from trainer.generate.params import FINISH_LENGTH, FINISH_STOP, Request, SamplingParams
from trainer.generate.sampling import RowParams, choose, processed_logits
from trainer.model.tiny import build_tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

LOGPROB_ATOL = 1e-4
TEXTS = ("The cat", "Once upon a time", "A", "What is 4 plus one?", "Hello there")


@pytest.fixture(scope="module")
def tiny():
    model, tokenizer = build_tiny_model("llama", seed=0)
    return model.eval(), tokenizer


def _prompts(tokenizer) -> list[tuple[int, ...]]:
    return [tuple(tokenizer(t)["input_ids"]) for t in TEXTS]


def _run(tiny, params: SamplingParams, slots: int = 2, prompts=None) -> list:
    model, tokenizer = tiny
    prompts = prompts or _prompts(tokenizer)
    return Engine(model, tokenizer, slots=slots, max_len=64).generate([Request(p, params) for p in prompts])


def _direct_logprobs(model, prompt: tuple[int, ...], tokens: list[int], temperature: float = 1.0) -> torch.Tensor:
    """log_softmax(logits / temperature) at each generated position, from one uncached forward: [n, V]."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([list(prompt) + tokens]), use_cache=False).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1 : len(prompt) - 1 + len(tokens)] / temperature, dim=-1)


class TestProcessedLogits:
    def _rows(self, **params) -> RowParams:
        return RowParams.of([SamplingParams(**params)], 4, torch.device("cpu"))

    def test_top_p_keeps_the_smallest_set_that_reaches_p(self) -> None:
        logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
        kept = processed_logits(logits, self._rows(top_p=0.7)).isfinite()[0].tolist()
        assert kept == [True, True, False, False]  # 0.5 < 0.7 <= 0.5 + 0.3
        assert processed_logits(logits, self._rows(top_p=0.85)).isfinite()[0].tolist() == [True, True, True, False]
        assert processed_logits(logits, self._rows(top_p=0.1)).isfinite()[0].tolist() == [True, False, False, False]

    def test_top_k_then_top_p_renormalised_and_temperature_scales(self) -> None:
        logits = torch.tensor([[0.1, 0.2, 0.3, 0.4]]).log()
        out = processed_logits(logits, self._rows(top_k=2, top_p=0.5, temperature=0.5))
        # top-2 {0.4, 0.3} renormalised to {4/7, 3/7}: 4/7 >= 0.5 keeps only the first
        assert out.isfinite()[0].tolist() == [False, False, False, True]
        assert out[0, 3].item() == pytest.approx(math.log(0.4) / 0.5)

    def test_draws_follow_the_processed_distribution(self) -> None:
        probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
        draws = 4000
        logits = probs.log().expand(draws, -1)
        rows = RowParams.of([SamplingParams(top_k=3)] * draws, 4, torch.device("cpu"))
        generators = [torch.Generator().manual_seed(i) for i in range(draws)]
        counts = torch.bincount(choose(logits, rows, generators), minlength=4).float() / draws
        want = torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95
        assert counts[3] == 0 and torch.allclose(counts, want, atol=0.03), counts  # ~4 standard errors


class TestSeeds:
    def test_a_seeded_run_reproduces_and_another_seed_differs(self, tiny) -> None:
        params = SamplingParams(max_tokens=10, temperature=1.0, seed=7)
        first, again = _run(tiny, params), _run(tiny, params)
        other = _run(tiny, SamplingParams(max_tokens=10, temperature=1.0, seed=8))
        ids = [[c.token_ids for c in r.completions] for r in first]
        assert ids == [[c.token_ids for c in r.completions] for r in again]
        assert ids != [[c.token_ids for c in r.completions] for r in other]

    def test_a_seeded_completion_does_not_depend_on_its_batch(self, tiny) -> None:
        params = SamplingParams(max_tokens=10, temperature=1.0, seed=11)
        alone = _run(tiny, params, slots=1)
        together = _run(tiny, params, slots=4)
        assert [r.completions[0].token_ids for r in alone] == [r.completions[0].token_ids for r in together]

    def test_top_k_1_is_greedy(self, tiny) -> None:
        greedy = _run(tiny, SamplingParams(max_tokens=8, temperature=0.0))
        top1 = _run(tiny, SamplingParams(max_tokens=8, temperature=1.5, top_k=1, seed=3))
        assert [r.completions[0].token_ids for r in top1] == [r.completions[0].token_ids for r in greedy]


class TestSupport:
    @pytest.mark.parametrize(("temperature", "top_k", "top_p"), [(0.05, 0, 0.6), (0.1, 5, 1.0), (0.1, 8, 0.7)])
    def test_every_draw_lies_in_the_top_k_and_the_nucleus(self, tiny, temperature, top_k, top_p) -> None:
        model, tokenizer = tiny
        params = SamplingParams(max_tokens=12, temperature=temperature, top_k=top_k, top_p=top_p, seed=5)
        results = _run(tiny, params)
        sampled_outside_top1 = 0
        for prompt, result in zip(_prompts(tokenizer), results):
            tokens = result.completions[0].token_ids
            for position, logprobs in enumerate(_direct_logprobs(model, prompt, tokens, temperature)):
                order = logprobs.argsort(descending=True)
                rank = (order == tokens[position]).nonzero().item()
                probs = logprobs[order].exp()
                if top_k:
                    assert rank < top_k
                    probs = probs[:top_k] / probs[:top_k].sum()
                assert probs[:rank].sum().item() < top_p + 1e-6  # the more likely tokens had not reached p
                sampled_outside_top1 += rank > 0
        assert sampled_outside_top1  # the draws were not all greedy


class TestStops:
    def test_a_stop_string_cuts_the_text_before_it(self, tiny) -> None:
        model, tokenizer = tiny
        [free] = _run(tiny, SamplingParams(max_tokens=20, temperature=0.0), prompts=_prompts(tokenizer)[:1])
        text = free.completions[0].text
        stop = text[len(text) // 2 : len(text) // 2 + 3]
        [cut] = _run(tiny, SamplingParams(max_tokens=20, temperature=0.0, stop=("\x00never", stop)),
                     prompts=_prompts(tokenizer)[:1])
        completion = cut.completions[0]
        assert completion.finish_reason == FINISH_STOP and completion.text == text[: text.index(stop)]
        assert free.completions[0].token_ids[: len(completion.token_ids)] == completion.token_ids
        assert stop in tokenizer.decode(completion.token_ids) and len(completion.token_ids) < 20

    def test_stop_token_ids_and_eos_end_the_completion_without_them(self, tiny) -> None:
        model, tokenizer = tiny
        prompt = _prompts(tokenizer)[:1]
        [free] = _run(tiny, SamplingParams(max_tokens=12, temperature=0.0), prompts=prompt)
        tokens = free.completions[0].token_ids
        assert free.completions[0].finish_reason == FINISH_LENGTH
        [by_ids] = _run(tiny, SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=(tuple(tokens[5:7]),)),
                        prompts=prompt)
        assert by_ids.completions[0].token_ids == tokens[:5] and by_ids.completions[0].finish_reason == FINISH_STOP
        eos = model.generation_config.eos_token_id
        model.generation_config.eos_token_id = [eos, tokens[4]]
        try:
            [by_eos] = _run(tiny, SamplingParams(max_tokens=12, temperature=0.0), prompts=prompt)
            [ignored] = _run(tiny, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), prompts=prompt)
        finally:
            model.generation_config.eos_token_id = eos
        assert by_eos.completions[0].token_ids == tokens[: tokens.index(tokens[4])]
        assert by_eos.completions[0].finish_reason == FINISH_STOP
        assert ignored.completions[0].token_ids == tokens


class TestChoicesAndLogprobs:
    def test_n_choices_share_the_prefill_and_choice_0_is_the_single_run(self, tiny) -> None:
        model, tokenizer = tiny
        prompt = _prompts(tokenizer)[1]
        engine = Engine(model, tokenizer, slots=4, max_len=64)
        [result] = engine.generate([Request(prompt, SamplingParams(max_tokens=6, temperature=1.0, seed=2, n=3,
                                                                    ignore_eos=True))])
        assert [c.index for c in result.completions] == [0, 1, 2]
        assert len({tuple(c.token_ids) for c in result.completions}) == 3
        assert engine.stats.forward_tokens == len(prompt) + 3 * 5  # one prefill, then one token per choice and step
        [single] = _run(tiny, SamplingParams(max_tokens=6, temperature=1.0, seed=2, ignore_eos=True), prompts=[prompt])
        assert single.completions[0].token_ids == result.completions[0].token_ids

    def test_logprobs_are_the_raw_distributions_and_top_logprobs_its_head(self, tiny) -> None:
        model, tokenizer = tiny
        params = SamplingParams(max_tokens=8, temperature=0.7, top_p=0.9, seed=1, n=2, logprobs=True, top_logprobs=3)
        results = _run(tiny, params)
        for prompt, result in zip(_prompts(tokenizer), results):
            for completion in result.completions:
                assert len(completion.logprobs) == len(completion.token_ids)
                direct = _direct_logprobs(model, prompt, completion.token_ids)  # raw: no temperature
                for position, entry in enumerate(completion.logprobs):
                    assert entry.token_id == completion.token_ids[position]
                    assert entry.logprob == pytest.approx(direct[position, entry.token_id].item(), abs=LOGPROB_ATOL)
                    values, ids = direct[position].topk(3)
                    assert [t for t, _ in entry.top] == ids.tolist()
                    assert [v for _, v in entry.top] == pytest.approx(values.tolist(), abs=LOGPROB_ATOL)

    def test_no_logprobs_unless_asked(self, tiny) -> None:
        results = _run(tiny, SamplingParams(max_tokens=3))
        assert all(c.logprobs is None for r in results for c in r.completions)
