"""Evals in the store: an eval (its item schema and graders) and its runs.

A run's work is an ordinary job of kind ``eval`` (``job_id``): queued, placed, cancelled and
resumed as a generation job is, shown in ``/v1/jobs``; its graded lines are the job's
``completions.jsonl``. The run row is what the evals API shows back: its name, metadata, the
data source as the caller sent it, the model named.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from sqlalchemy import ForeignKey, String
from sqlalchemy.orm import Mapped, mapped_column

from core.db import Base, JSONType, UTCDateTime, utcnow


class Eval(Base):
    """An eval: what a run's items look like and how each output is graded."""

    __tablename__ = "eval"

    eval_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    user_metadata: Mapped[dict[str, Any] | None] = mapped_column(JSONType)
    """``metadata`` of the request (at most 16 string pairs), returned as sent."""
    item_schema: Mapped[dict[str, Any]] = mapped_column(JSONType)
    """``data_source_config.item_schema``: the JSON schema every item of a run must match."""
    include_sample_schema: Mapped[bool] = mapped_column(default=False)
    testing_criteria: Mapped[list[dict[str, Any]]] = mapped_column(JSONType)
    """The graders as ``trainer.graders.validate`` returned them, each with its ``pass_threshold``."""
    owner_id: Mapped[str | None] = mapped_column(ForeignKey("user.user_id", ondelete="RESTRICT"), index=True)
    project_id: Mapped[str | None] = mapped_column(ForeignKey("project.project_id", ondelete="RESTRICT"), index=True)
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, default=utcnow)
    updated_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, default=utcnow)


class EvalRun(Base):
    """One run of an eval on one model: the job that generates and grades."""

    __tablename__ = "eval_run"

    run_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    eval_id: Mapped[str] = mapped_column(ForeignKey("eval.eval_id", ondelete="CASCADE"), index=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("job.job_id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(200))
    user_metadata: Mapped[dict[str, Any] | None] = mapped_column(JSONType)
    model: Mapped[str] = mapped_column(String(512))
    """The model as the caller named it (a base, job:<id>[@step], an ``ft:`` name, export:<id>)."""
    data_source: Mapped[dict[str, Any]] = mapped_column(JSONType)
    """The run's ``data_source`` as sent, an inline ``file_content`` replaced by the file it was stored as."""
    owner_id: Mapped[str | None] = mapped_column(ForeignKey("user.user_id", ondelete="RESTRICT"), index=True)
    project_id: Mapped[str | None] = mapped_column(ForeignKey("project.project_id", ondelete="RESTRICT"), index=True)
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, default=utcnow)
