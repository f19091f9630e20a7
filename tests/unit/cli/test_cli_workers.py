"""``ftq worker --gpus``: which GPUs, one pinned worker per GPU, and the supervisor that stops them."""

from __future__ import annotations

import signal
import sys
import threading
import time

import pytest

from cli.errors import CliError
from cli.main import build_parser
from cli.supervise import ChildSpec, Supervisor
from cli.workers import parse_gpus, visible_gpus, worker_children


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

    def test_all_without_gpus_is_one_cpu_worker(self):
        assert parse_gpus("all", visible=list) == [None]

    def test_a_list(self):
        assert parse_gpus("0, 1,3") == ["0", "1", "3"]

    @pytest.mark.parametrize(("value", "says"), [("0,,1", "'' is not a GPU"), ("0,x", "'x' is not a GPU"),
                                                 ("1,1", "GPU 1 is listed twice"), ("cpu", "give `all`")])
    def test_bad_lists_say_what_to_write(self, value, says):
        with pytest.raises(CliError, match=says):
            parse_gpus(value)


class TestWorkerChildren:
    def test_one_pinned_worker_per_gpu(self):
        children = worker_children(["0", "3"], log_level="INFO", name=None, env={"CUDA_VISIBLE_DEVICES": "0,3", "X": "1"})
        assert [c.name for c in children] == ["worker gpu0", "worker gpu3"]
        assert [c.env["CUDA_VISIBLE_DEVICES"] for c in children] == ["0", "3"]
        assert children[1].argv[-3:] == ["worker", "--gpu", "3"] and children[1].env["X"] == "1"

    def test_a_name_becomes_a_prefix(self):
        (child,) = worker_children(["2"], log_level="DEBUG", name="box", env={})
        assert child.argv[-2:] == ["--name", "box/gpu2"] and "DEBUG" in child.argv

    def test_gpu_and_gpus_exclude_each_other(self, capsys):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["worker", "--gpu", "0", "--gpus", "all"])
        assert "not allowed with argument" in capsys.readouterr().err

    def test_several_gpus_start_a_supervisor_over_one_worker_each(self, monkeypatch, tmp_path):
        from cli import serve

        started: list[list[ChildSpec]] = []
        monkeypatch.setenv("FTQ_DATA_DIR", str(tmp_path))
        monkeypatch.setattr(serve, "require_migrated_store", lambda settings: None)
        monkeypatch.setattr(Supervisor, "run", lambda self: started.append(self._specs) or 0)
        args = build_parser().parse_args(["worker", "--gpus", "0,1"])
        assert args.run(args) == 0
        assert [c.env["CUDA_VISIBLE_DEVICES"] for c in started[0]] == ["0", "1"]


SLEEPER = [sys.executable, "-c", "import time\nwhile True: time.sleep(0.05)"]
STUBBORN = [sys.executable, "-c",
            "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nwhile True: time.sleep(0.05)"]


def _run_in_thread(sup: Supervisor) -> tuple[threading.Thread, list[int]]:
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(sup.run(handle_signals=False)), daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while len(sup.procs) < len(sup._specs) and time.monotonic() < deadline:
        time.sleep(0.02)
    return thread, result


class TestSupervisor:
    def test_a_stop_request_terminates_every_child_and_exits_zero(self):
        sup = Supervisor([ChildSpec("a", SLEEPER, {}), ChildSpec("b", SLEEPER, {})], grace_s=10, poll_s=0.05)
        thread, result = _run_in_thread(sup)
        sup.request_stop()
        thread.join(timeout=15)
        assert result == [0]
        assert [p.returncode for p in sup.procs.values()] == [-signal.SIGTERM, -signal.SIGTERM]

    def test_a_dead_child_stops_the_others_and_exits_nonzero(self, capsys):
        dying = [sys.executable, "-c", "raise SystemExit(3)"]
        sup = Supervisor([ChildSpec("ok", SLEEPER, {}), ChildSpec("dies", dying, {})], grace_s=10, poll_s=0.05)
        thread, result = _run_in_thread(sup)
        thread.join(timeout=15)
        assert result == [1]
        assert sup.procs["dies"].returncode == 3 and sup.procs["ok"].returncode == -signal.SIGTERM
        assert "dies exited unexpectedly (code 3)" in capsys.readouterr().err

    def test_a_child_that_ignores_sigterm_is_killed_after_the_grace_period(self, capsys):
        sup = Supervisor([ChildSpec("stubborn", STUBBORN, {})], grace_s=0.5, poll_s=0.05)
        thread, result = _run_in_thread(sup)
        time.sleep(0.3)  # let it install its handler
        started = time.monotonic()
        sup.request_stop()
        thread.join(timeout=15)
        assert result == [0] and sup.procs["stubborn"].returncode == -signal.SIGKILL
        assert time.monotonic() - started >= 0.4
        assert "did not stop in time" in capsys.readouterr().err

    def test_a_second_stop_request_kills_at_once(self):
        sup = Supervisor([ChildSpec("stubborn", STUBBORN, {})], grace_s=60, poll_s=0.05)
        thread, result = _run_in_thread(sup)
        time.sleep(0.3)
        sup.request_stop()
        time.sleep(0.2)
        sup.request_stop()
        thread.join(timeout=10)
        assert result == [0] and sup.procs["stubborn"].returncode == -signal.SIGKILL
