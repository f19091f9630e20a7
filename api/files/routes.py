"""``/v1/files``: upload, list, read and delete datasets.

Every file belongs to its uploader and to a project. A project's members see its files'
descriptions (with ``owner``), others get 404 as for an unknown id; only the owner, an admin of its
project or a global admin deletes one, and a job may train only on its submitter's files of its own project
(``core.users.access``).
"""

from __future__ import annotations

from typing import Annotated, Any

from anyio import to_thread
from fastapi import APIRouter, Query, Request, status

from api.auth import CallerDep
from api.deps import SessionDep, StateDep
from api.files.schemas import FileDeleted, FileList, FileOut
from api.files.tokens import router as tokens_router
from api.files.upload import receive_upload
from core.errors import InvalidInput
from core.files import service
from core.paging import MAX_LIMIT
from core.projects.service import names_by_id as project_names
from core.users import access
from core.users.service import names_by_id

router = APIRouter(prefix="/v1/files", tags=["files"])

_UPLOAD_BODY: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["file", "purpose"],
                    "properties": {
                        "file": {"type": "string", "format": "binary", "description": "JSONL dataset"},
                        "purpose": {"type": "string", "enum": list(service.PURPOSES)},
                        "project": {"type": "string", "description": "The project (name) it goes to; you "
                                    "must be a member. Default: your key's or your own default project"},
                        "format": {"type": "string", "enum": list(service.UPLOAD_LAYOUTS), "default": "auto",
                                   "description": "auto: ftq's formats as they are, ShareGPT and Alpaca detected "
                                   "and converted to chat; sharegpt / alpaca: convert, refusing a record "
                                   "that is not one; prompts: a GRPO training file of prompts (chat or "
                                   "{\"prompt\": ...}, other keys read by the graders as item.*)"},
                    },
                }
            }
        },
    }
}


@router.post(
    "",
    status_code=status.HTTP_201_CREATED,
    openapi_extra=_UPLOAD_BODY,
    summary="Upload a dataset (JSONL: chat messages, prompt/completion, or text)",
)
async def upload_file(request: Request, state: StateDep, caller: CallerDep) -> FileOut:
    """Stream the upload to disk, validate every line, and keep it only if all are good.

    Errors: 413 over FTQ_MAX_UPLOAD_BYTES; 422 naming the first bad line (``error.line``).
    """
    settings = state.settings
    sink = await to_thread.run_sync(service.FileSink, settings.files_dir, settings.max_upload_bytes)
    with sink:
        form = await receive_upload(request, sink)
        purpose = form.fields.get("purpose")
        if purpose is None:
            raise InvalidInput("purpose: required; send purpose=train or purpose=validation", param="purpose")

        def store() -> FileOut:
            with state.sessions() as session:
                project_id = access.project_for_create(session, caller, form.fields.get("project"))
                row = service.store_upload(
                    session,
                    sink,
                    filename=form.filename or "",
                    purpose=purpose,
                    files_dir=settings.files_dir,
                    owner_id=caller.user_id,
                    layout=form.fields.get("format") or "auto",
                    project_id=project_id,
                )
                return _out(session, row, caller.name)

        return await to_thread.run_sync(store)


@router.get("", summary="List datasets, newest first")
def list_files(
    session: SessionDep,
    caller: CallerDep,
    purpose: str | None = None,
    owner: Annotated[str | None, Query(description="Only this user's files; `me` for the caller's")] = None,
    project: Annotated[str | None, Query(description="Only this project's files (one of yours)")] = None,
    limit: Annotated[int, Query(ge=1, le=MAX_LIMIT)] = 50,
    after: str | None = None,
) -> FileList:
    """The files of the caller's projects (a global admin: all), newest first."""
    owner_id = access.owner_filter(session, caller, owner)
    rows, next_cursor = service.list_files(session, purpose=purpose, owner_id=owner_id, limit=limit, after=after,
                                           reader=caller, project_id=access.project_filter(session, caller, project))
    names = names_by_id(session, {r.owner_id for r in rows})
    projects = project_names(session, {r.project_id for r in rows})
    return FileList(data=[FileOut.of(r, owner=names.get(r.owner_id or ""), project=projects.get(r.project_id or ""))
                          for r in rows], next_cursor=next_cursor)


@router.get("/{file_id}", summary="Describe one dataset")
def get_file(file_id: str, session: SessionDep, caller: CallerDep) -> FileOut:
    row = service.get_file(session, file_id, reader=caller)
    return _out(session, row, access.owner_name(session, row.owner_id))


def _out(session: SessionDep, row: service.File, owner: str | None) -> FileOut:
    return FileOut.of(row, owner=owner, project=project_names(session, {row.project_id}).get(row.project_id or ""))


@router.delete(
    "/{file_id}",
    summary="Delete a dataset (the owner, an admin of its project or an admin; 409 while a queued or running job uses it)",
)
def delete_file(file_id: str, session: SessionDep, caller: CallerDep) -> FileDeleted:
    row = service.get_file(session, file_id, reader=caller)
    access.require_owner(session, caller, row.owner_id, what=f"file {file_id}", action="delete", param="file_id",
                         project_id=row.project_id)
    row = service.delete_file(session, file_id, reader=caller)
    return FileDeleted(id=row.file_id)

# Token statistics live in their own module (they need a model's tokenizer).
router.include_router(tokens_router)
