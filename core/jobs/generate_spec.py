"""The body of ``POST /v1/jobs`` with ``kind: generate``: a batch generation job, validated at the door.

As ``core.jobs.spec.JobSpec``: unknown fields are refused, types are strict, every bound says
what to change, and the 422 names the field (``sampling.top_p``). ``sampling`` holds
``trainer.generate.params.SamplingParams``' fields with the bounds OpenAI's API gives them;
``trainer.generate.job_config.SAMPLING_FIELDS`` is the list both follow (a test fails when they
part). Which models a ``model`` may name is ``core.jobs.generation``'s.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from core.jobs.spec import FILE_ID, Priority

KIND = "generate"
MAX_NEW_TOKENS = 32_768
"""The most new tokens a prompt may ask for (the model's context bounds it further at submission)."""
JOB_REF = re.compile(r"^job:(?P<job_id>job-[0-9a-f]{1,64})(?:@(?P<step>[0-9]{1,9}))?$")
EXPORT_REF = re.compile(r"^export:(?P<export_id>[a-z]{1,16}-[0-9a-f]{1,64})$")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class SamplingSpec(_Strict):
    """How every prompt is continued (``trainer.generate.params.SamplingParams``)."""

    max_tokens: Annotated[int, Field(ge=1, le=MAX_NEW_TOKENS, description="New tokens per completion at most.")] = 256
    temperature: Annotated[float, Field(ge=0.0, le=2.0, description="0 is greedy; higher is more random (<= 2).")] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0, description="Nucleus sampling mass, (0, 1]; 1 keeps all.")] = 1.0
    top_k: Annotated[int, Field(ge=0, le=1_000_000, description="Sample among the k most likely; 0 keeps all.")] = 0
    stop: Annotated[
        list[Annotated[str, Field(min_length=1, max_length=200)]],
        Field(max_length=8, description="Up to 8 strings that end a completion (cut before them)."),
    ] = []
    seed: Annotated[
        int | None, Field(ge=0, le=2**63 - 1, description="Seeds every prompt's draws: the same job, the same "
                          "file (resume included); null draws a seed per prompt.")
    ] = None
    n: Annotated[int, Field(ge=1, le=16, description="Completions per prompt (1-16).")] = 1
    logprobs: Annotated[bool, Field(description="Each generated token's log-probability in the output.")] = False
    top_logprobs: Annotated[
        int, Field(ge=0, le=20, description="Also the k most likely tokens at each position (0-20; needs logprobs).")
    ] = 0
    ignore_eos: Annotated[bool, Field(description="Keep generating past the end-of-sequence token.")] = False

    @field_validator("top_logprobs")
    @classmethod
    def _check_top_logprobs(cls, top: int, info: ValidationInfo) -> int:
        if top and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true; set it, or set top_logprobs to 0")
        return top


class GenerateSpec(_Strict):
    """A prompts file completed by a model: ``completions.jsonl`` in the job's output."""

    kind: Annotated[Literal["generate"], Field(description="generate: a batch generation job.")]
    name: Annotated[str | None, Field(min_length=1, max_length=200, description="A label for people.")] = None
    project: Annotated[str | None, Field(
        min_length=1, max_length=64, exclude=True,
        description="The project (name) the job belongs to; you must be a member. Default: your key's or your "
        "own default project.")] = None
    model: Annotated[str, Field(
        min_length=1, max_length=512,
        description="A base (hub id or a directory under FTQ_MODEL_ROOT, as a training job's model), "
        "job:<id> (that job's final adapter or model), job:<id>@<step> (one of its LoRA checkpoints) or "
        "export:<id> (a merged export).")]
    prompts_file: Annotated[str, Field(description="Id of an uploaded file with purpose=generate.")]
    sampling: SamplingSpec = SamplingSpec()
    chunk_prompts: Annotated[int, Field(ge=1, le=10_000, description="Prompts each rank generates and writes "
                                        "together: what a cancel or a lost worker redoes at most.")] = 32
    priority: Annotated[
        Priority, Field(description="Queue order: high before normal before low, oldest first within each.")
    ] = "normal"
    gpus: Annotated[int, Field(ge=1, le=64, description="GPUs of one worker host; the prompts are split over "
                                                        "them (one rank each, under torchrun).")] = 1

    @field_validator("prompts_file")
    @classmethod
    def _check_file_id(cls, value: str) -> str:
        if not FILE_ID.match(value):
            raise ValueError(f"{value!r} is not a file id; upload the prompts with POST /v1/files "
                             "(purpose=generate) and use the returned id (file-<24 hex>)")
        return value

    @field_validator("model")
    @classmethod
    def _check_model(cls, value: str) -> str:
        if value != value.strip() or "\x00" in value:
            raise ValueError("remove surrounding whitespace and control characters from the model name")
        if value.startswith("job:") and not JOB_REF.match(value):
            raise ValueError(f"{value!r}: write job:<job id> or job:<job id>@<step>, e.g. job:job-1a2b@40")
        if value.startswith("export:") and not EXPORT_REF.match(value):
            raise ValueError(f"{value!r}: write export:<export id>, e.g. export:exp-1a2b")
        return value

    @property
    def nodes(self) -> int:
        """Generation jobs run on one machine."""
        return 1

    def to_stored(self) -> dict:
        """The spec as stored on the job: JSON, every default filled in."""
        return self.model_dump(mode="json")


def is_generate(raw: object) -> bool:
    """Whether a request body (or a stored spec) is a generation job's."""
    return isinstance(raw, dict) and raw.get("kind") == KIND
