"""The python grader's sandbox: each limit fails only that call, with a message (short limits)."""

from __future__ import annotations

import pytest

from trainer.graders.sandbox import PythonOutcome, SandboxLimits, run_python

LIMITS = SandboxLimits(cpu_s=1, wall_s=3.0, memory_bytes=256 << 20, output_bytes=1 << 20, log_chars=10_000)
SAMPLE = {"output_text": "Paris", "output_json": None}


def run(body: str, limits: SandboxLimits = LIMITS) -> PythonOutcome:
    source = "import os, sys, time, json\n\ndef grade(sample, item):\n" + "".join(f"    {line}\n" for line in body.splitlines())
    return run_python(source, SAMPLE, {"answer": "Paris"}, limits)


class TestGrades:
    def test_a_grade_with_its_print_output(self) -> None:
        outcome = run("print('checking', item['answer'])\nreturn 1.0 if sample['output_text'] == item['answer'] else 0")
        assert (outcome.score, outcome.error, outcome.log) == (1.0, None, "checking Paris\n")

    def test_the_graders_exception_names_its_line(self) -> None:
        outcome = run("x = 1\nreturn x / 0")
        assert outcome.score is None and outcome.kind == "runtime"
        assert outcome.error == "ZeroDivisionError: division by zero (line 5)"

    def test_a_non_number_is_an_error(self) -> None:
        assert "must return a finite number, got 'yes'" in run("return 'yes'").error


class TestLimits:
    def test_a_loop_is_killed_at_its_cpu_limit(self) -> None:
        outcome = run("while True:\n    pass")
        assert outcome.score is None and outcome.kind in ("cpu", "wall"), outcome
        assert "limit" in outcome.error and "killed" in outcome.error

    def test_a_sleep_is_killed_at_the_wall_time_limit(self) -> None:
        outcome = run("time.sleep(60)", SandboxLimits(cpu_s=5, wall_s=1.5))
        assert (outcome.kind, outcome.error) == ("wall", "the grader ran past its wall-time limit of 1.5 s and was killed")
        assert outcome.seconds < 5

    def test_ten_gigabytes_is_a_memory_error(self) -> None:
        outcome = run("block = bytearray(10 * 2**30)\nreturn 1.0")
        assert (outcome.kind, outcome.error) == ("memory", "the grader ran out of memory (limit 256 MiB)")

    def test_printing_100_mb_fails_the_item(self) -> None:
        outcome = run("print('x' * (100 * 2**20))\nreturn 1.0")
        assert (outcome.kind, outcome.error) == ("output", "the grader printed more than 10000 characters")

    def test_writing_100_mb_to_the_raw_stdout_is_killed(self) -> None:
        outcome = run("os.write(1, b'x' * (100 * 2**20))\nreturn 1.0")
        assert outcome.kind == "output" and "more than 1048576 bytes" in outcome.error

    @pytest.mark.parametrize(("body", "says"), [
        ("return len(open('/etc/passwd').read())", "open('/etc/passwd') is not allowed"),
        ("open('out.txt', 'w').write('x')\nreturn 1.0", "open('out.txt') is not allowed"),
        ("import socket\nreturn 1.0", "import of 'socket' is not allowed"),
        ("import ctypes\nreturn 1.0", "import of 'ctypes' is not allowed"),
        ("import subprocess\nreturn 1.0", "import of 'subprocess' is not allowed"),
        ("os.fork()\nreturn 1.0", "os.fork is not allowed"),
        ("sys.modules['posix'].fork()\nreturn 1.0", "os.fork is not allowed"),
        ("os.system('id')\nreturn 1.0", "os.system(b'id') is not allowed"),
        ("os.execv('/bin/sh', ['sh'])", "os.exec"),
        ("os.posix_spawn('/bin/true', ['true'], {})", "os.posix_spawn"),
        ("os.listdir('/')", "os.listdir('/') is not allowed"),
        ("import resource\nresource.setrlimit(resource.RLIMIT_CPU, (100, 100))", "resource.setrlimit"),
        ("try:\n    open('/etc/passwd')\nexcept Exception:\n    pass\nreturn 1.0", "open('/etc/passwd') is not allowed"),
    ])
    def test_files_processes_and_network_are_refused(self, body: str, says: str) -> None:
        outcome = run(body)
        assert outcome.score is None and outcome.kind == "refused", outcome
        assert says in outcome.error

    def test_rebinding_the_runners_globals_does_not_lift_the_hook(self) -> None:
        body = ("main = sys.modules['__main__']\nmain.REFUSED_PREFIXES = ('nothing',)\nmain.OFFERED = ()\n"
                "return len(open('/etc/passwd').read())")
        outcome = run(body)
        assert outcome.kind == "refused" and "open('/etc/passwd') is not allowed" in outcome.error

    @pytest.mark.parametrize("body", ["f = lambda: 0\nf.__code__ = (lambda: 1).__code__",
                                      "code = (lambda: 0).__code__.replace(co_consts=(1,))"])
    def test_no_new_bytecode(self, body: str) -> None:
        outcome = run(body + "\nreturn 1.0")
        assert outcome.kind == "refused" and "no new bytecode" in outcome.error

    def test_gc_cannot_be_imported_to_find_the_hook(self) -> None:
        assert "import of 'gc' is not allowed" in run("import gc\nreturn 1.0").error

    def test_a_refusal_fails_one_call_and_the_next_grades(self) -> None:
        assert run("os.fork()").score is None
        assert run("return 0.25").score == 0.25
