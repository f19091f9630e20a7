"""Request dependencies as ``Annotated`` aliases: ``SessionDep``, ``SettingsDep``, ``StateDep``."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy.orm import Session

from api.state import AppState
from core.settings import Settings


def get_state(request: Request) -> AppState:
    return request.state.ftq


def get_settings(request: Request) -> Settings:
    return request.state.ftq.settings


def get_session(request: Request) -> Iterator[Session]:
    """One session per request; routes commit what they change, the rest is rolled back."""
    with request.state.ftq.sessions() as session:
        yield session


StateDep = Annotated[AppState, Depends(get_state)]
SettingsDep = Annotated[Settings, Depends(get_settings)]
SessionDep = Annotated[Session, Depends(get_session)]
