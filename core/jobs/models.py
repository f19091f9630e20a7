from __future__ import annotations

import datetime as dt
from typing import Any

from sqlalchemy import BigInteger, Boolean, Float, ForeignKey, Integer, String, Text, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column

from core.db import Base, JSONType, UTCDateTime, utcnow
from core.jobs.states import JobStatus


class Job(Base):
    """A fine-tuning job. ``status`` changes only through ``core.jobs.service.transition``."""

    __tablename__ = "job"

    job_id: Mapped[str] = mapped_column(String(40), primary_key=True)
    name: Mapped[str | None] = mapped_column(String(200))
    status: Mapped[str] = mapped_column(String(16), index=True, default=JobStatus.queued.value)
    kind: Mapped[str] = mapped_column(String(16), server_default="train")
    """``train`` (``spec``: ``core.jobs.spec.JobSpec``), ``generate`` (``core.jobs.generate_spec.GenerateSpec``:
    ``training_file_id`` holds its prompts file, ``method`` reads ``generate``) or ``session`` (a chat
    session: ``core.sessions.spec.SessionSpec``, no file, ``method`` reads ``session``). A server default only
    (no Python-side one): an INSERT that does not name it (the migration tests' rows written at
    revisions before it) leaves it to the store; ``core.jobs.service`` names it for new jobs."""
    model: Mapped[str] = mapped_column(String(512))
    method: Mapped[str] = mapped_column(String(16))
    spec: Mapped[dict[str, Any]] = mapped_column(JSONType)
    """The validated ``core.jobs.spec.JobSpec`` as JSON (what the user asked for, defaults filled)."""
    training_file_id: Mapped[str | None] = mapped_column(ForeignKey("file.file_id", ondelete="RESTRICT"))
    """The dataset (a generation job's prompts file); None for a session, which reads no file."""
    validation_file_id: Mapped[str | None] = mapped_column(ForeignKey("file.file_id", ondelete="RESTRICT"))
    owner_id: Mapped[str | None] = mapped_column(ForeignKey("user.user_id", ondelete="RESTRICT"), index=True)
    """Who submitted it; None only for jobs created before users existed."""
    project_id: Mapped[str | None] = mapped_column(ForeignKey("project.project_id", ondelete="RESTRICT"), index=True)
    """The project it belongs to (``core.projects``); its members see it, its quota bounds it."""
    priority: Mapped[str] = mapped_column(String(8), default="normal", server_default="normal")
    """``low``, ``normal`` or ``high``: the order in which waiting jobs are claimed."""
    gpus: Mapped[int] = mapped_column(Integer, default=1, server_default="1")
    """GPUs the job asks for."""
    nodes: Mapped[int] = mapped_column(Integer, server_default="1")
    """Machines the GPUs are spread over (``gpus / nodes`` each); 1: one worker host."""
    pool: Mapped[str | None] = mapped_column(String(64))
    """The named pool the job runs on (``slurm``: a cluster scheduler's, through its bridge,
    docs/slurm.md); None: ftq's own worker hosts."""
    idempotency_key: Mapped[str | None] = mapped_column(String(200), unique=True)
    idempotency_hash: Mapped[str | None] = mapped_column(String(64))
    """sha256 of the stored spec sent with ``idempotency_key``: a replay must match it."""
    progress_step: Mapped[int] = mapped_column(Integer, default=0)
    total_steps: Mapped[int | None] = mapped_column(Integer)
    plan: Mapped[dict[str, Any] | None] = mapped_column(JSONType)
    summary: Mapped[dict[str, Any] | None] = mapped_column(JSONType)
    """Final/best train and eval loss, trained tokens, skipped steps (``worker.recorder``); for a
    generation job its progress: prompts_done, prompts_total, tokens, tokens_per_s."""
    preflight: Mapped[dict[str, Any] | None] = mapped_column(JSONType)
    """The dataset report made at submission, with its warnings (``core.jobs.preflight``)."""
    """The trainer's ``plan`` event: detected hardware and each optimization's decision."""
    error_code: Mapped[str | None] = mapped_column(String(64))
    error_message: Mapped[str | None] = mapped_column(Text)
    cancel_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    """How many times a worker has claimed the job (retries after a lost worker add one)."""
    worker_id: Mapped[str | None] = mapped_column(String(200))
    heartbeat_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime)
    output_dir: Mapped[str | None] = mapped_column(String(1024))
    last_event_seq: Mapped[int] = mapped_column(BigInteger, default=0)
    """Highest ``job_event.seq`` written for this job; the next event gets seq + 1."""
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, default=utcnow, index=True)
    started_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime)
    finished_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime)
    updated_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, default=utcnow, onupdate=utcnow)


class JobEvent(Base):
    """Every event of a job in order: the history behind the SSE stream (``id:`` is ``seq``)."""

    __tablename__ = "job_event"
    __table_args__ = (UniqueConstraint("job_id", "seq"),)

    job_event_id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("job.job_id", ondelete="CASCADE"), index=True)
    seq: Mapped[int] = mapped_column(BigInteger)
    type: Mapped[str] = mapped_column(String(16))
    """``state``, ``plan``, ``step``, ``eval``, ``skip``, ``sample``, ``log`` or ``checkpoint``."""
    data: Mapped[dict[str, Any]] = mapped_column(JSONType)
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, default=utcnow)


class StepMetric(Base):
    """One row per optimizer step: a column per field of ``trainer.events.StepEvent`` but
    ``total_steps`` (kept once, on the job), the objectives' step fields in one JSON column
    (``metrics``), plus the event's ``time``. A test (``tests/unit/test_contracts.py``) fails when
    the lists part."""

    __tablename__ = "step_metric"

    job_id: Mapped[str] = mapped_column(ForeignKey("job.job_id", ondelete="CASCADE"), primary_key=True)
    step: Mapped[int] = mapped_column(Integer, primary_key=True)
    epoch: Mapped[float | None] = mapped_column(Float)
    loss: Mapped[float | None] = mapped_column(Float)
    lr: Mapped[float | None] = mapped_column(Float)
    grad_norm: Mapped[float | None] = mapped_column(Float)
    tokens: Mapped[int | None] = mapped_column(BigInteger)
    sequences: Mapped[int | None] = mapped_column(Integer)
    step_ms: Mapped[float | None] = mapped_column(Float)
    data_ms: Mapped[float | None] = mapped_column(Float)
    forward_ms: Mapped[float | None] = mapped_column(Float)
    backward_ms: Mapped[float | None] = mapped_column(Float)
    optimizer_ms: Mapped[float | None] = mapped_column(Float)
    tokens_per_s: Mapped[float | None] = mapped_column(Float)
    mfu: Mapped[float | None] = mapped_column(Float)
    gpu_mem_allocated: Mapped[int | None] = mapped_column(BigInteger)
    gpu_mem_reserved: Mapped[int | None] = mapped_column(BigInteger)
    gpu_mem_peak: Mapped[int | None] = mapped_column(BigInteger)
    gpu_alloc_retries: Mapped[int | None] = mapped_column(Integer)
    host_rss: Mapped[int | None] = mapped_column(BigInteger)
    ranks: Mapped[list[dict[str, Any]] | None] = mapped_column(JSONType)
    """Per rank of a multi-GPU job: ``{rank, step_ms, data_ms, forward_ms, backward_ms,
    optimizer_ms, tokens, gpu_mem_*, gpu_alloc_retries, host_rss}``; None for one rank."""
    metrics: Mapped[dict[str, float] | None] = mapped_column(JSONType)
    """The run's objective's step fields (``trainer.objectives``' ``MetricField``s) that have a
    value, by name: a new objective's fields need no new column."""
    time: Mapped[dt.datetime] = mapped_column(UTCDateTime, default=utcnow)


class EvalMetric(Base):
    """One validation pass (the trainer's ``eval`` event): loss over the validation set after ``step``."""

    __tablename__ = "eval_metric"

    job_id: Mapped[str] = mapped_column(ForeignKey("job.job_id", ondelete="CASCADE"), primary_key=True)
    step: Mapped[int] = mapped_column(Integer, primary_key=True)
    loss: Mapped[float | None] = mapped_column(Float)
    tokens: Mapped[int | None] = mapped_column(BigInteger)
    """Target tokens the loss is the mean over."""
    time: Mapped[dt.datetime] = mapped_column(UTCDateTime, default=utcnow)


class StepRollout(Base):
    """The rollouts shown for a GRPO step (the trainer's ``rollouts`` event): its first
    ``grpo.log_rollouts`` completions of rank 0's prompts, each ``{prompt_index, prompt, completion,
    completion_tokens, reward, advantage, scores}`` (``trainer.objectives.grpo.shown_rollouts``)."""

    __tablename__ = "step_rollout"

    job_id: Mapped[str] = mapped_column(ForeignKey("job.job_id", ondelete="CASCADE"), primary_key=True)
    step: Mapped[int] = mapped_column(Integer, primary_key=True)
    rollouts: Mapped[list[dict[str, Any]]] = mapped_column(JSONType)
    time: Mapped[dt.datetime] = mapped_column(UTCDateTime, default=utcnow)


class Checkpoint(Base):
    """A checkpoint directory the trainer wrote (adapter + optimizer + step + RNG)."""

    __tablename__ = "checkpoint"

    job_id: Mapped[str] = mapped_column(ForeignKey("job.job_id", ondelete="CASCADE"), primary_key=True)
    step: Mapped[int] = mapped_column(Integer, primary_key=True)
    path: Mapped[str] = mapped_column(String(1024))
    bytes: Mapped[int] = mapped_column(BigInteger)
    final: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, default=utcnow)


class JobNode(Base):
    """One machine of an attempt of a multi-machine job (``nodes > 1``): its worker host, the
    address its ranks use, the rendezvous endpoint (on the leader, node rank 0) and how its part
    ended. The leader writes every row of the attempt when its claim commits."""

    __tablename__ = "job_node"

    job_id: Mapped[str] = mapped_column(ForeignKey("job.job_id", ondelete="CASCADE"), primary_key=True)
    attempt: Mapped[int] = mapped_column(Integer, primary_key=True)
    node_rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    """0 for the leader (the machine whose address sorts first: it holds global rank 0)."""
    worker_id: Mapped[str] = mapped_column(String(200), index=True)
    address: Mapped[str] = mapped_column(String(255))
    rdzv_endpoint: Mapped[str] = mapped_column(String(300))
    """``<leader address>:<port>`` of torchrun's c10d rendezvous."""
    started_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime)
    ended_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime)
    returncode: Mapped[int | None] = mapped_column(Integer)
