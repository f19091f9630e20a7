"""A chat session through the real runner: a job of kind ``session`` takes the trainer's ``serve``
subcommand with a pipe on its stdin; a request posted to the store relay reaches the session process
(tests/unit/worker/fake_session.py, which answers as ``python -m trainer serve`` does:
tests/unit/trainer/generate/test_session.py runs the real one) and its replies come back to the
relay, never as job events; the session ends by itself when idle (``succeeded``, its state event says
idle), leaving no relay rows."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

from sqlalchemy import select

from core.db import new_id, utcnow
from core.jobs.models import Job, JobEvent
from core.jobs.service import append_events, state_event
from core.jobs.states import JobStatus
from core.sessions import relay
from core.sessions.models import SessionMessage
from core.sessions.spec import SessionSpec
from trainer.generate.session_config import SessionConfig
from worker.launch import subcommand
from worker.runner import run_job
from worker.runtime import WorkerOptions

def test_a_session_job_json_runs_serve(tmp_path: Path) -> None:
    path = tmp_path / "session.json"
    SessionConfig(model="m").save(path)
    assert subcommand(path) == "serve"


def test_a_session_answers_through_the_relay_and_ends_idle(runtime, settings, tmp_path: Path) -> None:
    (settings.model_root / "tiny").mkdir(parents=True)
    (settings.model_root / "tiny" / "config.json").write_text('{"model_type": "llama"}')
    runtime.settings = settings.model_copy(
        update={"session_idle_timeout_s": 1.5, "session_poll_interval_s": 0.02, "session_max_len": 64})
    runtime.options = WorkerOptions(gpus=runtime.options.gpus, name=runtime.worker_id,
                                    trainer_argv=(sys.executable, str(Path(__file__).parent / "fake_session.py")))
    runtime.config_builder = None
    job_id = new_id("job")
    with runtime.sessionmaker.begin() as session:
        session.add(Job(job_id=job_id, kind="session", model="tiny", method="session",
                        spec=SessionSpec(models=["tiny"]).to_stored(), training_file_id=None,
                        preflight={"adapters": {"tiny": "base"}}, status=JobStatus.queued.value,
                        output_dir=str(tmp_path / "out"), created_at=utcnow(), updated_at=utcnow()))
        session.flush()
        append_events(session, job_id, [state_event(JobStatus.queued)])
        relay.post(session, job_id, "req-1", "request",
                   {"adapter": "base", "prompt": "Once upon", "params": {"max_tokens": 5, "temperature": 0.0}})
    ended: list[str] = []
    runner = threading.Thread(target=lambda: ended.append(run_job(runtime, job_id)), daemon=True)
    runner.start()
    deadline, kinds = time.monotonic() + 60, []
    while time.monotonic() < deadline and not any(k == "delta" and f for k, f in kinds):
        with runtime.sessionmaker() as session:
            kinds = [(r.kind, r.body.get("finish_reason")) for r in relay.replies(session, "req-1", 0)]
        time.sleep(0.05)
    assert kinds[0] == ("accepted", None) and kinds[-1][1] == "length", kinds
    runner.join(timeout=120)
    assert ended == ["succeeded"]
    with runtime.sessionmaker() as session:
        events = session.scalars(select(JobEvent).where(JobEvent.job_id == job_id).order_by(JobEvent.seq)).all()
        assert session.scalars(select(SessionMessage)).all() == [], "an ended session leaves no relay rows"
    assert events[-1].data["status"] == "succeeded" and events[-1].data["message"].startswith("idle")
    assert all(e.type in ("state", "log") for e in events), [e.type for e in events]
    assert "Once upon" not in "".join(str(e.data) for e in events), "no prompt in the job's history"
