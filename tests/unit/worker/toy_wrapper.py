"""The toy executor's launcher (test_worker_toy_executor.py): ``toy_wrapper.py LOG COMMAND...``.

Runs COMMAND as its child (stdout and stderr inherited, so the trainer's events reach the
executor through this process), forwards SIGTERM to it, writes what happened to LOG and exits
as the child did (a child ended by signal N ends this process by signal N).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

log = open(sys.argv[1], "a", encoding="utf-8")  # noqa: SIM115 - open for the process's lifetime
child = subprocess.Popen(sys.argv[2:])
log.write(f"started {child.pid}\n")
log.flush()


def forward(signum: int, _frame: object) -> None:
    log.write(f"forwarded {signal.Signals(signum).name}\n")
    log.flush()
    child.send_signal(signum)


signal.signal(signal.SIGTERM, forward)
code = child.wait()
log.write(f"exit {code}\n")
log.close()
if code < 0:
    signal.signal(-code, signal.SIG_DFL)
    os.kill(os.getpid(), -code)
sys.exit(code)
