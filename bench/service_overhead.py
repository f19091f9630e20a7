"""The service's share of a training step: what streaming one ``step`` event costs, per step.

The trainer emits one ``step`` event per optimizer step (``trainer.events.Emitter``: a JSON line on
stdout, flushed); the worker, another process, reads the pipe and writes the events to the store in
batches (``worker.recorder.EventRecorder``: one transaction per batch, then a publish). This bench
times both on this machine's CPU, on a realistic step event:

- ``emit``: the trainer's side, into a real pipe drained by a child process (what the worker's
  reader does), per event;
- ``record``: the worker's side, per event, batched as the worker batches (``--batch`` events per
  transaction) into a fresh store (``--database-url``, default a temporary SQLite file; pass the
  PostgreSQL URL of a real deployment to time that).

The trainer's share runs on the host while the GPU executes the queued step (step timings come
from CUDA events read one step late, with no synchronize), so it can only lengthen a step that is
host-bound; the worker's runs in its own process. Both are printed against the step times of
``docs/benchmarks.md`` (H200: Qwen3-0.6B 320 ms, Llama-3.1-8B 1,443 ms per 16,384-token step).

Run: ``python -m bench.service_overhead [--events 2000] [--batch 50] [--database-url URL]``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from trainer.events import Emitter
from trainer.objectives import metric_fields

STEP_MS = {"Qwen3-0.6B (H200)": 320.0, "Llama-3.1-8B (H200)": 1443.0}
"""ftq step times from docs/benchmarks.md (bench.train_step, this repo)."""


def step_payload(step: int) -> dict[str, Any]:
    """The fields of a real ``step`` event on a GPU (``trainer.training.step.PendingStep.read``)."""
    return {
        **dict.fromkeys(m.name for m in metric_fields()),  # every objective's fields, null but SFT's below
        "step": step, "total_steps": 10_000, "epoch": round(step / 3000, 4), "loss": 2.3456789 - step * 1e-5,
        "lr": 1.999e-4, "grad_norm": 0.8123456, "tokens": 16_384, "sequences": 41, "step_ms": 1443.21,
        "data_ms": 0.42, "forward_ms": 512.3, "backward_ms": 931.1, "optimizer_ms": 0.61,
        "tokens_per_s": 11_352.7, "mfu": 0.4321, "gpu_mem_allocated": 17_179_869_184,
        "gpu_mem_reserved": 21_474_836_480, "gpu_mem_peak": 20_561_612_390, "gpu_alloc_retries": 0,
        "host_rss": 6_442_450_944, "ranks": None, "token_accuracy": 0.4567,
    }


def time_emit(events: int) -> list[float]:
    """Seconds per ``Emitter`` call, writing into a pipe that a child process drains."""
    drain = subprocess.Popen(
        [sys.executable, "-c", "import sys\nfor _ in sys.stdin: pass"],
        stdin=subprocess.PIPE,
        text=True,
    )
    assert drain.stdin is not None
    emit = Emitter(drain.stdin)
    times = []
    try:
        for step in range(events):
            start = time.perf_counter()
            emit("step", **step_payload(step))
            times.append(time.perf_counter() - start)
    finally:
        drain.stdin.close()
        drain.wait(timeout=30)
    return times


def time_record(events: int, batch: int, database_url: str | None) -> list[float]:
    """Seconds per event through ``EventRecorder`` (``batch`` events per flush) into a fresh job."""
    from core.db import make_engine, make_sessionmaker, new_id, utcnow
    from core.files.models import File
    from core.jobs.models import Job
    from core.jobs.service import append_events, state_event
    from core.jobs.states import JobStatus
    from core.models import metadata
    from trainer.events import make_event
    from worker.recorder import EventRecorder

    with tempfile.TemporaryDirectory() as tmp:
        url = database_url or f"sqlite:///{Path(tmp) / 'store.db'}"
        engine = make_engine(url)
        if database_url is None:
            metadata.create_all(engine)
        sessions = make_sessionmaker(engine)
        job_id = new_id("job")
        with sessions.begin() as session:
            file_id = new_id("file")
            session.add(File(file_id=file_id, filename="bench.jsonl", purpose="train", bytes=1, sha256="0" * 64,
                             format="text", num_records=1, path="/dev/null"))
            session.flush()
            session.add(Job(job_id=job_id, model="bench", method="lora", spec={}, training_file_id=file_id,
                            status=JobStatus.running.value, created_at=utcnow(), updated_at=utcnow()))
            session.flush()
            append_events(session, job_id, [state_event(JobStatus.running)])
        recorder = EventRecorder(sessions, job_id, flush_interval_s=3600, max_batch=batch)
        times = []
        try:
            for first in range(0, events, batch):
                rows = [make_event("step", **step_payload(s)) for s in range(first, min(first + batch, events))]
                start = time.perf_counter()
                for row in rows:
                    recorder.add(row)
                recorder.flush()
                times.append((time.perf_counter() - start) / len(rows))
            if recorder.events_written != events:
                raise RuntimeError(f"the store took {recorder.events_written} of {events} events")
        finally:
            if database_url is not None:  # leave a real store as it was
                _delete_job(sessions, job_id, file_id)
            engine.dispose()
        return times


def _delete_job(sessions: Any, job_id: str, file_id: str) -> None:
    from sqlalchemy import delete

    from core.files.models import File
    from core.jobs.models import Job, JobEvent, StepMetric

    with sessions.begin() as session:
        for model in (StepMetric, JobEvent):
            session.execute(delete(model).where(model.job_id == job_id))
        session.execute(delete(Job).where(Job.job_id == job_id))
        session.execute(delete(File).where(File.file_id == file_id))


def table(emit_s: list[float], record_s: list[float], batch: int, store: str) -> str:
    rows = [
        "| per step event | median µs | p99 µs | " + " | ".join(f"share of a {k} step" for k in STEP_MS) + " |",
        "|---|---:|---:|" + "---:|" * len(STEP_MS),
    ]
    for name, times in (("trainer: emit to a pipe", emit_s), (f"worker: record ({store}, {batch} per batch)", record_s)):
        median = statistics.median(times) * 1e6
        p99 = sorted(times)[int(0.99 * (len(times) - 1))] * 1e6
        shares = " | ".join(f"{median / 1e3 / ms:.4%}" for ms in STEP_MS.values())
        rows.append(f"| {name} | {median:.1f} | {p99:.1f} | {shares} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=50, help="events per store transaction")
    parser.add_argument("--database-url", help="an existing, migrated store (default: a temporary SQLite file)")
    args = parser.parse_args(argv)
    if args.events < 1 or args.batch < 1:
        parser.error("--events and --batch must be at least 1")
    emit_s = time_emit(args.events)
    record_s = time_record(args.events, args.batch, args.database_url)
    store = (args.database_url or "sqlite").split(":", 1)[0].split("+", 1)[0]
    print(f"{dt.date.today()}, {args.events} step events")
    print(table(emit_s, record_s, args.batch, store))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
