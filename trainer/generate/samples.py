"""Greedy sample generations at checkpoints: what the model says, not just its loss.

Prompts come from ``TrainConfig.sample_prompts`` or, without them, from the first
``sample_count`` records of the validation set (a chat record up to its last assistant turn, a
prompt/completion record's prompt, the first half of a text record's words). A prompt string is
rendered the way the training data is: through the chat template as one user turn (generation
prompt added, ``trainer.generate.chat``) when the training file is chat, as plain text otherwise.

Generation runs through the sampler (``trainer.generate.engine.Engine``: KV cache, every prompt
decoded together, greedy) on the training model itself: the installed LoRA and fused pieces need
no second code path. Under several ranks every rank runs the same forwards (FSDP2 gathers
parameters with all of them): each step's tokens are rank 0's (``Comm.broadcast_from_first``), so
every rank finishes every prompt at the same step. The cache lives for one ``generate`` call
(nothing is held between checkpoints); one host sync per decode step, only at checkpoints.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainer.config import TrainConfig
from trainer.data.dataset import detect_format, read_records
from trainer.generate.chat import render_messages
from trainer.generate.engine import Engine
from trainer.generate.params import Request, SamplingParams

SLOTS = 8
"""Prompts decoded at once (more wait for a free slot)."""


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

    def generate(self, model: torch.nn.Module, device: torch.device, autocast: Any,
                 comm: Any = None) -> list[dict[str, Any]]:
        """One ``{prompt, completion, tokens}`` per prompt, greedy, eos (or the length cap) ends it.

        ``comm``: the run's ``trainer.parallel.distributed.Comm`` (rank 0's tokens for all ranks).
        """
        agree = comm.broadcast_from_first if comm is not None and comm.world.is_distributed else None
        longest = max(len(p.ids) for p in self.prompts)
        engine = Engine(model, self.tokenizer, slots=min(SLOTS, len(self.prompts)),
                        max_len=longest + self.max_new_tokens, device=device, agree=agree)
        params = SamplingParams(max_tokens=self.max_new_tokens, temperature=0.0)
        with autocast:
            results = engine.generate([Request(tuple(p.ids), params) for p in self.prompts])
        return [{"prompt": p.text, "completion": r.completions[0].text, "tokens": len(r.completions[0].token_ids)}
                for p, r in zip(self.prompts, results)]


def validation_prompts(path: str, count: int, tokenizer: Any) -> list[Prompt]:
    """The first ``count`` validation records as prompts (see the module docstring)."""
    prompts = []
    for _, record in read_records(path)[:count]:
        fmt = detect_format(record)
        if fmt == "chat" or "preferred_output" in record:  # a DPO pair: its prompt is input.messages
            conversation = record if fmt == "chat" else record["input"]
            messages = conversation["messages"]
            last = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=len(messages))
            head = messages[:last]
            shown = head[-1]["content"] if head else ""
            prompts.append(Prompt(shown, render_messages(tokenizer, head, conversation.get("tools"))))
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
    return render_messages(tokenizer, [{"role": "user", "content": prompt}])


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
