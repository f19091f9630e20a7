"""``/v1/sessions``: chat sessions (docs/sessions.md). A session is a job of kind ``session`` holding
one GPU for a base and the adapters it serves; ``POST`` starts one (queued like a job), ``DELETE``
ends one (running requests drain first). ``/openai/v1/chat/completions`` starts them by itself."""

from __future__ import annotations

from anyio import to_thread
from fastapi import APIRouter, Response, status

from api.auth import CallerDep
from api.deps import SessionDep, StateDep
from api.jobs.submit import enqueue, notify
from api.sessions.schemas import SessionList, SessionOut
from core.jobs import service as jobs
from core.sessions import relay
from core.sessions.service import create_session, get_session, list_sessions
from core.sessions.spec import SessionSpec
from core.users import access

router = APIRouter(prefix="/v1/sessions", tags=["sessions"])


@router.post("", status_code=status.HTTP_201_CREATED, summary="Start a chat session for models of one base")
async def start_session(body: SessionSpec, state: StateDep, caller: CallerDep) -> SessionOut:
    def create() -> SessionOut:
        with state.sessions() as session:
            job = create_session(session, caller, body, settings=state.settings)
            session.commit()
            return SessionOut.of(job, ready=False)

    out = await to_thread.run_sync(create)
    await to_thread.run_sync(enqueue, state, out.id)
    return out


@router.get("", summary="Your project's sessions: live ones, or every one with all=true")
def list_all(session: SessionDep, caller: CallerDep, all: bool = False) -> SessionList:  # noqa: A002 - the query's name
    rows = list_sessions(session, caller, live_only=not all)
    return SessionList(data=[SessionOut.of(job, relay.is_ready(session, job.job_id) is not None) for job in rows])


@router.get("/{session_id}", summary="One session")
def get_one(session_id: str, session: SessionDep, caller: CallerDep) -> SessionOut:
    job = get_session(session, session_id, reader=caller)
    return SessionOut.of(job, relay.is_ready(session, job.job_id) is not None)


@router.delete("/{session_id}", summary="End a session: a queued one at once (200), a running one after its "
               "requests drain (202)")
async def end_session(session_id: str, response: Response, state: StateDep, caller: CallerDep) -> SessionOut:
    def cancel() -> tuple[SessionOut, bool, int]:
        with state.sessions() as session:
            row = get_session(session, session_id, reader=caller)
            access.require_owner(session, caller, row.owner_id, what=f"session {session_id}", action="end",
                                 param="session_id", project_id=row.project_id)
            job, finished_now = jobs.cancel_job(session, session_id)
            session.commit()
            return SessionOut.of(job, ready=False), finished_now, job.last_event_seq

    out, finished_now, seq = await to_thread.run_sync(cancel)
    if finished_now:
        await notify(state, session_id, seq)
    else:
        response.status_code = status.HTTP_202_ACCEPTED
    return out
