"""``/openai/v1/fine_tuning/alpha/graders``: ``validate`` and ``run``, as the ``openai`` client's
``client.fine_tuning.alpha.graders`` sends them and parses the answers (``GraderValidateResponse``,
``GraderRunResponse``). The graders are ``trainer.graders``; ``core.graders.service`` says what
runs here (every grader but the model graders; a python grader in its sandboxed process, off the
event loop).
"""

from __future__ import annotations

from typing import Any

from anyio import to_thread
from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field

from api.auth import CallerDep
from api.deps import SettingsDep
from core.graders import service
from trainer.graders import GradeResult

MAX_SAMPLE_CHARS = 100_000
"""The longest ``model_sample``: a similarity metric over two such texts takes about a second."""

router = APIRouter(prefix="/fine_tuning/alpha/graders", tags=["openai graders"])


class GraderValidate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    grader: dict[str, Any]


class GraderRun(BaseModel):
    model_config = ConfigDict(extra="forbid")
    grader: dict[str, Any]
    model_sample: str = Field(max_length=MAX_SAMPLE_CHARS)
    item: Any = None


@router.post("/validate", summary="fine_tuning.alpha.graders.validate")
def validate_grader(body: GraderValidate, caller: CallerDep) -> dict[str, Any]:  # caller: a key of a project
    return {"grader": service.check(body.grader)}


@router.post("/run", summary="fine_tuning.alpha.graders.run")
async def run_grader(body: GraderRun, settings: SettingsDep, caller: CallerDep) -> dict[str, Any]:
    grader, result = await to_thread.run_sync(service.run, body.grader, body.model_sample, body.item, settings)
    return run_response(grader, result)


def run_response(grader: dict[str, Any], result: GradeResult) -> dict[str, Any]:
    """OpenAI's ``GraderRunResponse``: the reward, each grader's score and the error flags."""
    errors: dict[str, Any] = dict(result.errors)
    errors["python_grader_runtime_error_details"] = result.error if result.errors["python_grader_runtime_error"] else None
    errors["python_grader_server_error_type"] = result.error_type if result.errors["python_grader_server_error"] else None
    errors["model_grader_server_error_details"] = None
    scores = {grader["name"]: result.score, **result.sub_scores}
    return {
        "reward": result.score,
        "metadata": {"name": grader["name"], "type": grader["type"], "errors": errors,
                     "execution_time": result.seconds, "scores": scores, "token_usage": None,
                     "sampled_model_name": None, "error": result.error, "log": result.log},
        "sub_rewards": result.sub_scores,
        "model_grader_token_usage_per_model": {},
    }
