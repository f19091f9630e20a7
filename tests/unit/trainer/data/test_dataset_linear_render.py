"""Chat records are rendered and tokenized once (trainer.data.chat_labels), with exactly the tokens
and labels of the per-turn definition, for every template style the tests use."""

from __future__ import annotations

import copy
import json
import random
from typing import Any

import pytest
from chat_templates import TEMPLATES, tokenizer_with
from trainer_helpers import write_jsonl

from trainer.data import chat_labels
from trainer.data.dataset import IGNORE_INDEX, Sample, template_message, load_samples, tokenize_record, validate_record
from trainer.errors import DatasetError

CALL = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "park"}'}}
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]


def per_turn_reference(record: dict[str, Any], tokenizer: Any) -> Sample:
    """The algorithm trainer.data.dataset used before: each answer's two prefixes rendered and tokenized."""
    weights = [m.get("weight", 1) for m in record["messages"]]
    messages = [template_message(m) for m in record["messages"]]
    tools = record.get("tools")

    def encode(conversation: list[dict[str, Any]], generation_prompt: bool) -> list[int]:
        text = tokenizer.apply_chat_template(conversation, tools=tools or None, tokenize=False,
                                             add_generation_prompt=generation_prompt)
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    ids = encode(messages, False)
    labels = [IGNORE_INDEX] * len(ids)
    for i, message in enumerate(messages):
        if message["role"] != "assistant" or weights[i] == 0:
            continue
        start_ids = encode(messages[:i], True)
        end_ids = ids if i == len(messages) - 1 else encode(messages[: i + 1], False)
        if ids[: len(start_ids)] != start_ids or ids[: len(end_ids)] != end_ids:
            continue
        labels[len(start_ids) : len(end_ids)] = ids[len(start_ids) : len(end_ids)]
    return Sample(ids, labels)


def chat(*turns: tuple[str, Any], **extra: Any) -> dict[str, Any]:
    messages = []
    for role, content in turns:
        messages.append({"role": role, "content": content} if not isinstance(content, dict) else {"role": role, **content})
    return {"messages": messages, **extra}


RECORDS = {
    "two_turns": chat(("user", "What is two?"), ("assistant", "A number."), ("user", "And three?"),
                      ("assistant", "Also a number.")),
    "system_prompt": chat(("system", "Be brief."), ("user", "Name a colour."), ("assistant", "Blue."),
                          ("user", "Another?"), ("assistant", "Red."), ("user", "One more"), ("assistant", "Green.")),
    "padded_contents": chat(("system", "  Be brief. \n"), ("user", "\n hello there  "), ("assistant", "  hi!\n\n"),
                            ("user", " bye "), ("assistant", "\tbye now ")),
    "weights": chat(("user", "the cat"), ("assistant", {"content": "sat on a mat", "weight": 0}),
                    ("user", "the dog"), ("assistant", {"content": "ran in the park", "weight": 1}),
                    ("user", "the bird"), ("assistant", "flew")),
    "repeated_contents": chat(("user", "same"), ("assistant", {"content": "same", "weight": 0}), ("user", "same"),
                              ("assistant", "same"), ("user", "same"), ("assistant", "same")),
    "empty_messages": chat(("user", ""), ("assistant", "first"), ("user", "q"), ("assistant", ""),
                           ("user", "again"), ("assistant", "last")),
    "trailing_user": chat(("user", "a"), ("assistant", "b c"), ("user", "d")),
    "unicode_and_markup": chat(("user", "héllo 👋 <|im_end|> [/INST]"), ("assistant", "wörld 🌍 <end_of_turn>"),
                               ("user", "ok"), ("assistant", "done.")),
    "tools": chat(("user", "the sky"), ("assistant", {"content": None, "tool_calls": [CALL]}),
                  ("tool", {"tool_call_id": "call_1", "content": "blue"}), ("assistant", "the sky is blue"),
                  ("user", "and now?"), ("assistant", "still blue"), tools=TOOLS),
    "tool_calls_with_text": chat(("system", "sys"), ("user", "weather?"),
                                 ("assistant", {"content": "Let me look.", "tool_calls": [CALL]}),
                                 ("tool", {"tool_call_id": "call_1", "content": "sunny"}),
                                 ("tool", {"tool_call_id": "call_2", "content": "warm"}),
                                 ("assistant", "Sunny and warm."), tools=TOOLS),
    "markup_in_contents": chat(("user", "hi<|eos|>\n<|assistant|>\nfake<|im_end|>\n<|im_start|>assistant\n"),
                               ("assistant", "real<|eos|>\n"), ("user", "[/INST] x <end_of_turn>"), ("assistant", "y")),
    "consecutive_answers": chat(("user", "tell me"), ("assistant", "one"), ("assistant", "two"), ("user", "more"),
                                ("assistant", "three")),
    "assistant_first": chat(("assistant", "I speak first."), ("user", "ok"), ("assistant", "good")),
    "many_turns": chat(*[(role, f"{role} turn {i}") for i in range(40) for role in ("user", "assistant")]),
}


def outcome(fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 - a template that raises must raise on both paths
        return type(exc).__name__


@pytest.mark.parametrize("template", sorted(TEMPLATES))
@pytest.mark.parametrize("name", sorted(RECORDS))
def test_one_render_gives_the_per_turn_tokens_and_labels(tiny_tokenizer, template, name):
    tokenizer = tokenizer_with(tiny_tokenizer, template)
    record = copy.deepcopy(RECORDS[name])
    assert validate_record(record, "chat") is None
    expected = outcome(per_turn_reference, record, tokenizer)
    got = outcome(tokenize_record, record, "chat", tokenizer)
    assert got == expected


@pytest.mark.parametrize("template", ["mistral_v3", "llama2", "tiny", "llama3"])
@pytest.mark.parametrize("name", ["two_turns", "padded_contents", "weights", "unicode_and_markup"])
def test_offsets_trimmed_of_their_spaces_give_the_per_turn_labels_too(tiny_tokenizer, template, name):
    """Byte-level tokenizers with ``trim_offsets`` leave the leading space of " Green" out of its
    offsets; the boundary before it is still where the previous token ends."""
    from tokenizers import processors

    tokenizer = tokenizer_with(tiny_tokenizer, template)
    tokenizer.backend_tokenizer.post_processor = processors.ByteLevel(trim_offsets=True)
    text = tokenizer.apply_chat_template(RECORDS[name]["messages"], tokenize=False)
    offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    assert any(a[1] < b[0] for a, b in zip(offsets, offsets[1:])), "the offsets do have gaps"
    assert outcome(tokenize_record, RECORDS[name], "chat", tokenizer) == outcome(per_turn_reference, RECORDS[name], tokenizer)


FRAGMENTS = ["hi", "the cat", " padded ", "\n", "", "same", "<|eos|>", "[/INST]", "<|im_end|>\n", "ok.", "été 🌍",
             "  ", "A", "assistant", "user"]


def random_record(rng: random.Random) -> dict[str, Any]:
    """A conversation of odd roles, orders, weights, tool calls and contents made of template markup."""
    def content() -> str:
        return "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(0, 3)))

    messages: list[dict[str, Any]] = [{"role": "system", "content": content()}] if rng.random() < 0.3 else []
    for k in range(rng.randint(1, 9)):
        role = rng.choice(["user", "assistant", "tool"]) if rng.random() < 0.3 else ("user", "assistant")[k % 2]
        message: dict[str, Any] = {"role": role, "content": content()}
        if role == "assistant" and rng.random() < 0.2:
            message["weight"] = 0
        if role == "assistant" and rng.random() < 0.1:
            message = {"role": "assistant", "content": None, "tool_calls": [CALL]}
        messages.append(message)
    messages.append({"role": "assistant", "content": content() or "x"})
    return {"messages": messages, **({"tools": TOOLS} if rng.random() < 0.2 else {})}


@pytest.mark.parametrize("seed", range(4))
def test_random_conversations_of_template_markup_give_the_per_turn_labels(tiny_tokenizer, seed):
    """Contents that spell the templates' own markup, roles in any order: the walk may be fooled,
    the checks are not (2,500 such records x every template gave no difference while writing this)."""
    rng = random.Random(seed)
    tokenizers = {name: tokenizer_with(tiny_tokenizer, name) for name in TEMPLATES}
    for _ in range(15):
        record = random_record(rng)
        for name, tokenizer in tokenizers.items():
            expected = outcome(per_turn_reference, copy.deepcopy(record), tokenizer)
            assert outcome(tokenize_record, copy.deepcopy(record), "chat", tokenizer) == expected, (name, record)


def labelled(tokenizer: Any, sample: Sample) -> str:
    return tokenizer.decode([t for t in sample.labels if t != IGNORE_INDEX])


class TestWhatTheEquivalenceCovers:
    """The templates above exercise each path of chat_labels (not only the easy one)."""

    def test_qwen3_trains_only_the_answer_after_the_last_question(self, tiny_tokenizer):
        tokenizer = tokenizer_with(tiny_tokenizer, "qwen3")
        sample = tokenize_record(RECORDS["two_turns"], "chat", tokenizer)
        assert labelled(tokenizer, sample) == "<think>\n\n</think>\n\nAlso a number.<|im_end|>\n"

    def test_a_block_before_the_last_user_turn_is_found_by_the_checks(self, tiny_tokenizer, monkeypatch):
        tokenizer = tokenizer_with(tiny_tokenizer, "mistral_v3_tools")
        per_turn = CountingCalls(chat_labels, "_all_per_turn", monkeypatch)
        sample = tokenize_record(RECORDS["system_prompt"], "chat", tokenizer)
        assert per_turn.calls == 1
        assert labelled(tokenizer, sample) == " Green.<|eos|>"

    def test_trimming_templates_are_followed_in_one_pass(self, tiny_tokenizer, monkeypatch):
        tokenizer = tokenizer_with(tiny_tokenizer, "llama3")
        per_turn = CountingCalls(chat_labels, "_all_per_turn", monkeypatch)
        sample = tokenize_record(RECORDS["padded_contents"], "chat", tokenizer)
        assert per_turn.calls == 0
        assert labelled(tokenizer, sample) == "hi!<|eot_id|>bye now<|eot_id|>"


class CountingCalls:
    def __init__(self, module: Any, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls, original = 0, getattr(module, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)


class CountingTokenizer:
    """The tokenizer, counting its tokenizations and its chat-template renderings."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer, self.tokenized, self.rendered = tokenizer, 0, 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.tokenized += 1
        return self._tokenizer(*args, **kwargs)

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> Any:
        self.rendered += 1
        return self._tokenizer.apply_chat_template(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)


class TestCost:
    @pytest.mark.parametrize("template", ["tiny", "chatml_qwen25", "llama3", "gemma2"])
    def test_a_4000_turn_record_is_tokenized_once_and_rendered_a_bounded_number_of_times(self, tiny_tokenizer, template):
        tokenizer = CountingTokenizer(tokenizer_with(tiny_tokenizer, template))
        record = chat(*[(role, f"{role} {i}") for i in range(2000) for role in ("user", "assistant")])
        sample = tokenize_record(record, "chat", tokenizer)
        assert tokenizer.tokenized == 1
        assert tokenizer.rendered <= 12  # the record, 3 probes per message shape, 4 checks
        answers = labelled(tokenizer._tokenizer, sample)
        assert answers.count("assistant ") == 2000 and "user" not in answers

    def test_a_template_followed_only_per_turn_refuses_a_long_record_naming_why(self, tiny_tokenizer):
        tokenizer = tokenizer_with(tiny_tokenizer, "mistral_v3_tools")
        turns = [("system", "sys")] + [(role, f"{role} {i}") for i in range(100) for role in ("user", "assistant")]
        with pytest.raises(DatasetError, match=r"at most 64 assistant turns \(this record has 100\)"):
            tokenize_record(chat(*turns), "chat", tokenizer)

    def test_load_samples_names_the_line_of_a_record_too_long_to_follow_per_turn(self, tmp_path, tiny_tokenizer):
        tokenizer = tokenizer_with(tiny_tokenizer, "mistral_v3_tools")
        turns = [("system", "sys")] + [(role, f"{role} {i}") for i in range(70) for role in ("user", "assistant")]
        path = write_jsonl(tmp_path / "d.jsonl", [RECORDS["two_turns"], chat(*turns)])
        with pytest.raises(DatasetError, match=r"d.jsonl, line 2: .*at most 64 assistant turns"):
            load_samples(path, tokenizer)

    def test_a_slow_tokenizer_is_followed_per_turn_within_the_bound(self, tiny_tokenizer, monkeypatch):
        tokenizer = tokenizer_with(tiny_tokenizer, "tiny")
        monkeypatch.setattr(type(tokenizer), "is_fast", property(lambda self: False))
        record = RECORDS["system_prompt"]
        assert tokenize_record(record, "chat", tokenizer) == per_turn_reference(record, tokenizer)
        long = chat(*[(role, f"{role} {i}") for i in range(65) for role in ("user", "assistant")])
        with pytest.raises(DatasetError, match="no character offsets"):
            tokenize_record(long, "chat", tokenizer)


def test_records_are_json_round_trippable():
    """The records above are what a JSONL line can hold (no Python-only values)."""
    for record in RECORDS.values():
        assert json.loads(json.dumps(record)) == record
