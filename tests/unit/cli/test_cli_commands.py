"""The ``ftq`` command line: parsing, ``db upgrade``, and refusing what would not work."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import create_engine, inspect

from cli.main import build_parser, main
from cli.up import child_env, seed_demo_model
from core.settings import Settings
from core.queue import host_queue
from worker.app import worker_argv
from worker.runtime import WorkerOptions


@pytest.fixture
def data_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for name in ("FTQ_DATABASE_URL", "FTQ_BROKER_URL", "FTQ_REDIS_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("FTQ_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("FTQ_MODEL_ROOT", str(tmp_path / "models"))
    return tmp_path / "data"


class TestParser:
    def test_every_command_is_there(self):
        parser = build_parser()
        for argv in (["up"], ["api", "--port", "9000"], ["worker", "--gpu", "1"], ["db", "upgrade"]):
            assert callable(parser.parse_args(argv).run)

    def test_a_command_is_required(self, capsys):
        with pytest.raises(SystemExit) as exc:
            main([])
        assert exc.value.code == 2


class TestDbUpgrade:
    def test_creates_the_embedded_store_under_the_data_dir(self, data_dir, capsys):
        assert main(["db", "upgrade"]) == 0
        engine = create_engine(f"sqlite:///{data_dir / 'ftq.db'}")
        try:
            tables = set(inspect(engine).get_table_names())
        finally:
            engine.dispose()
        assert {"job", "job_event", "step_metric", "checkpoint", "file", "worker"} <= tables
        assert "is at head" in capsys.readouterr().out
        assert main(["db", "upgrade"]) == 0  # idempotent


class TestWorkerCommand:
    def test_gpu_takes_one_gpu_and_points_to_gpus(self, data_dir, capsys):
        assert main(["worker", "--gpu", "0,1"]) == 2
        err = capsys.readouterr().err
        assert "one GPU index" in err and "--gpus 0,1" in err

    def test_refuses_a_store_without_schema(self, data_dir, capsys):
        assert main(["worker"]) == 2
        assert "run `ftq db upgrade` first" in capsys.readouterr().err

    def test_runs_a_thread_per_gpu_with_prefetch_one_on_the_shared_and_its_own_queue(self):
        argv = worker_argv(WorkerOptions(gpus=("0", "2"), name="box/gpu0,2"))
        assert {"--pool=threads", "--concurrency=3", "--prefetch-multiplier=1"} <= set(argv)  # 2 GPUs + 1 export thread
        assert f"--queues=ftq.jobs,{host_queue('box/gpu0,2')}" in argv and "," not in host_queue("box/gpu0,2")
        assert "--hostname=ftq-box-gpu0-2@%h" in argv


class TestUpHelpers:
    def test_children_get_the_resolved_embedded_urls(self, data_dir):
        env = child_env(Settings().resolved())
        assert env["FTQ_DATABASE_URL"] == f"sqlite:///{data_dir / 'ftq.db'}"
        assert env["FTQ_BROKER_URL"] == f"sqla+sqlite:///{data_dir / 'broker.db'}"
        assert env["FTQ_DATA_DIR"] == str(data_dir)

    def test_a_model_root_with_models_is_not_seeded(self, tmp_path):
        (tmp_path / "mine").mkdir()
        seed_demo_model(tmp_path)
        assert [p.name for p in tmp_path.iterdir()] == ["mine"]


def test_worker_ids_name_the_host_and_its_gpus():
    assert WorkerOptions(gpus=("0",)).worker_id.endswith("/gpu0")
    assert WorkerOptions(gpus=("0", "1")).worker_id.endswith("/gpu0,1") and WorkerOptions(gpus=("0", "1")).pool == ("0", "1")
    assert WorkerOptions().worker_id.endswith("/cpu") and WorkerOptions().device == "cpu"
    assert WorkerOptions(slots=3).pool == (None, None, None)
    with pytest.raises(ValueError, match="max_batch_events"):
        WorkerOptions(max_batch_events=0)
