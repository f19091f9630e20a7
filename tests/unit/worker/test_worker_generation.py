"""The worker's side of a generation job: its job.json takes the trainer's ``generate`` subcommand
(one process and torchrun alike), and its progress events become the job's summary."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import select

from core.jobs.models import Job, JobEvent
from trainer.events import make_event
from trainer.generate.job_config import GenerateConfig
from worker.launch import subcommand, torchrun_argv, trainer_argv
from worker.recorder import apply_events


class TestLaunch:
    def test_a_generation_job_json_runs_generate_and_a_training_one_run(self, tmp_path: Path, runtime) -> None:
        generate = tmp_path / "gen.json"
        GenerateConfig(model="m", prompts_file="p.jsonl", output_dir="out").save(generate)
        train = tmp_path / "train.json"
        train.write_text('{"model": {"name_or_path": "m"}}')
        assert (subcommand(generate), subcommand(train), subcommand(tmp_path / "missing.json")) == (
            "generate", "run", "run")
        assert trainer_argv(runtime.options, generate)[-2:] == ["generate", str(generate)]
        ranks = torchrun_argv(runtime.options, generate, ranks=2, rank_log_dir=tmp_path)
        assert ranks[-2:] == ["generate", str(generate)] and "--nproc-per-node=2" in ranks
        assert trainer_argv(runtime.options, train)[-2] == "run"


class TestRecorder:
    def test_progress_events_are_stored_and_the_latest_is_the_job_s_summary(self, runtime, make_job) -> None:
        job_id = make_job("fake:ok")
        events = [make_event("progress", stage="generate", prompts_done=d, prompts_total=4, tokens=t,
                             tokens_per_s=r) for d, t, r in ((0, 0, None), (2, 10, 5.0), (4, 20, 6.5))]
        with runtime.sessionmaker.begin() as session:
            apply_events(session, job_id, events)
        with runtime.sessionmaker() as session:
            job = session.get(Job, job_id)
            stored = session.scalars(select(JobEvent.type).where(JobEvent.job_id == job_id)).all()
        assert job.summary == {"prompts_done": 4, "prompts_total": 4, "tokens": 20, "tokens_per_s": 6.5}
        assert stored.count("progress") == 3 and (job.progress_step, job.total_steps) == (0, None)
