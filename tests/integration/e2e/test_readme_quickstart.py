"""README.md's quickstart, run as written, so it cannot rot.

The README's ``bash`` blocks under "Quickstart" (its subsections "Put ftq on your PATH" and "A first
job" included) are read from the file and run literally, in one ``bash -e -o pipefail``: every
command must exit 0. ``make up`` and ``make test`` are the two lines not run (one would start a
second service, the other this suite again); ``make up`` is stood in for by what it runs,
``.venv/bin/ftq up``, on a fresh account: ``HOME`` is a tmp directory, so the data directory, the
model root (which ``ftq up`` seeds with the demo model ``tiny-llama``) and the client config are the
defaults the README names, empty as on a new machine. The blocks run in the second terminal the
README asks for: no ``FTQ_*`` variable, ``.venv/bin`` not on ``PATH`` until the README's own line
puts it there (run from the checkout, as the README says; the first job then runs in a scratch
directory, not to litter the checkout). The service must end with ``ftq up``'s box and the README's
first job must have succeeded, with its adapter downloaded.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from tests.fixtures.stack import KEY_PATTERN, STACK_ENV, Stack, free_port

ROOT = Path(__file__).resolve().parents[3]
VENV_BIN = ROOT / ".venv" / "bin"
NOT_RUN = re.compile(r"^make (up|test)\b")
"""The quickstart's own two commands: what they run is the service below and this suite."""


def quickstart_blocks(readme: str) -> list[tuple[str, str]]:
    """``(heading, code)`` of each fenced ``bash`` block from "## Quickstart" to the next ``## `` heading."""
    section = re.search(r"^## Quickstart\n(.*?)(?=^## )", readme, re.M | re.S)
    assert section, "README.md has no '## Quickstart' section"
    blocks, heading = [], "Quickstart"
    for match in re.finditer(r"^(#{3,} [^\n]*)$|^```bash\n(.*?)^```$", section.group(1), re.M | re.S):
        if match.group(1):
            heading = match.group(1).lstrip("# ")
        else:
            blocks.append((heading, match.group(2)))
    return blocks


def without_make(code: str) -> str:
    return "\n".join(line for line in code.splitlines() if not NOT_RUN.match(line))


def clean_path() -> str:
    """This machine's PATH without the venv: the README's line must be what finds ``ftq``."""
    drop = {str(VENV_BIN), str(Path(sys.executable).parent)}
    return os.pathsep.join(d for d in os.environ.get("PATH", "").split(os.pathsep) if d and d not in drop)


def test_the_quickstart_blocks_are_the_two_make_commands_then_path_then_a_first_job():
    blocks = quickstart_blocks((ROOT / "README.md").read_text())
    made = [line.split("#")[0].strip() for _, code in blocks for line in code.splitlines() if NOT_RUN.match(line)]
    assert made == ["make up", "make test"], blocks
    headings = [heading for heading, code in blocks if without_make(code).strip()]
    assert headings == ["Put `ftq` on your PATH", "A first job"], headings
    first_job = dict(blocks)["A first job"]
    assert "ftq submit" in first_job and "ftq logs" in first_job and "ftq download" in first_job


@pytest.mark.integration
@pytest.mark.slow
def test_the_readme_quickstart_runs_as_written(tmp_path: Path):
    assert (VENV_BIN / "ftq").is_file(), f"the README puts {VENV_BIN} on PATH, but it holds no ftq: run `make up` once"
    home, scratch = tmp_path / "home", tmp_path / "first-job"
    home.mkdir()
    scratch.mkdir()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("FTQ_") and k not in ("XDG_CONFIG_HOME", "XDG_DATA_HOME", "VIRTUAL_ENV")}
    env.update(STACK_ENV, HOME=str(home), PATH=clean_path())
    port = free_port()
    stack = Stack("readme", f"http://127.0.0.1:{port}", home / ".local" / "share" / "ftq",
                  home / ".local" / "share" / "ftq" / "models")
    stack.data_dir.parent.mkdir(parents=True)  # the log goes beside the data directory
    stack.start("up", [str(VENV_BIN / "ftq"), "up"], {**env, "FTQ_PORT": str(port)})  # what `make up` runs
    try:
        box = _wait_for_box(stack)
        assert f"{stack.url}/docs" in box and KEY_PATTERN.search(box), box
        assert f'export PATH="{VENV_BIN}:$PATH"' in box, box

        script = [f"cd {shlex.quote(str(ROOT))}"]  # the README: from the checkout
        for heading, code in quickstart_blocks((ROOT / "README.md").read_text()):
            if heading == "A first job":
                script.append(f"cd {shlex.quote(str(scratch))}")
            script.append(without_make(code))
        done = subprocess.run(["bash", "-e", "-o", "pipefail", "-x", "-c", "\n".join(script)], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=300, check=False)
        assert done.returncode == 0, (f"a README quickstart command failed (exit {done.returncode}):\n"
                                      f"--- stdout\n{done.stdout}\n--- stderr (bash -x)\n{done.stderr}\n"
                                      f"{stack.log_tail()}")

        stack.api_key = KEY_PATTERN.search(box).group(0)
        with stack.client() as client:
            jobs = client.get("/v1/jobs").json()["data"]
        assert [(job["model"], job["status"]) for job in jobs] == [("tiny-llama", "succeeded")], jobs
        zips = list(scratch.glob("*.zip"))
        assert len(zips) == 1 and zipfile.is_zipfile(zips[0]), list(scratch.iterdir())
    finally:
        codes = stack.stop()
    assert codes["up"] == 0, f"ftq up did not stop cleanly: {codes}\n{stack.log_tail()}"


def _wait_for_box(stack: Stack, timeout_s: float = 180.0) -> str:
    """The box ``ftq up`` prints last, once the service answers (the lines from its first frame on)."""
    deadline = time.monotonic() + timeout_s
    log = stack.logs["up"]
    while time.monotonic() < deadline:
        if stack.procs["up"].poll() is not None:
            raise AssertionError(f"ftq up exited with {stack.procs['up'].returncode}\n{stack.log_tail()}")
        text = log.read_text(errors="replace") if log.exists() else ""
        box = re.search(r"^\+-+\+\n.*?^\+-+\+$", text, re.M | re.S)
        if box:
            return box.group(0)
        time.sleep(0.3)
    raise AssertionError(f"ftq up printed no box in {timeout_s:.0f}s\n{stack.log_tail()}")
