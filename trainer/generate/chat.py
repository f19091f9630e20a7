"""OpenAI-style ``messages`` to prompt ids, through the tokenizer's chat template.

The conversation is rendered as training renders chat records (``trainer.data.dataset``: the
same message clean-up, ``template_message``, and the same tools argument), with the generation
prompt added, then tokenized without special tokens (the template writes its own bos).
A message whose content is a list of OpenAI content parts is joined to its text parts.
"""

from __future__ import annotations

from typing import Any

from trainer.data.dataset import template_message


def render_messages(tokenizer: Any, messages: list[dict[str, Any]],
                    tools: list[dict[str, Any]] | None = None) -> list[int]:
    """The prompt ids that ask the model for the next assistant turn after ``messages``.

    Raises:
        ValueError: the tokenizer has no chat template, or a content part is not text.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"{type(tokenizer).__name__} has no chat template: send a plain prompt instead of messages"
        )
    conversation = [template_message(_text_content(m)) for m in messages]
    text = tokenizer.apply_chat_template(conversation, tools=tools or None, tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _text_content(message: dict[str, Any]) -> dict[str, Any]:
    content = message.get("content")
    if not isinstance(content, list):
        return message
    parts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ValueError(f"message content part of type {kind!r}: only text parts are supported")
        parts.append(part.get("text", ""))
    return {**message, "content": "".join(parts)}
