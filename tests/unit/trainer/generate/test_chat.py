"""Messages to prompt ids: the prompt is what training renders before the assistant's answer."""

from __future__ import annotations

import pytest

from trainer.data.dataset import IGNORE_INDEX, tokenize_record
from trainer.generate.chat import render_messages

CONVERSATION = [
    {"role": "system", "content": "You answer in one sentence."},
    {"role": "user", "content": "What is 2 plus one?", "weight": 0},
]


class TestRenderMessages:
    def test_the_prompt_is_the_trained_conversation_up_to_the_answer(self, tiny_tokenizer) -> None:
        answer = {"role": "assistant", "content": "The answer is 3."}
        trained = tokenize_record({"messages": [*CONVERSATION, answer]}, "chat", tiny_tokenizer)
        prompt = render_messages(tiny_tokenizer, CONVERSATION)
        first_label = next(i for i, label in enumerate(trained.labels) if label != IGNORE_INDEX)
        assert prompt == trained.input_ids[:first_label]
        assert tiny_tokenizer.decode(prompt).endswith("<|assistant|>\n")

    def test_text_content_parts_are_joined(self, tiny_tokenizer) -> None:
        parts = [{"role": "user", "content": [{"type": "text", "text": "What is 2 "},
                                              {"type": "text", "text": "plus one?"}]}]
        assert render_messages(tiny_tokenizer, parts) == render_messages(tiny_tokenizer, CONVERSATION[1:])

    def test_a_non_text_part_is_refused(self, tiny_tokenizer) -> None:
        image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
        with pytest.raises(ValueError, match="image_url"):
            render_messages(tiny_tokenizer, image)

    def test_a_tokenizer_without_a_template_is_refused(self, tiny_tokenizer) -> None:
        plain = tiny_tokenizer.__class__(tokenizer_object=tiny_tokenizer.backend_tokenizer)
        with pytest.raises(ValueError, match="no chat template"):
            render_messages(plain, CONVERSATION)
