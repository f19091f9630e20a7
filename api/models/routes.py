"""``GET /v1/models``: the local models under the box's model root, for the dashboard's picker."""

from __future__ import annotations

from anyio import to_thread
from fastapi import APIRouter

from api.deps import SettingsDep
from api.models.catalog import find_models
from api.models.schemas import ModelList, ModelOut

router = APIRouter(prefix="/v1/models", tags=["models"])


@router.get("", summary="Local models under FTQ_MODEL_ROOT (directories holding config.json)")
async def list_models(settings: SettingsDep) -> ModelList:
    """Walks the model root on each call (it changes when someone copies a model in), in a
    thread so a slow disk does not stall the event loop."""
    models = await to_thread.run_sync(find_models, settings.model_root)
    return ModelList(data=[ModelOut.of(m) for m in models], model_root=str(settings.model_root))
