"""Request bodies of ``/openai/v1/chat/completions`` and ``/completions`` (OpenAI's parameters, the
subset a session runs), and the sampling parameters they become.

A field OpenAI defines that ftq does not run (tools, response_format, logit_bias, penalties other than
0, ``echo``, ``suffix``, ``best_of`` above n) is a 400 naming it, never silently ignored; a field
OpenAI does not define is refused as OpenAI refuses it ("Unrecognized request argument").
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from core.errors import InvalidInput
from core.jobs.generate_spec import MAX_NEW_TOKENS

Stop = str | Annotated[list[Annotated[str, Field(min_length=1, max_length=200)]], Field(max_length=4)] | None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: Annotated[str, Field(min_length=1, max_length=1024)]
    temperature: Annotated[float | None, Field(ge=0.0, le=2.0)] = None
    top_p: Annotated[float | None, Field(gt=0.0, le=1.0)] = None
    n: Annotated[int | None, Field(ge=1, le=16)] = None
    stop: Stop = None
    seed: Annotated[int | None, Field(ge=0, le=2**63 - 1)] = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    max_tokens: Annotated[int | None, Field(ge=1, le=MAX_NEW_TOKENS)] = None
    presence_penalty: Annotated[float | None, Field(ge=-2.0, le=2.0)] = None
    frequency_penalty: Annotated[float | None, Field(ge=-2.0, le=2.0)] = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    def _refuse_unsupported(self, names: tuple[str, ...]) -> None:
        for name in names:
            value = getattr(self, name, None)
            if value not in (None, 0, 0.0, {}, [], False):
                raise InvalidInput(f"'{name}' is not supported by ftq's sessions; remove it", param=name)

    def params(self, max_tokens: int | None, logprobs: bool, top_logprobs: int) -> dict[str, Any]:
        """``trainer.generate.params.SamplingParams``' fields (OpenAI's defaults where unset: temperature 1,
        top_p 1, n 1, max_tokens 16 for a completion; a chat's: the room left in the session's context,
        at most ``trainer.generate.session.DEFAULT_MAX_TOKENS``)."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        out: dict[str, Any] = {"temperature": 1.0 if self.temperature is None else self.temperature,
                               "top_p": 1.0 if self.top_p is None else self.top_p, "n": self.n or 1,
                               "stop": stop, "seed": self.seed, "logprobs": logprobs, "top_logprobs": top_logprobs}
        if max_tokens is not None:
            out["max_tokens"] = max_tokens
        return out


class ChatCompletionCreate(_Sampling):
    messages: Annotated[list[dict[str, Any]], Field(min_length=1, max_length=10_000)]
    max_completion_tokens: Annotated[int | None, Field(ge=1, le=MAX_NEW_TOKENS)] = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int | None, Field(ge=0, le=20)] = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None

    @field_validator("top_logprobs")
    @classmethod
    def _check_top_logprobs(cls, top: int | None, info: ValidationInfo) -> int | None:
        if top and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return top

    def sampling(self) -> dict[str, Any]:
        self._refuse_unsupported(("tools", "response_format", "logit_bias", "presence_penalty", "frequency_penalty"))
        for i, message in enumerate(self.messages):
            if not isinstance(message.get("role"), str):
                raise InvalidInput(f"messages[{i}]: a message needs a role", param=f"messages.{i}.role")
        max_tokens = self.max_completion_tokens or self.max_tokens  # None: the room left in the context
        return self.params(max_tokens, bool(self.logprobs), self.top_logprobs or 0)


class CompletionCreate(_Sampling):
    prompt: str | Annotated[list[str], Field(min_length=1, max_length=1)]
    logprobs: Annotated[int | None, Field(ge=0, le=5)] = None
    echo: bool | None = False
    suffix: str | None = None
    best_of: Annotated[int | None, Field(ge=1, le=16)] = None

    def text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]

    def sampling(self) -> dict[str, Any]:
        self._refuse_unsupported(("echo", "suffix", "logit_bias", "presence_penalty", "frequency_penalty"))
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise InvalidInput("'best_of' other than n is not supported; remove it", param="best_of")
        wanted = self.logprobs is not None
        return self.params(self.max_tokens or 16, wanted, self.logprobs or 0)
