"""The workers' routers: admins' ``/v1/workers/keys`` and the workers' own ``/v1/worker/``."""

from __future__ import annotations

from fastapi import APIRouter

from api.workers.artifacts import router as artifacts_router
from api.workers.keys import router as keys_router

router = APIRouter()
router.include_router(keys_router)
router.include_router(artifacts_router)
