"""What a generation request asks for and what it gets back (plain values, no torch).

``SamplingParams`` follows the OpenAI completion parameters (``temperature``, ``top_p``, ``n``,
``max_tokens``, ``stop``, ``seed``, ``logprobs`` / ``top_logprobs``) plus vLLM's ``top_k``,
``stop_token_ids`` and ``ignore_eos``; ``Request`` is one tokenized prompt with its parameters;
``Result`` holds its ``n`` ``Completion``\\ s. ``trainer.generate.engine.Engine`` turns requests
into results.

Seeds: choice ``i`` of a request draws from its own ``torch.Generator`` seeded with
``choice_seed(seed, i)`` (choice 0 with ``seed`` itself), so a seeded completion does not depend on
which other sequences share its batch, or on how many slots the engine has.
"""

from __future__ import annotations

from dataclasses import dataclass, field

FINISH_STOP, FINISH_LENGTH = "stop", "length"
"""``finish_reason``: an eos token or a stop sequence ended it; ``max_tokens`` or the cache's
``max_len`` cut it."""

BASE_ADAPTER = "__base__"
"""``Request.adapter`` for the base model alone (peft's name for it in mixed batches)."""

_SEED_STRIDE = 0x9E3779B97F4A7C15  # the golden-ratio increment: choices of nearby seeds do not collide


def choice_seed(seed: int, index: int) -> int:
    """The generator seed of choice ``index`` of a request seeded with ``seed``."""
    return (seed + index * _SEED_STRIDE) % 2**63


@dataclass(frozen=True)
class SamplingParams:
    """How to continue one prompt."""

    max_tokens: int = 16
    """New tokens at most; the eos token that ends a completion is not counted or returned."""
    temperature: float = 1.0
    """Divides the logits before top-k / top-p; 0 is greedy (argmax of the raw logits)."""
    top_p: float = 1.0
    """Nucleus: sample among the most likely tokens whose probabilities (after temperature and
    top-k) add up to ``top_p``; the most likely token is always kept. 1 keeps all."""
    top_k: int = 0
    """Sample among the ``top_k`` most likely tokens; 0 keeps all (1 is greedy)."""
    stop: tuple[str, ...] = ()
    """Strings that end a completion; the text is cut before the first one (not returned)."""
    stop_token_ids: tuple[tuple[int, ...], ...] = ()
    """Token-id sequences that end a completion when the generated ids end with one (not returned)."""
    seed: int | None = None
    """The sampling seed (see the module docstring); None draws one from torch's global generator."""
    n: int = 1
    """Completions of this prompt; they share its prefill (one forward; the prompt's cache copied, or
    read in place with ``trainer.generate.cache.SharedPrompts``)."""
    logprobs: bool = False
    """Return each generated token's log-probability (of the raw model distribution)."""
    top_logprobs: int = 0
    """Also the ``top_logprobs`` most likely tokens at each position with their log-probabilities."""
    ignore_eos: bool = False
    """Keep generating past eos tokens (benchmarks); stop sequences still apply."""

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens: must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature: must be >= 0 (0 is greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k: must be >= 0 (0 keeps every token), got {self.top_k}")
        if self.n < 1:
            raise ValueError(f"n: must be >= 1, got {self.n}")
        if self.top_logprobs < 0:
            raise ValueError(f"top_logprobs: must be >= 0, got {self.top_logprobs}")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs=True")
        if any(not s for s in self.stop):
            raise ValueError("stop: an empty string would stop at once; remove it")
        if any(not ids for ids in self.stop_token_ids):
            raise ValueError("stop_token_ids: an empty sequence would stop at once; remove it")

    @property
    def greedy(self) -> bool:
        """Whether the next token is the argmax of the logits (temperature 0 or top_k 1)."""
        return self.temperature == 0 or self.top_k == 1


@dataclass(frozen=True)
class Request:
    """One tokenized prompt and how to continue it."""

    prompt_ids: tuple[int, ...]
    params: SamplingParams = field(default_factory=SamplingParams)
    adapter: str | None = None
    """The peft adapter to continue it with (``BASE_ADAPTER``: none); None: the model as it is
    (its active adapter). Naming one runs the whole call with several adapters in one batch
    (``trainer.generate.engine``)."""

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError("prompt_ids: a prompt needs at least one token (e.g. the bos token)")
        object.__setattr__(self, "prompt_ids", tuple(int(t) for t in self.prompt_ids))


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log-probability under the raw model distribution (no temperature,
    top-k or top-p), as OpenAI's and vLLM's ``logprobs`` are."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    """The ``top_logprobs`` most likely ``(token_id, logprob)`` pairs, most likely first."""


@dataclass
class Completion:
    """One choice of a request."""

    index: int
    token_ids: list[int]
    """The generated ids, without the eos token or the stop-id sequence that ended it."""
    text: str
    """``token_ids`` decoded (special tokens skipped), cut before a stop string; empty without a tokenizer."""
    finish_reason: str
    """``FINISH_STOP`` or ``FINISH_LENGTH``."""
    logprobs: list[TokenLogprob] | None = None
    """One per token of ``token_ids`` when the request asked for them."""


@dataclass
class Result:
    """A request's completions, in choice order."""

    prompt_tokens: int
    completions: list[Completion]
