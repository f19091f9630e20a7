"""OpenAI's chat JSONL trains unchanged: ``weight: 0`` assistant turns carry no loss, ``tools``
and ``tool_calls`` reach the model's chat template (trainer.dataset)."""

from __future__ import annotations

import copy

import pytest

from trainer.data.dataset import IGNORE_INDEX, tokenize_record, validate_record

# A template that renders tools and tool calls, as real ones (Qwen, Llama 3.1) do, in the tiny
# tokenizer's vocabulary; arguments arrive as a dict (transformers' convention).
TOOLS_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}{{ '<|system|>\\ntools:' }}{% for t in tools %}{{ ' ' + t['function']['name'] }}"
    "{% endfor %}{{ eos_token + '\\n' }}{% endif %}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] }}"
    "{% for call in message.get('tool_calls') or [] %}"
    "{{ 'call ' + call['function']['name'] + ' city ' + call['function']['arguments']['city'] }}"
    "{% endfor %}"
    "{{ eos_token + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]


def labelled(tokenizer, sample) -> str:
    return tokenizer.decode([t for t in sample.labels if t != IGNORE_INDEX])


@pytest.fixture
def tools_tokenizer(tiny_tokenizer):
    tokenizer = copy.deepcopy(tiny_tokenizer)
    tokenizer.chat_template = TOOLS_TEMPLATE
    return tokenizer


class TestWeight:
    def test_weight_zero_assistant_turn_carries_no_loss(self, tiny_tokenizer):
        messages = [
            {"role": "user", "content": "the cat"},
            {"role": "assistant", "content": "sat on a mat", "weight": 0},
            {"role": "user", "content": "the dog"},
            {"role": "assistant", "content": "ran in the park", "weight": 1},
        ]
        sample = tokenize_record({"messages": messages}, "chat", tiny_tokenizer)
        assert labelled(tiny_tokenizer, sample) == "ran in the park<|eos|>\n"
        # The masked turn is still in the input, as context.
        assert "sat on a mat" in tiny_tokenizer.decode(sample.input_ids)
        assert "weight" not in tiny_tokenizer.decode(sample.input_ids)

    def test_same_tokens_as_without_weights_only_labels_differ(self, tiny_tokenizer):
        plain = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b c"},
                 {"role": "user", "content": "d"}, {"role": "assistant", "content": "e f"}]
        weighted = [dict(m) for m in plain]
        weighted[1]["weight"] = 0
        a = tokenize_record({"messages": plain}, "chat", tiny_tokenizer)
        b = tokenize_record({"messages": weighted}, "chat", tiny_tokenizer)
        assert a.input_ids == b.input_ids
        assert b.num_loss_tokens < a.num_loss_tokens
        changed = [i for i, (x, y) in enumerate(zip(a.labels, b.labels)) if x != y]
        assert changed and all(b.labels[i] == IGNORE_INDEX for i in changed)

    def test_every_answer_weighted_zero_is_refused(self):
        record = {"messages": [{"role": "user", "content": "a"},
                               {"role": "assistant", "content": "b", "weight": 0}]}
        assert "weight 0" in validate_record(record, "chat")

    @pytest.mark.parametrize("message", [
        {"role": "assistant", "content": "b", "weight": 2},
        {"role": "user", "content": "b", "weight": 1},
    ])
    def test_bad_weight_is_refused(self, message):
        record = {"messages": [{"role": "user", "content": "a"}, message,
                               {"role": "assistant", "content": "c"}]}
        assert "weight must be 0 or 1" in validate_record(record, "chat")


class TestTools:
    def test_tools_and_tool_calls_render_through_the_template(self, tools_tokenizer):
        record = {
            "tools": TOOLS,
            "messages": [
                {"role": "user", "content": "the sky"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "weather", "arguments": '{"city": "park"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "blue"},
                {"role": "assistant", "content": "the sky is blue"},
            ],
        }
        assert validate_record(record, "chat") is None
        sample = tokenize_record(record, "chat", tools_tokenizer)
        text = tools_tokenizer.decode(sample.input_ids)
        assert "tools: weather" in text
        # The call is trained (it is the assistant's answer), the tool's reply is not.
        assert labelled(tools_tokenizer, sample) == (
            "call weather city park<|eos|>\nthe sky is blue<|eos|>\n"
        )

    def test_null_content_without_tool_calls_is_refused(self):
        record = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": None}]}
        assert "null only beside tool_calls" in validate_record(record, "chat")
