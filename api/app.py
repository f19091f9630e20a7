"""The FastAPI application: ``create_app(settings)`` and the lifespan that owns its resources.

Nothing is opened at import. The lifespan builds the store engine and sessionmaker, the Celery
app used only to send ``jobs.run`` (core.queue), a Redis client when ``FTQ_REDIS_URL`` is set
(live SSE wake-ups) and the ``TokenizerPool`` behind the token statistics (worker processes,
started on first use); it hands them to requests as one typed ``AppState`` and closes them at
shutdown. It also removes what a crash or a finished job left on disk (upload temporaries,
download archives, unrecorded uploads) and starts the thread that keeps sweeping the latter
(``api.workers.sweeper``). Serve with ``uvicorn --factory api.app:create_app`` or ``ftq api``.
"""

from __future__ import annotations

import logging
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from anyio import to_thread
from fastapi import Depends, FastAPI
from sqlalchemy import Engine
from sqlalchemy.exc import OperationalError

from api.auth import AuthGate, declare_schemes
from api.auth_throttle import FailedKeyThrottle
from api.docs_ui import add_docs_pages, mount_docs_assets
from api.errors import add_exception_handlers
from api.files.routes import router as files_router
from api.files.tokenizer_pool import TokenizerPool
from api.inputs import BoundedJsonBodies, check_request_text
from api.jobs.completions import router as completions_router
from api.jobs.rollouts import router as rollouts_router
from api.jobs.routes import router as jobs_router
from api.evals.routes import jobs_router as job_evals_router
from api.evals.routes import router as evals_router
from api.projects.routes import router as projects_router
from api.queue.routes import router as queue_router
from api.models.routes import router as models_router
from api.jobs.wakeups import Wakeups
from api.openai.app import PREFIX as OPENAI_PREFIX
from api.openai.app import create_openai_app
from api.responses import sweep_temporaries
from api.state import AppState
from api.sessions.routes import router as sessions_router
from api.system.routes import router as system_router
from api.users.routes import router as users_router
from api.web.routes import router as web_router
from api.workers.routes import router as workers_router
from api.workers.sweeper import UploadSweeper
from core.db import dispose_engine, make_engine, make_sessionmaker
from core.jobs import artifact_store
from core.migrate import schema_problem
from core.queue import make_celery
from core.settings import Settings

log = logging.getLogger(__name__)


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = (settings or Settings()).resolved()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[dict[str, AppState]]:
        settings.files_dir.mkdir(parents=True, exist_ok=True)
        settings.jobs_dir.mkdir(parents=True, exist_ok=True)
        engine = make_engine(settings.database_url)  # type: ignore[arg-type]
        _refuse_unmigrated_store(engine)
        await to_thread.run_sync(artifact_store.sweep_incoming, settings)  # uploads a crash cut off
        await to_thread.run_sync(sweep_temporaries, settings)  # download archives a crash left
        celery = make_celery(settings)
        redis = None
        if settings.redis_url:
            from redis.asyncio import Redis

            redis = Redis.from_url(settings.redis_url)
        tokenizers = TokenizerPool(settings.tokenizer_workers, settings.tokenizer_budget_s)
        if settings.tokenizer_prestart:
            tokenizers.prestart()
        sessions = make_sessionmaker(engine)
        sweeper = UploadSweeper(sessions, settings)  # what finished jobs' uploads left
        await to_thread.run_sync(sweeper.sweep_all)
        sweeper.start()
        wakeups = Wakeups(sessions, settings, celery)
        state = AppState(settings, engine, sessions, celery, redis, tokenizers, wakeups=wakeups)
        try:
            yield {"ftq": state}
        finally:
            await to_thread.run_sync(sweeper.close)
            await to_thread.run_sync(wakeups.close)  # sends what submissions noted
            await to_thread.run_sync(tokenizers.shutdown)  # idle processes end; a running one with its request
            if redis is not None:
                await redis.aclose()
            celery.close()
            dispose_engine(engine)  # a request thread uvicorn cancelled may still hold one

    app = FastAPI(
        title="ftq",
        summary="Fine-tuning jobs on a shared GPU box",
        version="0.1.0",
        lifespan=lifespan,
        docs_url=None,  # /docs and /redoc come from api/docs_ui.py, with assets served here (no CDN)
        redoc_url=None,
        # declare_schemes documents the key (AuthGate checks it); check_request_text: api/inputs.py
        dependencies=[Depends(declare_schemes), Depends(check_request_text)],
    )
    add_exception_handlers(app)
    app.add_middleware(BoundedJsonBodies)  # JSON depth, before any parser; inside the auth gate (api/inputs.py)
    # Every path but a few open ones needs a key, whatever route serves it (api/auth.py).
    app.add_middleware(AuthGate, throttle=FailedKeyThrottle(settings.auth_failure_limit))
    mount_docs_assets(app)  # before web_router's /static mount, which would answer 404 for these
    add_docs_pages(app)
    app.include_router(files_router)
    app.include_router(completions_router)
    app.include_router(rollouts_router)
    app.include_router(jobs_router)
    app.include_router(queue_router)
    app.include_router(system_router)
    app.include_router(models_router)
    app.include_router(users_router)
    app.include_router(projects_router)
    app.include_router(evals_router, prefix="/v1")
    app.include_router(job_evals_router)
    app.include_router(workers_router)
    app.include_router(sessions_router)
    app.include_router(web_router)
    app.mount(OPENAI_PREFIX, create_openai_app())  # the official openai client's API (api/openai)
    # A Mount matches the rest of the path with ``.*``, which stops at a newline: an OpenAI path id
    # holding %0A matched no route (a 404); DOTALL carries it to the route, whose check names it.
    openai_mount = app.routes[-1]
    openai_mount.path_regex = re.compile(openai_mount.path_regex.pattern, re.DOTALL)  # type: ignore[attr-defined]
    return app


def _refuse_unmigrated_store(engine: Engine) -> None:
    """Fail start-up on a reachable store whose schema is not at this code's head revision.

    An unreachable store is only logged: the API still starts and ``/readyz`` reports it.
    """
    try:
        problem = schema_problem(engine)
    except OperationalError as exc:
        log.warning("the store is unreachable at start-up (%s); /readyz will report it", exc.orig)
        return
    if problem is not None:
        engine.dispose()
        raise RuntimeError(problem)
