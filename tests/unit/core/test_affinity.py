"""core/affinity.py: FTQ_CPUS parses core lists and pins the process (children inherit it)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from core.affinity import parse_cpus, pin_process


@pytest.mark.parametrize(("spec", "cores"), [("0", {0}), ("0-3", {0, 1, 2, 3}), ("0, 2-3", {0, 2, 3}), ("1,1", {1})])
def test_core_lists_parse(spec: str, cores: set[int]) -> None:
    assert parse_cpus(spec) == cores


@pytest.mark.parametrize(("spec", "fragment"), [("a", "core numbers"), ("1-", "core numbers"), ("3-1", "backwards"),
                                                ("", "core numbers"), ("-1", "core numbers")])
def test_bad_lists_say_what_to_write(spec: str, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        parse_cpus(spec)


def test_unset_leaves_the_process_alone() -> None:
    assert pin_process(None) is None and pin_process("  ") is None


def test_a_core_the_machine_lacks_is_refused() -> None:
    with pytest.raises(ValueError, match="none of these cores is available"):
        pin_process("4096")


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux only")
def test_the_process_and_its_children_run_on_the_named_core() -> None:
    core = min(os.sched_getaffinity(0))
    code = (
        "import os, subprocess, sys; from core.affinity import pin_process; pin_process(sys.argv[1]); "
        "print(sorted(os.sched_getaffinity(0))); "
        "print(subprocess.run([sys.executable, '-c', 'import os; print(sorted(os.sched_getaffinity(0)))'], "
        "capture_output=True, text=True).stdout.strip())"
    )
    out = subprocess.run([sys.executable, "-c", code, str(core)], capture_output=True, text=True, check=True).stdout
    assert out.split() == [f"[{core}]", f"[{core}]"]


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or (os.cpu_count() or 1) < 2, reason="Linux, 2+ cores")
def test_a_child_pinned_to_one_core_may_move_to_another() -> None:
    code = ("import os, sys; from core.affinity import pin_process; pin_process('0'); "
            "pin_process(sys.argv[1]); print(sorted(os.sched_getaffinity(0)))")
    last = str((os.cpu_count() or 2) - 1)
    out = subprocess.run([sys.executable, "-c", code, last], capture_output=True, text=True, check=True).stdout
    assert out.strip() == f"[{last}]"

