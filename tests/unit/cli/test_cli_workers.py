"""``ftq worker --gpus | --gpu | --slots``: which GPUs the host's one worker holds as its pool."""

from __future__ import annotations

import pytest

from cli.errors import CliError
from cli.main import build_parser
from cli.workers import parse_gpus, visible_gpus


class TestVisibleGpus:
    @pytest.mark.parametrize(
        ("raw", "expected"),
        [("0,2", ["0", "2"]), (" 1 , GPU-8a1b-22 ", ["1", "GPU-8a1b-22"]), ("", []), ("-1", []), ("0,-1,2", ["0"])],
    )
    def test_cuda_visible_devices_is_read_as_cuda_reads_it(self, raw, expected):
        assert visible_gpus({"CUDA_VISIBLE_DEVICES": raw}, query=lambda: ["9"]) == expected

    def test_unset_asks_the_driver(self):
        assert visible_gpus({}, query=lambda: ["0", "1"]) == ["0", "1"]


class TestParseGpus:
    def test_all_is_every_visible_gpu(self):
        assert parse_gpus("all", visible=lambda: ["0", "1", "3"]) == ["0", "1", "3"]

    def test_all_without_gpus_is_one_cpu_slot(self):
        assert parse_gpus("all", visible=list) == [None]

    def test_a_list(self):
        assert parse_gpus("0, 1,3") == ["0", "1", "3"]

    @pytest.mark.parametrize(("value", "says"), [("0,,1", "'' is not a GPU"), ("0,x", "'x' is not a GPU"),
                                                 ("1,1", "GPU 1 is listed twice"), ("cpu", "give `all`")])
    def test_bad_lists_say_what_to_write(self, value, says):
        with pytest.raises(CliError, match=says):
            parse_gpus(value)


class TestWorkerPool:
    @pytest.mark.parametrize(
        ("argv", "env", "expected"),
        [
            (["--gpu", "3"], {}, ["3"]),
            (["--gpus", "0,2"], {}, ["0", "2"]),
            (["--slots", "3"], {"CUDA_VISIBLE_DEVICES": "0,1"}, []),
            ([], {"CUDA_VISIBLE_DEVICES": "1,2"}, ["1", "2"]),
            ([], {}, []),
        ],
    )
    def test_the_flags_name_the_pools_gpus(self, argv, env, expected):
        from cli.serve import worker_gpus

        args = build_parser().parse_args(["worker", *argv])
        assert worker_gpus(args, env) == expected

    def test_gpu_gpus_and_slots_exclude_each_other(self, capsys):
        for argv in (["--gpu", "0", "--gpus", "all"], ["--gpus", "all", "--slots", "2"]):
            with pytest.raises(SystemExit):
                build_parser().parse_args(["worker", *argv])
            assert "not allowed with argument" in capsys.readouterr().err

    def test_several_gpus_start_one_worker_holding_them_all(self, monkeypatch, tmp_path):
        from cli import serve
        from worker import app as worker_app

        started: list[list[str]] = []
        monkeypatch.setenv("FTQ_DATA_DIR", str(tmp_path))
        monkeypatch.setattr(serve, "require_migrated_store", lambda settings: None)
        monkeypatch.setattr(worker_app.Celery, "worker_main", lambda self, argv: started.append(argv))
        args = build_parser().parse_args(["worker", "--gpus", "0,1", "--name", "box"])
        assert args.run(args) == 0
        (argv,) = started
        assert "--pool=threads" in argv and "--concurrency=3" in argv  # 2 GPUs + 1 export thread
        assert any(a.startswith("--queues=ftq.jobs,ftq.jobs.box.") for a in argv)

    def test_slots_give_a_cpu_pool_of_that_size(self, monkeypatch, tmp_path):
        from cli import serve
        from worker import app as worker_app

        started: list[list[str]] = []
        monkeypatch.setenv("FTQ_DATA_DIR", str(tmp_path))
        monkeypatch.setattr(serve, "require_migrated_store", lambda settings: None)
        monkeypatch.setattr(worker_app.Celery, "worker_main", lambda self, argv: started.append(argv))
        args = build_parser().parse_args(["worker", "--slots", "3"])
        assert args.run(args) == 0
        assert "--concurrency=4" in started[0]  # 3 slots + 1 export thread
