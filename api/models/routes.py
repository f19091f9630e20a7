"""``GET /v1/models``: the local models under the box's model root, for the dashboard's picker
and ``ftq models``, each with whether it fits the live workers' GPUs for LoRA and full fine-tuning."""

from __future__ import annotations

from fastapi import APIRouter

from api.deps import SessionDep, SettingsDep
from api.models.fit import METHODS, fit, live_gpu_hosts, shape_of
from api.models.schemas import ModelList, ModelOut
from core.jobs.model_catalog import find_models

router = APIRouter(prefix="/v1/models", tags=["models"])


@router.get("", summary="Local models under FTQ_MODEL_ROOT (directories holding config.json), and whether they fit the GPUs")
def list_models(settings: SettingsDep, session: SessionDep) -> ModelList:
    """Walks the model root on each call (it changes when someone pulls or copies a model in);
    a plain ``def``, so FastAPI runs it in a thread and a slow disk does not stall the event loop."""
    hosts = live_gpu_hosts(session, settings.heartbeat_timeout_s)
    out = []
    for model in find_models(settings.model_root):
        shape = shape_of(model.config, model.params)
        out.append(ModelOut.of(model, {method: fit(shape, hosts, method) for method in METHODS}))
    return ModelList(data=out, model_root=str(settings.model_root))
