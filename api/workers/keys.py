"""``/v1/workers/keys``: the keys workers on other machines use (admin only).

A new key is in the response once and never again: the store keeps only its hash. Revoking is
idempotent and takes effect at once: the key's transfers get 401 and its workers claim nothing.
"""

from __future__ import annotations

from fastapi import APIRouter, status

from api.auth import AdminDep
from api.deps import SessionDep
from api.workers.schemas import WorkerKeyCreate, WorkerKeyCreated, WorkerKeyList, WorkerKeyOut
from core.workers import keys

router = APIRouter(prefix="/v1/workers/keys", tags=["workers"])


@router.post("", status_code=status.HTTP_201_CREATED, summary="Make a worker key (admin); shown once")
def create_key(body: WorkerKeyCreate, admin: AdminDep, session: SessionDep) -> WorkerKeyCreated:
    row, raw = keys.create_worker_key(session, body.name, created_by=admin.user_id)
    session.commit()
    return WorkerKeyCreated(id=row.worker_key_id, name=row.name, prefix=row.prefix, key=raw,
                            created_at=row.created_at)


@router.get("", summary="Worker keys (admin): no secrets; when last used, the workers using each")
def list_keys(_admin: AdminDep, session: SessionDep) -> WorkerKeyList:
    rows = keys.list_worker_keys(session)
    workers = keys.workers_by_key(session, {r.worker_key_id for r in rows})
    return WorkerKeyList(data=[WorkerKeyOut.of(r, workers.get(r.worker_key_id)) for r in rows])


@router.delete("/{name}", summary="Revoke a worker key by name or prefix (admin); idempotent")
def revoke_key(name: str, _admin: AdminDep, session: SessionDep) -> WorkerKeyOut:
    row = keys.revoke_worker_key(session, name)
    session.commit()
    workers = keys.workers_by_key(session, {row.worker_key_id})
    return WorkerKeyOut.of(row, workers.get(row.worker_key_id))
