from __future__ import annotations

import csv
import datetime as dt
import io
import logging
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model

from core.jobs.eta import QueueEntry
from core.jobs.models import Checkpoint, Job, StepMetric
from core.jobs.spec import Checkpointing
from trainer import objectives

log = logging.getLogger(__name__)


class Progress(BaseModel):
    step: int
    total_steps: int | None
    """Known once the trainer's plan arrives (or at once when max_steps is set)."""


class JobError(BaseModel):
    """Why a job failed: ``message`` is one line, the cause and what to do; ``detail`` the rest
    (the trainer's stderr tail, a traceback), shown folded on the job page."""

    code: str
    message: str | None
    detail: str | None = None

    @classmethod
    def of(cls, code: str, text: str | None) -> JobError:
        head, _, tail = (text or "").strip().partition("\n")
        return cls(code=code, message=head or None, detail=tail.strip() or None)


class ResumeRequest(BaseModel):
    """The body of ``POST /v1/jobs/{id}/resume``."""

    model_config = {"extra": "forbid"}
    step: int | None = None
    """The checkpoint's step; null (or no body): the newest."""


class QueueInfo(BaseModel):
    """Where a queued job waits (core/jobs/eta.py has the estimate's model)."""

    position: int
    """1-based place among the queued jobs in claim order (priority, then age)."""
    ahead: list[str]
    """Ids of the queued jobs before it."""
    estimated_start_at: dt.datetime | None
    """From the running jobs' pace and the live workers' GPUs; null when unknown."""
    holds: str | None = None
    """The worker host whose free GPUs wait for this job: it is the head of the queue and needs
    more GPUs of one host than are free now (later jobs may not take them)."""
    decided_by: str | None = None
    """Instead of an estimate: who starts it ("Slurm decides" for a job on a Slurm pool)."""
    waits_for: str | None = None
    """Why it waits whatever GPUs free up (a retry whose newest checkpoint is in a shared storage
    no live worker mounts: that storage's id and directory, the checkpoint's step); null otherwise."""


class HeldGpu(BaseModel):
    """One GPU a running job holds."""

    worker: str
    """The worker host."""
    slot: int
    """Its place in the host's pool (0-based)."""
    device: str | None
    """The GPU as CUDA_VISIBLE_DEVICES names it on that host (index or UUID); null for a CPU slot."""

    @classmethod
    def of(cls, row: Any) -> HeldGpu:
        return cls(worker=row.worker_id, slot=row.slot, device=row.device)


class DecisionOut(BaseModel):
    """One choice of the trainer's plan: a kernel, or an optimization switch."""

    name: str
    """``attention``, ``loss``, ``lora_kernel``, ``fused_ops``, ``parallelism``,
    ``gradient_checkpointing`` (the activation policy), then each switch of ``optimizations``."""
    requested: Checkpointing
    """The job's value for a switch (``auto``/``on``/``off``, and ``selective`` for
    ``gradient_checkpointing``); ``auto`` for a kernel choice, which has no switch."""
    enabled: bool
    backend: str | None
    """What runs it (e.g. ``triton``, ``torch_varlen``, ``fused_chunked_ce``, ``grouped_mm``); null when none."""
    reason: str
    """Why it is on or off on this hardware, for this model."""


class PlanOut(BaseModel):
    """The trainer's ``plan`` event (``python -m trainer run``), or the plan of a worker's
    ``python -m trainer detect --json`` (which has no hardware, steps or model)."""

    device: str
    """``cuda`` or ``cpu``."""
    dtype: str
    """Compute dtype: ``bfloat16`` or ``float32``."""
    model_attention: str | None = None
    """The model's own attention implementation (``sdpa`` or ``eager``); null in plans recorded
    before the trainer reported it."""
    decisions: list[DecisionOut]
    """Every choice with its reason, kernel choices first, then the switches in spec order."""
    hardware: dict[str, Any] | None = None
    """What the trainer detected: device, name, capability, memory, kernels, peak FLOP/s,
    ``interconnect`` between the GPUs (NVLink, PCIe, ...), ..."""
    total_steps: int | None = None
    model: dict[str, Any] | None = None
    """``{name, params, trainable_params, layers}``."""
    resumed_from_step: int | None = None
    world_size: int | None = None
    """Ranks the run trains on (one per GPU under torchrun); null in plans recorded before."""
    time: float | None = None
    """When the trainer emitted it (Unix seconds)."""

    @classmethod
    def of(cls, raw: Any) -> PlanOut | None:
        """A stored plan as this schema; None when there is none, or (logged) it is not a plan."""
        if raw is None:
            return None
        try:
            return cls.model_validate(raw)
        except ValidationError as exc:
            log.warning("a stored plan does not match PlanOut; answering null: %s", exc)
            return None


class JobSummary(BaseModel):
    """The job's results so far (``core.jobs.summary``); losses in nats per target token."""

    final_train_loss: float | None = None
    best_train_loss: float | None = None
    trained_tokens: int = 0
    """Real tokens of the applied steps (a skipped, non-finite step trains nothing)."""
    steps: int = 0
    skipped_steps: int = 0
    """Steps not applied because their loss or grad norm was NaN/inf."""
    final_eval_loss: float | None = None
    best_eval_loss: float | None = None
    best_eval_step: int | None = None


class PreflightExample(BaseModel):
    text: str
    trainable: bool
    """Whether these tokens are trained on (have labels)."""


class PreflightOut(BaseModel):
    """The dataset as the model's own tokenizer and chat template see it (``core.jobs.preflight``)."""

    checked: bool
    """False when the tokenizer is not on this box (a hub model the worker will download): see ``note``."""
    note: str | None = None
    format: str | None = None
    records: int = 0
    tokens: int = 0
    """Tokens after truncation to max_seq_len."""
    trainable_tokens: int = 0
    """Tokens with a label (the loss is taken on them), after truncation."""
    trainable_fraction: float = 0.0
    max_seq_len: int = 0
    truncated_records: int = 0
    """Records longer than max_seq_len."""
    truncated_tokens: int = 0
    """Tokens truncation cuts, of them trainable: ``truncated_trainable_tokens``."""
    truncated_trainable_tokens: int = 0
    dropped_records: int = 0
    """Records left with no trainable token after truncation (training skips them)."""
    capped: bool = False
    """Only the first records were tokenized (``api.files.tokenizer_pool.MAX_RECORDS``)."""
    example: list[PreflightExample] = []
    """One rendered record, split into runs of trainable and untrained tokens."""
    validation: dict[str, Any] | None = None
    """The same counts for the validation file."""
    warnings: list[str] = []


class GenerationProgress(BaseModel):
    """A generation job's progress (its trainer's latest ``progress`` event)."""

    prompts_done: int
    prompts_total: int
    tokens: int
    """Completion tokens generated by this attempt (every rank)."""
    tokens_per_s: float | None
    """Of this attempt, since its model loaded."""


class JobOut(BaseModel):
    id: str
    object: Literal["job"] = "job"
    kind: str = "train"
    """``train`` (a fine-tuning job), ``generate`` (a batch generation job: ``training_file`` is its
    prompts file, ``generation`` its progress, ``GET /v1/jobs/{id}/completions`` its output) or
    ``session`` (a chat session: no ``training_file``; ``GET /v1/sessions/{id}``, docs/sessions.md)."""
    name: str | None
    status: str
    """queued, running, succeeded, failed or cancelled."""
    model: str
    method: str
    training_file: str | None
    """The dataset (a generation job's prompts file); null for a session."""
    validation_file: str | None
    progress: Progress
    plan: PlanOut | None
    """The trainer's plan event: detected hardware and each optimization's decision and reason."""
    error: JobError | None
    spec: dict[str, Any]
    owner: str | None
    """The submitter's user name (null for jobs made before users existed)."""
    project: str | None = None
    """The project it belongs to (its members see it; its GPU quota and priority ceiling bound it)."""
    priority: str
    """low, normal or high: the order in which waiting jobs are claimed."""
    gpus: int
    """GPUs the job runs on (one rank each): of one worker host, or spread evenly over ``nodes`` machines."""
    nodes: int = 1
    """Machines the job spans (``gpus / nodes`` GPUs on each; 1: one host)."""
    pool: str | None = None
    """The named pool it runs on (``slurm``: a Slurm cluster, docs/slurm.md); null: ftq's own hosts."""
    held_gpus: list[HeldGpu] = []
    """The GPUs it holds while it runs (empty otherwise)."""
    queue: QueueInfo | None = None
    """Only for a queued job, on ``GET /v1/jobs/{id}`` and its submission: position and estimated start."""
    attempts: int
    worker: str | None
    cancel_requested: bool
    created_at: dt.datetime
    started_at: dt.datetime | None
    finished_at: dt.datetime | None
    updated_at: dt.datetime
    summary: JobSummary | None = None
    """Final/best train and eval loss, trained tokens, skipped steps; null before the first step."""
    generation: GenerationProgress | None = None
    """A generation job's prompts done and tokens/s; null before its first chunk and for training jobs."""
    preflight: PreflightOut | None = None
    """The submission-time dataset report, its ``warnings`` included; null for jobs made before it."""

    @classmethod
    def of(cls, job: Job, *, owner: str | None = None, held: Sequence[Any] = (), project: str | None = None) -> JobOut:
        """``held``: the job's ``gpu_slot`` rows (core/workers/pool.py ``held_by``)."""
        return cls(
            id=job.job_id,
            kind=job.kind or "train",
            name=job.name,
            status=job.status,
            model=job.model,
            method=job.method,
            training_file=job.training_file_id,
            validation_file=job.validation_file_id,
            progress=Progress(step=job.progress_step, total_steps=job.total_steps),
            plan=PlanOut.of(job.plan),
            error=JobError.of(job.error_code, job.error_message) if job.error_code else None,
            spec=job.spec,
            owner=owner,
            project=project,
            priority=job.priority,
            gpus=job.gpus,
            nodes=job.nodes or 1,
            pool=job.pool,
            held_gpus=[HeldGpu.of(row) for row in held],
            attempts=job.attempts,
            worker=job.worker_id,
            cancel_requested=job.cancel_requested,
            created_at=job.created_at,
            started_at=job.started_at,
            finished_at=job.finished_at,
            updated_at=job.updated_at,
            summary=JobSummary.model_validate(job.summary) if job.summary and job.kind == "train" else None,
            generation=GenerationProgress.model_validate(job.summary) if job.summary and job.kind != "train" else None,
            # a session keeps its adapters' names in that column (core.sessions.service), not a preflight
            preflight=PreflightOut.model_validate(job.preflight) if job.preflight and job.kind != "session" else None,
        )


class JobList(BaseModel):
    data: list[JobOut]
    next_cursor: str | None
    """Pass as ``after`` for the next (older) page; null on the last page."""


def _charts() -> list[dict[str, Any]]:
    """The objectives' charts (``trainer.objectives``), for the job page: it draws those of the job's objective."""
    return [
        {"objective": d.name, "id": c.id, "title": c.title, "digits": c.digits,
         "series": [{"key": m.name, "label": m.label} for name in c.fields for m in d.metrics if m.name == name]}
        for d in objectives.declarations() for c in d.charts
    ]


class _StepMetricOut(BaseModel):
    """A ``step_metric`` row: the fields of ``trainer.events.StepEvent`` (units in its docstrings)
    but ``total_steps``, the step's time, then every objective's step fields (``MetricOut``)."""

    model_config = ConfigDict(json_schema_extra={"x-charts": _charts()})

    step: int
    epoch: float | None
    loss: float | None
    lr: float | None
    grad_norm: float | None
    tokens: int | None
    sequences: int | None
    step_ms: float | None
    data_ms: float | None
    forward_ms: float | None
    backward_ms: float | None
    optimizer_ms: float | None
    tokens_per_s: float | None
    mfu: float | None
    gpu_mem_allocated: int | None
    gpu_mem_reserved: int | None
    gpu_mem_peak: int | None
    gpu_alloc_retries: int | None = Field(description=(
        "Times the CUDA caching allocator retried an allocation during the step (each frees its cached "
        "blocks and synchronizes the device: a slow step near the memory cap); summed over ranks; null "
        "without CUDA and for steps stored before it was recorded."))
    host_rss: int | None
    ranks: list[dict[str, Any]] | None = None
    """A multi-GPU job's step per rank: ``{rank, step_ms, data_ms, forward_ms, backward_ms,
    optimizer_ms, tokens, gpu_mem_allocated, gpu_mem_reserved, gpu_mem_peak, gpu_alloc_retries,
    host_rss}`` (the fields above are then the job's: tokens summed, the slowest rank's times, the
    largest memory, the allocator retries summed); null for one rank."""
    time: dt.datetime

    @classmethod
    def of(cls, row: StepMetric) -> MetricOut:
        """The row's columns and its ``metrics`` JSON, flat (a field no objective declares now is left out)."""
        values = {name: getattr(row, name) for name in cls.model_fields if name in StepMetric.__table__.columns}
        values.update({k: v for k, v in (row.metrics or {}).items() if k in cls.model_fields})
        return cls.model_validate(values)


def _objective_fields() -> dict[str, Any]:
    return {
        m.name: (float | None, Field(default=None, description=f"{d.title}: {m.doc} Null for other objectives."))
        for d in objectives.declarations() for m in d.metrics
    }


MetricOut = create_model(
    "MetricOut",
    __base__=_StepMetricOut,
    __doc__=_StepMetricOut.__doc__,
    __module__=__name__,
    **_objective_fields(),
)
"""``_StepMetricOut`` and one field per step field of the registered objectives (``trainer.objectives``)."""


class EvalOut(BaseModel):
    """An ``eval_metric`` row: validation loss after ``step``."""

    step: int
    loss: float | None
    tokens: int | None
    time: dt.datetime


class MetricList(BaseModel):
    data: list[MetricOut]
    next_after_step: int | None
    eval: list[EvalOut] = []
    """Every validation pass of the job (on each page), in step order."""
    """Pass as ``after_step`` for the next page; null when this page was not full."""


class CheckpointOut(BaseModel):
    step: int
    bytes: int
    final: bool
    created_at: dt.datetime

    @classmethod
    def of(cls, row: Checkpoint) -> CheckpointOut:
        return cls(step=row.step, bytes=row.bytes, final=row.final, created_at=row.created_at)


class CheckpointList(BaseModel):
    data: list[CheckpointOut]


def queue_info(entry: QueueEntry | None) -> QueueInfo | None:
    if entry is None:
        return None
    return QueueInfo(position=entry.position, ahead=list(entry.ahead), estimated_start_at=entry.estimated_start_at,
                     holds=entry.holds, decided_by=entry.decided_by, waits_for=entry.waits_for)


def metrics_csv(rows: Sequence[StepMetric]) -> str:
    """``rows`` as CSV: a header of ``MetricOut``'s fields but ``ranks``, one line per step."""
    columns = [name for name in MetricOut.model_fields if name != "ranks"]
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(columns)
    for row in rows:
        record = MetricOut.of(row).model_dump(mode="json")
        writer.writerow(["" if record[c] is None else record[c] for c in columns])
    return out.getvalue()
