from __future__ import annotations

from typing import Literal

from pydantic import BaseModel

from api.models.catalog import LocalModel


class ModelOut(BaseModel):
    id: str
    """The path under the model root: pass it as ``model`` in ``POST /v1/jobs``."""
    object: Literal["model"] = "model"
    model_type: str | None
    architectures: list[str]
    bytes: int
    params: int | None
    """Counted from the safetensors headers; null when the weights are not safetensors."""
    error: str | None
    """Set when config.json or a weights header could not be read: the model may fail to load."""

    @classmethod
    def of(cls, model: LocalModel) -> ModelOut:
        return cls(
            id=model.name,
            model_type=model.model_type,
            architectures=list(model.architectures),
            bytes=model.bytes,
            params=model.params,
            error=model.error,
        )


class ModelList(BaseModel):
    data: list[ModelOut]
    model_root: str
    """The directory searched (FTQ_MODEL_ROOT), so an empty list says where to put models."""
