"""The python grader's child process: ``python -I -S sandbox_child.py`` (run by ``sandbox.py``).

It reads ``{"source", "sample", "item", "limits"}`` as JSON on stdin, then, in this order:
imports what it and the grader may use, sets its resource limits, installs an audit hook that
refuses every file, process, network and foreign-function operation, and only then compiles and
runs the user's ``grade(sample, item)``. It writes one JSON line to stdout: ``{"ok": true,
"score": float, "log": str}`` or ``{"ok": false, "kind": str, "error": str, "log": str}``.
Standard library only, and nothing from ftq: it runs with no ``sys.path`` entries of the service.
"""

import collections  # noqa: F401  (pre-imported: the grader may import these without opening a file)
import datetime  # noqa: F401
import decimal  # noqa: F401
import difflib  # noqa: F401
import fractions  # noqa: F401
import functools  # noqa: F401
import io
import itertools  # noqa: F401
import json
import math
import os
import random  # noqa: F401
import re  # noqa: F401
import resource
import statistics  # noqa: F401
import string  # noqa: F401
import sys
import time  # noqa: F401
import typing  # noqa: F401
import unicodedata  # noqa: F401

OFFERED = ("collections", "datetime", "decimal", "difflib", "fractions", "functools", "itertools", "json", "math",
           "random", "re", "statistics", "string", "time", "typing", "unicodedata")
REFUSED_PREFIXES = ("open", "os.", "socket.", "subprocess.", "ctypes.", "shutil.", "pty.", "fcntl.", "mmap.",
                    "sys.addaudithook", "resource.", "signal.", "urllib.", "http.", "ftplib.", "smtplib.",
                    "glob.", "tempfile.", "sqlite3.", "webbrowser.", "winreg.", "_posixsubprocess", "marshal.load",
                    "pickle.find_class", "cpython.run_", "sys.remote_exec")


class Refused(PermissionError):
    pass


class OutputCapped(Exception):
    pass


class _Capped(io.TextIOBase):
    """The grader's stdout and stderr: kept up to ``limit`` characters, then an error."""

    def __init__(self, limit: int) -> None:
        self.parts: list[str] = []
        self.size = 0
        self.limit = limit

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self.size += len(text)
        if self.size > self.limit:
            raise OutputCapped(f"the grader printed more than {self.limit} characters")
        self.parts.append(text)
        return len(text)


def _install_audit_hook(refusals: list[str]) -> None:
    """Refuse files, processes, network and imports of modules not loaded now, from here on.

    The hook reads only its closure's immutable values (a frozenset, tuples, a string), and nothing
    the grader can reach refers to it (the interpreter keeps it; ``gc`` cannot be imported), so
    rebinding this module's globals from the grader changes nothing. Every refusal is appended to
    ``refusals``: a grader that catches one still fails its item.
    """
    allowed, prefixes, offered, refused = frozenset(sys.modules), REFUSED_PREFIXES, ", ".join(OFFERED), Refused

    def hook(event: str, args: tuple) -> None:
        if event == "import":
            if args[0] not in allowed and args[0].split(".")[0] not in allowed:
                refusals.append(f"import of {args[0]!r} is not allowed in a python grader (it may import {offered})")
                raise refused(refusals[-1])
        elif event == "object.__setattr__" and args[1] == "__code__" or event == "code.__new__":
            # bytecode of one's own making can corrupt memory, and with it the hook
            refusals.append(f"{event} is not allowed in a python grader: no new bytecode")
            raise refused(refusals[-1])
        elif event.startswith(prefixes):
            shown = f"{event}({args[0]!r})" if args and isinstance(args[0], (str, bytes, int)) else event
            refusals.append(f"{shown} is not allowed in a python grader: no files, processes or network")
            raise refused(refusals[-1])

    sys.addaudithook(hook)


def _limit(limits: dict) -> None:
    cpu = int(limits["cpu_s"])
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))  # past it SIGXCPU, then SIGKILL
    resource.setrlimit(resource.RLIMIT_AS, (limits["memory_bytes"], limits["memory_bytes"]))
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))  # no effect for root: the audit hook refuses fork


def _run(job: dict, log: _Capped, refusals: list[str]) -> dict:
    namespace: dict = {"__name__": "grader", "__builtins__": __builtins__}
    sys.stdout = sys.stderr = log
    try:
        exec(compile(job["source"], "<grader>", "exec"), namespace)
        score = namespace["grade"](job["sample"], job["item"])
    except MemoryError:
        return {"ok": False, "kind": "memory", "error": f"the grader ran out of memory (limit "
                f"{job['limits']['memory_bytes'] // 2**20} MiB)"}
    except OutputCapped as exc:
        return {"ok": False, "kind": "output", "error": str(exc)}
    except Refused as exc:
        return {"ok": False, "kind": "refused", "error": str(exc)}
    except BaseException as exc:  # noqa: BLE001 - the grader's own error, shown for its item
        if refusals:
            return {"ok": False, "kind": "refused", "error": refusals[0]}
        return {"ok": False, "kind": "runtime", "error": f"{type(exc).__name__}: {exc}{_grader_line(exc)}"[:2000]}
    finally:
        sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
    if refusals:
        return {"ok": False, "kind": "refused", "error": refusals[0]}
    if isinstance(score, bool) or not isinstance(score, (int, float)) or not math.isfinite(score):
        return {"ok": False, "kind": "runtime", "error": f"grade() must return a finite number, got {score!r}"[:500]}
    return {"ok": True, "score": float(score)}


def _grader_line(exc: BaseException) -> str:
    """`` (line N)`` of the grader's last frame; walks the traceback itself (``traceback`` would
    read this file's lines, and opening files is refused by now)."""
    line, tb = None, exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<grader>":
            line = tb.tb_lineno
        tb = tb.tb_next
    return f" (line {line})" if line else ""


def main() -> None:
    job = json.loads(sys.stdin.read())
    sys.stdin.close()
    os.chdir(job["limits"]["workdir"])
    _limit(job["limits"])
    log = _Capped(job["limits"]["log_chars"])
    refusals: list[str] = []
    _install_audit_hook(refusals)
    out = _run(job, log, refusals)
    out["log"] = "".join(log.parts)
    sys.__stdout__.write(json.dumps(out) + "\n")
    sys.__stdout__.flush()


if __name__ == "__main__":
    main()
