"""Reading the kernel's OOM-kill counters (worker/oom.py) from files shaped like the kernel's."""

from __future__ import annotations

from pathlib import Path

from worker.oom import OomCounters, OomVerdict, verdict


def kernel(tmp_path: Path, *, vmstat: int | None, events: int | None, v1: bool = False) -> dict[str, Path]:
    (tmp_path / "vmstat").write_text(f"nr_free_pages 1\noom_kill {vmstat}\n" if vmstat is not None else "nr_free_pages 1\n")
    root = tmp_path / "cgroup"
    if v1:
        (root / "memory" / "job").mkdir(parents=True, exist_ok=True)
        (root / "memory" / "job" / "memory.oom_control").write_text(f"oom_kill_disable 0\nunder_oom 0\noom_kill {events}\n")
        (tmp_path / "self").write_text("5:cpu:/\n4:memory:/job\n0::/\n")
    else:
        (root / "job").mkdir(parents=True, exist_ok=True)
        if events is not None:
            (root / "job" / "memory.events").write_text(f"low 0\nhigh 0\nmax 3\noom 1\noom_kill {events}\n")
        (tmp_path / "self").write_text("0::/job\n")
    return {"vmstat": tmp_path / "vmstat", "cgroup_root": root, "self_cgroup": tmp_path / "self"}


class TestCounters:
    def test_cgroup_v2_and_vmstat_are_read(self, tmp_path: Path) -> None:
        counters = OomCounters.read(**kernel(tmp_path, vmstat=7, events=2))
        assert (counters.system, counters.cgroup) == (7, 2)
        assert counters.cgroup_file.endswith("job/memory.events")

    def test_cgroup_v1_oom_control_is_read(self, tmp_path: Path) -> None:
        counters = OomCounters.read(**kernel(tmp_path, vmstat=None, events=4, v1=True))
        assert (counters.system, counters.cgroup) == (None, 4)

    def test_missing_files_read_as_unknown(self, tmp_path: Path) -> None:
        counters = OomCounters.read(tmp_path / "nope", tmp_path / "nope", tmp_path / "nope")
        assert (counters.system, counters.cgroup) == (None, None)

    def test_this_machine_exposes_at_least_one_counter(self) -> None:
        counters = OomCounters.read()
        assert counters.system is not None or counters.cgroup is not None


class TestVerdict:
    def test_a_moved_counter_is_an_oom_kill_naming_it(self) -> None:
        result, evidence = verdict(OomCounters(3, 0, "memory.events"), OomCounters(3, 1, "memory.events"))
        assert result is OomVerdict.oom and "memory.events oom_kill 0 -> 1" in evidence

    def test_the_system_counter_alone_is_enough(self) -> None:
        assert verdict(OomCounters(3, None), OomCounters(4, None))[0] is OomVerdict.oom

    def test_still_counters_say_the_kill_came_from_outside(self) -> None:
        result, evidence = verdict(OomCounters(3, 0, "m"), OomCounters(3, 0, "m"))
        assert result is OomVerdict.not_oom and "no OOM kill" in evidence

    def test_unreadable_counters_are_unknown(self) -> None:
        assert verdict(OomCounters(None, None), OomCounters(None, None))[0] is OomVerdict.unknown
