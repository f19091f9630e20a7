"""The OpenAI-compatible fine-tuning API, mounted at ``/openai/v1`` by ``api.app.create_app``.

A sub-application, so that its errors take OpenAI's shape (``api.openai.errors``) while the
native ``/v1`` API keeps its own. It shares the parent's lifespan state (store, Celery, Redis)
through the request scope; its key is the ftq API key sent as OpenAI's (``Authorization:
Bearer``), checked by the parent's ``AuthGate`` before anything here runs, and again by
``authenticate`` (which reuses that verdict) for the routes that need the caller.
"""

from __future__ import annotations

from fastapi import Depends, FastAPI

from api.auth import authenticate, authenticate_openai
from api.docs_ui import add_docs_pages
from api.inputs import check_request_text
from api.openai.chat import router as chat_router
from api.evals.routes import router as evals_router
from api.openai.errors import add_openai_exception_handlers
from api.openai.files import router as files_router
from api.openai.graders import router as graders_router
from api.openai.jobs import router as jobs_router
from api.openai.models import router as models_router

PREFIX = "/openai/v1"


def create_openai_app() -> FastAPI:
    app = FastAPI(
        title="ftq: OpenAI-compatible fine-tuning",
        summary="files, fine_tuning.jobs and models as the official openai client calls them",
        version="0.1.0",
        dependencies=[Depends(authenticate), Depends(check_request_text)],  # the parent's do not reach a mount
        docs_url=None,  # its /docs and /redoc: api/docs_ui.py, assets from the parent's /static/docs
        redoc_url=None,
    )
    app.dependency_overrides[authenticate] = authenticate_openai  # OpenAI-Project picks the project
    add_docs_pages(app)
    add_openai_exception_handlers(app)
    app.include_router(files_router)
    app.include_router(jobs_router)
    app.include_router(graders_router)
    app.include_router(models_router)
    app.include_router(chat_router)
    app.include_router(evals_router)
    return app
