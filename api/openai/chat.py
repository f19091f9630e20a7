"""``/openai/v1/chat/completions`` and ``/openai/v1/completions``: a request for a model the caller
may read (a base under the model root, or an ``ft:`` name as ``/models`` lists it) is answered by a
chat session serving it (``core.sessions``), started when none is live; streaming (Server-Sent
Events in OpenAI's chunk format, ``data: [DONE]``) or whole.

While a new session loads, the request waits up to ``FTQ_SESSION_START_WAIT_S``; past it, a 503
``session_starting`` with ``Retry-After`` (the session keeps loading, the retry finds it). Bad input
is a 400 naming the param; an unknown model, or another project's, a 404 ``model_not_found``; a
prompt + max_tokens beyond the session's context a 400 ``context_length_exceeded``. Prompts and
outputs are never logged.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from anyio import to_thread
from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response, StreamingResponse

from api.auth import CallerDep
from api.deps import StateDep
from api.jobs.submit import enqueue
from api.openai.chat_schemas import ChatCompletionCreate, CompletionCreate
from api.openai.chat_shapes import Answer, sse
from api.openai.errors import openai_error
from api.state import AppState
from core.sessions import calls
from core.users.service import Caller

router = APIRouter(tags=["openai chat"])


@router.post("/chat/completions", summary="chat.completions.create: the next assistant turn, streamed or whole")
async def create_chat_completion(body: ChatCompletionCreate, state: StateDep, caller: CallerDep) -> Response:
    payload = {"messages": body.messages, "params": body.sampling()}
    return await _answer(state, caller, body.model, payload, chat=True, stream=bool(body.stream),
                         include_usage=bool(body.stream_options and body.stream_options.include_usage))


@router.post("/completions", summary="completions.create: a prompt continued, streamed or whole")
async def create_completion(body: CompletionCreate, state: StateDep, caller: CallerDep) -> Response:
    payload = {"prompt": body.text(), "params": body.sampling()}
    return await _answer(state, caller, body.model, payload, chat=False, stream=bool(body.stream),
                         include_usage=bool(body.stream_options and body.stream_options.include_usage))


async def _answer(state: AppState, caller: Caller, model: str, payload: dict[str, Any], *, chat: bool,
                  stream: bool, include_usage: bool) -> Response:
    n = int(payload["params"]["n"])
    try:
        call = await to_thread.run_sync(calls.begin, state.sessions, caller, model, payload, n, state.settings,
                                        partial(enqueue, state))
    except calls.SessionStarting as exc:
        refusal = openai_error(503, exc.message, type_="server_error", param=exc.param, code=exc.code)
        refusal.headers["retry-after"] = str(exc.retry_after_s)
        return refusal
    answer = Answer(call.request_id, model, chat, call.prompt_tokens, n)
    deltas = calls.deltas(state.sessions, call, state.settings)
    if stream:
        return StreamingResponse(sse(answer, deltas, include_usage), media_type="text/event-stream",
                                 headers={"cache-control": "no-cache", "x-accel-buffering": "no"})

    def collect() -> dict[str, Any]:
        for delta in deltas:
            answer.add(delta)
        return answer.whole()

    return JSONResponse(await to_thread.run_sync(collect))
