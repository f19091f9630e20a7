"""The serving loop (``trainer.generate.serve``): streamed requests get ``generate``'s completions,
join a running batch, cancel, and never stream text a stop string later cuts (fp32, CPU)."""

from __future__ import annotations

import pytest

from trainer.generate.engine import Engine
from trainer.generate.params import Request, SamplingParams
from trainer.generate.serve import FINISH_CANCELLED, Delta, Server
from trainer.model.tiny import build_tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

TEXTS = ("The cat", "Once upon a time, there lived a miller who", "A", "What is the capital of France?")


@pytest.fixture(scope="module")
def tiny():
    model, tokenizer = build_tiny_model("llama", seed=0)
    return model.eval(), tokenizer


def _ids(tokenizer, text: str) -> tuple[int, ...]:
    return tuple(tokenizer(text)["input_ids"])


def _collect(stream) -> dict[int, list[Delta]]:
    choices: dict[int, list[Delta]] = {}
    for delta in stream:
        choices.setdefault(delta.choice, []).append(delta)
    return choices


def test_streamed_requests_get_generates_completions(tiny) -> None:
    model, tokenizer = tiny
    requests = [
        Request(_ids(tokenizer, TEXTS[0]), SamplingParams(max_tokens=9, temperature=0.0)),
        Request(_ids(tokenizer, TEXTS[1]), SamplingParams(max_tokens=5, temperature=0.0, logprobs=True)),
        Request(_ids(tokenizer, TEXTS[2]), SamplingParams(max_tokens=7, temperature=0.9, top_p=0.9, seed=3, n=2)),
        Request(_ids(tokenizer, TEXTS[3]), SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)),
    ]
    want = Engine(model, tokenizer, slots=3, max_len=64).generate(requests)
    server = Server(Engine(model, tokenizer, slots=3, max_len=64)).start()
    try:
        streams = [server.submit(r) for r in requests]
        got = [_collect(s) for s in streams]
    finally:
        server.close()
    for request, result, choices in zip(requests, want, got):
        assert sorted(choices) == list(range(request.params.n))
        for completion in result.completions:
            deltas = choices[completion.index]
            assert [d.finish_reason for d in deltas[:-1]] == [None] * (len(deltas) - 1)
            assert deltas[-1].finish_reason == completion.finish_reason
            assert [t for d in deltas for t in d.token_ids] == completion.token_ids
            assert "".join(d.text for d in deltas) == completion.text
            if request.params.logprobs:
                streamed = [lp for d in deltas for lp in d.logprobs]
                assert [lp.token_id for lp in streamed] == completion.token_ids
                assert [lp.logprob for lp in streamed] == pytest.approx([lp.logprob for lp in completion.logprobs])


def test_a_request_submitted_mid_decode_joins_the_running_batch(tiny) -> None:
    model, tokenizer = tiny
    server = Server(Engine(model, tokenizer, slots=2, max_len=2048)).start()
    try:  # "long" cannot finish on its own before the test cancels it, however slow this machine is
        long = server.submit(Request(_ids(tokenizer, TEXTS[0]), SamplingParams(max_tokens=2000, ignore_eos=True,
                                                                                temperature=0.0)))
        deltas = iter(long)
        assert next(deltas).finish_reason is None
        short = _collect(server.submit(Request(_ids(tokenizer, TEXTS[2]), SamplingParams(
            max_tokens=3, ignore_eos=True, temperature=0.0))))[0]
        long.cancel()
        rest = list(deltas)
    finally:
        server.close()
    # admitted into the free slot and finished while "long" kept decoding
    assert short[-1].finish_reason == "length" and sum(len(d.token_ids) for d in short) == 3
    assert rest[-1].finish_reason == FINISH_CANCELLED and len(rest) > 1


def test_cancel_frees_the_slot_for_the_queue(tiny) -> None:
    model, tokenizer = tiny
    server = Server(Engine(model, tokenizer, slots=1, max_len=2048)).start()
    try:
        endless = server.submit(Request(_ids(tokenizer, TEXTS[0]), SamplingParams(max_tokens=2000, ignore_eos=True)))
        waiting = server.submit(Request(_ids(tokenizer, TEXTS[2]), SamplingParams(max_tokens=4, ignore_eos=True)))
        deltas = iter(endless)
        next(deltas)
        endless.cancel()
        rest = list(deltas)
        done = _collect(waiting)[0]
    finally:
        server.close()
    assert rest[-1].finish_reason == FINISH_CANCELLED
    assert sum(len(d.token_ids) for d in rest) < 1990
    assert done[-1].finish_reason == "length" and sum(len(d.token_ids) for d in done) == 4


def test_no_streamed_text_is_cut_by_a_stop_string_later(tiny) -> None:
    model, tokenizer = tiny
    prompt = _ids(tokenizer, TEXTS[1])
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    [free] = Engine(model, tokenizer, slots=1, max_len=96).generate([Request(prompt, params)])
    text = free.completions[0].text
    assert len(text) > 12, text
    stop = text[8:12]  # a string the completion reaches mid-way
    stopped = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=(stop,))
    [want] = Engine(model, tokenizer, slots=1, max_len=96).generate([Request(prompt, stopped)])
    server = Server(Engine(model, tokenizer, slots=1, max_len=96)).start()
    try:
        deltas = _collect(server.submit(Request(prompt, stopped)))[0]
    finally:
        server.close()
    assert want.completions[0].finish_reason == "stop" and stop not in want.completions[0].text
    assert "".join(d.text for d in deltas) == want.completions[0].text == text[: text.find(stop)]
    assert deltas[-1].finish_reason == "stop"


def test_a_prompt_too_long_is_refused_and_close_cancels_what_runs(tiny) -> None:
    model, tokenizer = tiny
    server = Server(Engine(model, tokenizer, slots=1, max_len=2048)).start()
    with pytest.raises(ValueError, match="a prompt of 2048 tokens leaves no room in max_len=2048"):
        server.submit(Request((5,) * 2048, SamplingParams(max_tokens=2)))
    running = server.submit(Request(_ids(tokenizer, TEXTS[0]), SamplingParams(max_tokens=10_000, ignore_eos=True)))
    deltas = iter(running)
    next(deltas)
    server.close()
    assert list(deltas)[-1].finish_reason == FINISH_CANCELLED
    with pytest.raises(RuntimeError, match="the sampler is not running"):
        server.submit(Request(_ids(tokenizer, TEXTS[0]), SamplingParams(max_tokens=2)))
