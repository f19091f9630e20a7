"""The step_metric.metrics migration on PostgreSQL and SQLite, with rows present: upgrade moves each
row's SFT and DPO step fields from their five columns into the JSON column (nulls left out; a row
with none keeps NULL); downgrade moves them back into the columns; upgrading again reads as before."""

from __future__ import annotations

import pytest
from sqlalchemy import insert, text

from core import migrate
from core.db import new_id, utcnow
from core.files.models import File
from core.jobs.models import Job, StepMetric

pytestmark = pytest.mark.integration

BEFORE = "8f3b6a2d9e14"
COLUMNS = ("reward_margin", "reward_accuracy", "chosen_logp", "rejected_logp", "token_accuracy")
ROWS = {
    1: {"token_accuracy": 0.25},  # an SFT step
    2: {"reward_margin": 0.5, "reward_accuracy": 0.75, "chosen_logp": -12.5, "rejected_logp": -20.0},  # a DPO step
    3: {},  # a step from before either field
}


def insert_rows(store) -> str:
    """A file, a job and its three step rows, written with Core in the columns of ``BEFORE``."""
    now = utcnow()
    job_id, file_id = new_id("job"), new_id("file")
    with store.sessions.begin() as session:
        session.execute(insert(File.__table__).values(
            file_id=file_id, filename="d.jsonl", purpose="train", bytes=1, sha256="0" * 64, format="chat",
            num_records=1, path="/dev/null", stats={}, created_at=now))
        session.execute(insert(Job.__table__).values(
            job_id=job_id, model="tiny", method="lora", spec={"model": "tiny"}, training_file_id=file_id,
            status="succeeded", priority="normal", gpus=1, nodes=1, progress_step=3, cancel_requested=False,
            attempts=1, last_event_seq=0, created_at=now, updated_at=now))
        for step, values in ROWS.items():
            names = ", ".join(["job_id", "step", "loss", "time", *values])
            marks = ", ".join([":job_id", ":step", ":loss", ":time", *(f":{k}" for k in values)])
            session.execute(text(f"INSERT INTO step_metric ({names}) VALUES ({marks})"),
                            {"job_id": job_id, "step": step, "loss": 1.0 + step, "time": now, **values})
    return job_id


def old_columns(store, job_id: str) -> dict[int, dict[str, float]]:
    with store.engine.connect() as conn:
        rows = conn.execute(text(f"SELECT step, {', '.join(COLUMNS)} FROM step_metric WHERE job_id = :j"),
                            {"j": job_id}).all()
    return {row.step: {k: getattr(row, k) for k in COLUMNS if getattr(row, k) is not None} for row in rows}


def test_step_metric_metrics_migration_round_trip_keeps_every_value(store) -> None:
    migrate.downgrade(store.url, BEFORE)
    try:
        job_id = insert_rows(store)
        assert old_columns(store, job_id) == ROWS
    finally:
        migrate.upgrade(store.url)
    with store.sessions() as session:
        rows = session.query(StepMetric).filter_by(job_id=job_id).order_by(StepMetric.step).all()
        assert {row.step: row.metrics for row in rows} == {1: ROWS[1], 2: ROWS[2], 3: None}
        assert [row.loss for row in rows] == [2.0, 3.0, 4.0]
    with store.engine.connect() as conn:
        assert not set(COLUMNS) & set(conn.execute(text("SELECT * FROM step_metric")).keys())

    migrate.downgrade(store.url, BEFORE)
    try:
        assert old_columns(store, job_id) == ROWS
    finally:
        migrate.upgrade(store.url)
    with store.sessions() as session:
        rows = session.query(StepMetric).filter_by(job_id=job_id).order_by(StepMetric.step).all()
        assert {row.step: row.metrics for row in rows} == {1: ROWS[1], 2: ROWS[2], 3: None}
    migrate.check(store.url)
