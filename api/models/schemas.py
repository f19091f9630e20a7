from __future__ import annotations

from typing import Literal

from pydantic import BaseModel

from api.models.fit import Fit
from core.jobs.model_catalog import LocalModel


class FitOut(BaseModel):
    fits: bool | None
    """null: unknown (no live worker has a GPU, or config.json lacks a size the estimate needs)."""
    gpus: int | None
    """The fewest GPUs of one live worker host it trains on; null when it does not fit."""
    peak_bytes: int | None
    """Estimated peak GPU memory per GPU (``trainer.plan.memory``) at the job defaults."""
    reason: str
    """The estimate against the host's GPU memory, or why there is none."""

    @classmethod
    def of(cls, fit: Fit) -> FitOut:
        return cls(fits=fit.fits, gpus=fit.gpus, peak_bytes=fit.peak_bytes, reason=fit.reason)


class ModelFitOut(BaseModel):
    """Whether the model trains on this box's live GPUs (``api.models.fit``), per method."""

    lora: FitOut
    full: FitOut


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
    fit: ModelFitOut

    @classmethod
    def of(cls, model: LocalModel, fits: dict[str, Fit]) -> ModelOut:
        return cls(
            id=model.name,
            model_type=model.model_type,
            architectures=list(model.architectures),
            bytes=model.bytes,
            params=model.params,
            error=model.error,
            fit=ModelFitOut(lora=FitOut.of(fits["lora"]), full=FitOut.of(fits["full"])),
        )


class ModelList(BaseModel):
    data: list[ModelOut]
    model_root: str
    """The directory searched (FTQ_MODEL_ROOT), so an empty list says where to put models."""
