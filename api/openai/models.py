"""``/openai/v1/models``: ``models.list`` and ``models.retrieve`` over ``core.openai.catalog``: the
bases under the model root and the tuned models (jobs and checkpoints, by the ``ft:`` names the job
and checkpoint objects show) of the jobs the caller reads. An unknown name, or one of someone
else's jobs, is a 404 in OpenAI's shape (``param: model``)."""

from __future__ import annotations

from fastapi import APIRouter

from api.auth import CallerDep
from api.deps import SessionDep, SettingsDep
from api.openai.schemas import Model, ModelList
from core.openai import catalog

router = APIRouter(prefix="/models", tags=["openai models"])


@router.get("", summary="models.list: the bases, then your tuned models and their checkpoints")
def list_models(session: SessionDep, settings: SettingsDep, caller: CallerDep) -> ModelList:
    found = catalog.list_models(session, caller, settings.model_root)
    return ModelList(data=[Model(id=m.id, created=m.created, owned_by=m.owned_by) for m in found])


@router.get("/{model:path}", summary="models.retrieve: a base, ft:<...>:<job id> or ft:<...>:ckpt-step-<step>")
def retrieve_model(model: str, session: SessionDep, settings: SettingsDep, caller: CallerDep) -> Model:
    found = catalog.get_model(session, caller, model, settings.model_root)
    return Model(id=found.id, created=found.created, owned_by=found.owned_by)
