"""The ``ftq`` command line: parsing, ``db upgrade``, and refusing what would not work."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import create_engine, inspect

from cli.main import build_parser, main
from cli.up import child_env, seed_demo_model
from core.settings import Settings
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
    def test_refuses_more_than_one_gpu(self, data_dir, capsys):
        assert main(["worker", "--gpu", "0,1"]) == 2
        assert "one GPU index" in capsys.readouterr().err

    def test_refuses_a_store_without_schema(self, data_dir, capsys):
        assert main(["worker"]) == 2
        assert "run `ftq db upgrade` first" in capsys.readouterr().err

    def test_runs_one_prefork_process_with_prefetch_one(self):
        argv = worker_argv(WorkerOptions(gpu="2", name="box/gpu2"))
        assert {"--pool=prefork", "--concurrency=1", "--prefetch-multiplier=1", "--queues=ftq.jobs"} <= set(argv)
        assert "--hostname=ftq-box-gpu2@%h" in argv


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


def test_worker_ids_name_the_host_and_device():
    assert WorkerOptions(gpu="0").worker_id.endswith("/gpu0")
    assert WorkerOptions().worker_id.endswith("/cpu") and WorkerOptions().device == "cpu"
    with pytest.raises(ValueError, match="max_batch_events"):
        WorkerOptions(max_batch_events=0)
