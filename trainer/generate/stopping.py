"""When a sequence ends, and what of it is returned.

After each new token, in this order: an eos id (the tokenizer's and the generation config's,
unless ``ignore_eos``) ends it, the id not returned; generated ids ending with one of
``stop_token_ids`` end it, that sequence not returned; a ``stop`` string appearing in the text
ends it, the text cut before the string (the ids stay whole: the token that completed the string
is the last one); ``max_tokens`` new tokens, or a sequence as long as the cache's ``max_len``
(prompt included, as transformers' ``max_length``), end it with ``length``.

Stop strings are searched incrementally: each token decodes only the tail of the ids that can
hold a string ending in it (a character is at most 4 byte-level tokens), so a step costs the
length of the longest stop string, not of the text; the full text is decoded once at the end.
"""

from __future__ import annotations

from typing import Any

from trainer.generate.params import FINISH_LENGTH, FINISH_STOP, SamplingParams

_TOKENS_PER_CHAR = 4


def eos_ids(tokenizer: Any, generation_config: Any) -> frozenset[int]:
    """The ids that end a sequence: the tokenizer's eos and the generation config's (int or list)."""
    ids: set[int] = set()
    for source in (getattr(tokenizer, "eos_token_id", None), getattr(generation_config, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif source is not None:
            ids.update(int(i) for i in source)
    return frozenset(ids)


class Stopper:
    """One sequence's stop rules (see the module docstring)."""

    def __init__(self, params: SamplingParams, eos: frozenset[int], tokenizer: Any, room: int) -> None:
        """``room``: new tokens the cache has space for (``max_len`` minus the prompt)."""
        if params.stop and tokenizer is None:
            raise ValueError("stop: stop strings need a tokenizer (pass one to the Engine) or use stop_token_ids")
        self.params, self.tokenizer = params, tokenizer
        self.eos = frozenset() if params.ignore_eos else eos
        self.limit = min(params.max_tokens, room)
        self._tail = _TOKENS_PER_CHAR * (max((len(s) for s in params.stop), default=0) + 1)
        self.cut: int | None = None
        """Where the text is cut (a stop string's start), or None."""

    def check(self, tokens: list[int]) -> tuple[str | None, int]:
        """``(finish_reason or None, ids to drop from the end)`` after ``tokens[-1]`` was appended."""
        if tokens[-1] in self.eos:
            return FINISH_STOP, 1
        for stop in self.params.stop_token_ids:
            if len(tokens) >= len(stop) and tuple(tokens[-len(stop):]) == stop:
                return FINISH_STOP, len(stop)
        if self.params.stop and self._stop_string_in(tokens):
            return FINISH_STOP, 0
        if len(tokens) >= self.limit:
            return FINISH_LENGTH, 0
        return None, 0

    def _stop_string_in(self, tokens: list[int]) -> bool:
        tail = self.tokenizer.decode(tokens[-self._tail:], skip_special_tokens=True)
        if not any(stop in tail for stop in self.params.stop):
            return False
        text = self.decode(tokens)
        found = [i for i in (text.find(stop) for stop in self.params.stop) if i >= 0]
        self.cut = min(found) if found else None
        return self.cut is not None

    def decode(self, tokens: list[int]) -> str:
        """The completion's text: ``tokens`` decoded without special tokens, cut at a stop string."""
        if self.tokenizer is None:
            return ""
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        return text if self.cut is None else text[: self.cut]
