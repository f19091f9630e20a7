"""Greedy sample generations at checkpoints: what the model says, not just its loss.

Prompts come from ``TrainConfig.sample_prompts`` or, without them, from the first
``sample_count`` records of the validation set (a chat record up to its last assistant turn, a
prompt/completion record's prompt, the first half of a text record's words). A prompt string is
rendered the way the training data is: through the chat template as one user turn (generation
prompt added) when the training file is chat, as plain text otherwise.

Generation runs through the same packed forward as training (``trainer.features.loss.packed_forward``, one
sample per row, no KV cache): the installed attention, LoRA and loss pieces need no second code
path, and every rank runs the same forwards (FSDP2 gathers parameters with all of them). Each new
token is read back to test for eos: one host sync per token, only at checkpoints, never in a step.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainer.config import TrainConfig
from trainer.data.dataset import Sample, detect_format, read_records
from trainer.features.loss.packed_forward import packed_forward
from trainer.data.packing import pack_batch


@dataclass(frozen=True)
class Prompt:
    text: str
    """The prompt as shown in the ``sample`` event (the user's string or the record's)."""
    ids: list[int]
    """Its token ids, rendered as the training data is."""


class Sampler:
    """Greedy generations for a fixed list of prompts."""

    def __init__(self, prompts: list[Prompt], tokenizer: Any, max_new_tokens: int) -> None:
        self.prompts, self.tokenizer, self.max_new_tokens = prompts, tokenizer, max_new_tokens

    @classmethod
    def for_run(cls, config: TrainConfig, tokenizer: Any) -> Sampler | None:
        """The run's sampler, or None when it samples nothing."""
        chat = _is_chat(config) and bool(getattr(tokenizer, "chat_template", None))
        if config.sample_prompts:
            prompts = [Prompt(p, _render_text(p, tokenizer, chat)) for p in config.sample_prompts]
        elif config.sample_count and config.data.validation_path:
            prompts = validation_prompts(config.data.validation_path, config.sample_count, tokenizer)
        else:
            return None
        return cls(prompts, tokenizer, config.sample_max_new_tokens) if prompts else None

    def generate(self, model: torch.nn.Module, installed: Any, device: torch.device, autocast: Any) -> list[dict[str, Any]]:
        """One ``{prompt, completion, tokens}`` per prompt, greedy, eos (or the length cap) ends it."""
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                return [self._one(p, model, installed, device, autocast) for p in self.prompts]
        finally:
            model.train(was_training)

    def _one(self, prompt: Prompt, model: torch.nn.Module, installed: Any, device: torch.device,
             autocast: Any) -> dict[str, Any]:
        ids, new = list(prompt.ids), []
        eos = self.tokenizer.eos_token_id
        for _ in range(self.max_new_tokens):
            batch, meta = installed.micro_batch(pack_batch([Sample(ids, ids)]), device)
            with autocast:
                logits = packed_forward(model, batch, meta)
            token = int(logits[0, -1].argmax().item())
            if token == eos:
                break
            ids.append(token)
            new.append(token)
        return {"prompt": prompt.text, "completion": self.tokenizer.decode(new, skip_special_tokens=True),
                "tokens": len(new)}


def validation_prompts(path: str, count: int, tokenizer: Any) -> list[Prompt]:
    """The first ``count`` validation records as prompts (see the module docstring)."""
    prompts = []
    for _, record in read_records(path)[:count]:
        fmt = detect_format(record)
        if fmt == "chat" or "preferred_output" in record:  # a DPO pair: its prompt is input.messages
            messages = record["messages"] if fmt == "chat" else record["input"]["messages"]
            last = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=len(messages))
            head = messages[:last]
            text = tokenizer.apply_chat_template(head, tokenize=False, add_generation_prompt=True)
            shown = head[-1]["content"] if head else ""
            prompts.append(Prompt(shown, tokenizer(text, add_special_tokens=False)["input_ids"]))
        elif fmt == "prompt_completion":
            prompts.append(Prompt(record["prompt"], tokenizer(record["prompt"])["input_ids"]))
        elif fmt == "text":
            words = record["text"].split()
            shown = " ".join(words[: max(1, len(words) // 2)])
            prompts.append(Prompt(shown, tokenizer(shown)["input_ids"]))
    return prompts


def _render_text(prompt: str, tokenizer: Any, chat: bool) -> list[int]:
    if not chat:
        return tokenizer(prompt)["input_ids"]
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _is_chat(config: TrainConfig) -> bool:
    """Whether the training file is chat (its declared format, or its first record's; preference
    records, DPO's, are conversations)."""
    if config.data.format != "auto":
        return config.data.format in ("chat", "preference")
    with Path(config.data.train_path).open(encoding="utf-8") as f:
        for line in f:
            if line.strip():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    return False
                return isinstance(record, dict) and (detect_format(record) == "chat" or "preferred_output" in record)
    return False
