"""worker/exports.py with a fake export process: claim, progress, the outcome, stale rows."""

from __future__ import annotations

import json
from pathlib import Path

from core.exports import service
from core.exports.models import Export
from core.jobs.service import events_after
from tests.fixtures.worker_runtime import queued_export
from worker.exports import ExportSlot, run_export
from worker.runtime import Runtime


def _row(runtime: Runtime, export_id: str) -> Export:
    with runtime.sessionmaker() as session:
        return session.get(Export, export_id)


class TestRunExport:
    def test_a_successful_export_records_progress_and_its_files_on_the_cpu(
        self, export_runtime: Runtime, make_job, tmp_path: Path
    ) -> None:
        job_id, export_id = queued_export(export_runtime, make_job, "ok", tmp_path, fmt="gguf")
        assert run_export(export_runtime, export_id) == "succeeded"
        row = _row(export_runtime, export_id)
        assert (row.status, row.progress, row.bytes, row.worker_id) == ("succeeded", 1.0, 32, export_runtime.worker_id)
        assert Path(row.path) == tmp_path / "job-out" / "exports" / export_id
        child = json.loads(Path(row.path + ".argv.json").read_text())
        assert child["cuda"] == "" and child["argv"][-4:] == ["--device", "cpu", "--quantization", "q8_0"]
        with export_runtime.sessionmaker() as session:
            events = [e.data for e in events_after(session, job_id, 0) if e.type == "export"]
        assert [e["status"] for e in events][:2] == ["queued", "running"] and events[-1]["status"] == "succeeded"
        assert {e["stage"] for e in events if e["status"] == "running"} >= {"load", "merge", "save"}
        assert export_runtime.recorded.published[-1][0] == job_id

    def test_a_failed_export_keeps_the_trainers_code_and_message(self, export_runtime: Runtime, make_job, tmp_path) -> None:
        _, export_id = queued_export(export_runtime, make_job, "fail", tmp_path)
        assert run_export(export_runtime, export_id) == "failed"
        row = _row(export_runtime, export_id)
        assert (row.error_code, row.error_message) == ("unsupported", "format gguf: not this one")

    def test_a_crash_without_a_result_fails_with_the_stderr_tail(self, export_runtime: Runtime, make_job, tmp_path) -> None:
        _, export_id = queued_export(export_runtime, make_job, "crash", tmp_path)
        assert run_export(export_runtime, export_id) == "failed"
        row = _row(export_runtime, export_id)
        assert row.error_code == "crashed" and "exited with code 3" in row.error_message
        assert "the fake export crashed" in row.error_message

    def test_a_redelivered_message_does_not_run_it_again(self, export_runtime: Runtime, make_job, tmp_path) -> None:
        _, export_id = queued_export(export_runtime, make_job, "ok", tmp_path)
        assert run_export(export_runtime, export_id) == "succeeded"
        assert run_export(export_runtime, export_id) == "skipped"

    def test_an_export_this_host_left_running_is_failed_as_worker_lost(
        self, export_runtime: Runtime, make_job, tmp_path
    ) -> None:
        _, stale = queued_export(export_runtime, make_job, "ok", tmp_path)
        with export_runtime.sessionmaker.begin() as session:
            service.claim(session, stale, export_runtime.worker_id)
        _, fresh = queued_export(export_runtime, make_job, "ok", tmp_path)
        assert run_export(export_runtime, fresh) == "succeeded"
        assert (_row(export_runtime, stale).status, _row(export_runtime, stale).error_code) == ("failed", "worker_lost")


def test_one_export_at_a_time_per_worker_process() -> None:
    slot = ExportSlot()
    assert slot.try_take("exp-a") and slot.current == "exp-a"
    assert not slot.try_take("exp-b")
    slot.release()
    assert slot.try_take("exp-b")
