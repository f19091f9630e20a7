"""The body of ``POST /v1/sessions``: a chat session, validated at the door (``core.jobs.spec``'s rules:
unknown fields refused, strict types, each bound says what to change)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from core.jobs.generate_spec import EXPORT_REF, JOB_REF
from core.jobs.spec import Priority

KIND = "session"
MAX_MODELS = 8


class SessionSpec(BaseModel):
    """A session holds one GPU of a worker for a base and the adapters it serves."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    kind: Literal["session"] = "session"
    name: Annotated[str | None, Field(min_length=1, max_length=200, description="A label for people.")] = None
    project: Annotated[str | None, Field(
        min_length=1, max_length=64, exclude=True,
        description="The project (name) the session belongs to; default: your key's or your own.")] = None
    models: Annotated[list[Annotated[str, Field(min_length=1, max_length=512)]], Field(
        min_length=1, max_length=MAX_MODELS,
        description="What it serves, all of one base: a base (a directory under FTQ_MODEL_ROOT), job:<id> (a "
        "job's final adapter or model), job:<id>@<step> (a checkpoint's adapter) or export:<id>.")]
    priority: Annotated[Priority, Field(description="Queue order, as a job's.")] = "normal"
    idle_timeout_s: Annotated[float | None, Field(
        gt=0, le=7 * 86_400, description="Ends by itself after this long without a request; default "
        "FTQ_SESSION_IDLE_TIMEOUT_S.")] = None

    @field_validator("models")
    @classmethod
    def _check_models(cls, models: list[str]) -> list[str]:
        for model in models:
            if model.startswith("job:") and not JOB_REF.match(model):
                raise ValueError(f"{model!r}: write job:<job id> or job:<job id>@<step>, e.g. job:job-1a2b@40")
            if model.startswith("export:") and not EXPORT_REF.match(model):
                raise ValueError(f"{model!r}: write export:<export id>")
        if len(set(models)) != len(models):
            raise ValueError("name each model once")
        return models

    def to_stored(self) -> dict:
        return self.model_dump(mode="json")
