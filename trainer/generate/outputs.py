"""A generation job's output on disk, and how a resumed run knows what is done (standard library only).

While the job runs, rank ``r`` appends its finished prompts' lines to
``completions.parts/rank-<r>.jsonl``, a whole chunk per write, flushed and fsynced; each line
carries its prompt's ``index``. A prompt is done when its line is in some part file (or in
``completions.jsonl``): a cancelled or lost run resumes with the prompts that are not, so nothing
is generated twice. A line cut short by a crash is dropped when its rank reopens its file. When
every rank is done, rank 0 writes ``completions.jsonl`` (every line, in prompt order) through a
temporary file and a rename, then removes the parts.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def part_path(parts_dir: Path, rank: int) -> Path:
    return parts_dir / f"rank-{rank}.jsonl"


def _line_files(completions: Path, parts_dir: Path) -> list[Path]:
    parts = sorted(parts_dir.glob("rank-*.jsonl")) if parts_dir.is_dir() else []
    return ([completions] if completions.is_file() else []) + parts


def read_lines(completions: Path, parts_dir: Path) -> dict[int, dict[str, Any]]:
    """Every whole line written so far, by prompt index (a torn last line is skipped)."""
    done: dict[int, dict[str, Any]] = {}
    for path in _line_files(completions, parts_dir):
        text = path.read_text(encoding="utf-8")
        for raw in text.split("\n")[:-1]:  # the piece after the last newline is torn or empty
            if raw:
                line = json.loads(raw)
                done.setdefault(int(line["index"]), line)
    return done


def open_part(parts_dir: Path, rank: int) -> Any:
    """This rank's part file for appending, a torn last line (a crash mid-write) cut off first."""
    parts_dir.mkdir(parents=True, exist_ok=True)
    path = part_path(parts_dir, rank)
    if path.is_file():
        data = path.read_bytes()
        whole = data.rfind(b"\n") + 1
        if whole != len(data):
            with open(path, "r+b") as handle:
                handle.truncate(whole)
    return open(path, "a", encoding="utf-8")


def append(handle: Any, lines: list[dict[str, Any]]) -> None:
    """Write ``lines`` (one chunk) at once and make them durable before the run goes on."""
    handle.write("".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines))
    handle.flush()
    os.fsync(handle.fileno())


def merge(completions: Path, parts_dir: Path, total: int) -> int:
    """Write ``completions`` from every line, in prompt order, and remove the parts; returns the
    number of lines.

    Raises:
        RuntimeError: some prompt of ``range(total)`` has no line (a rank stopped early).
    """
    done = read_lines(completions, parts_dir)
    missing = [i for i in range(total) if i not in done]
    if missing:
        raise RuntimeError(f"{len(missing)} prompt(s) have no completion (first: {missing[0]}); resume the job")
    tmp = completions.with_suffix(".jsonl.tmp")
    with open(tmp, "w", encoding="utf-8") as handle:
        for index in range(total):
            handle.write(json.dumps(done[index], ensure_ascii=False) + "\n")
        handle.flush()
        os.fsync(handle.fileno())
    tmp.replace(completions)
    if parts_dir.is_dir():
        for path in parts_dir.glob("rank-*.jsonl"):
            path.unlink()
        parts_dir.rmdir()
    return total


class Progress:
    """Counts the lines and completion tokens every rank has written, reading only what is new."""

    def __init__(self, completions: Path, parts_dir: Path) -> None:
        self.completions, self.parts_dir = completions, parts_dir
        self._offsets: dict[Path, int] = {}
        self.prompts = 0
        self.tokens = 0

    def update(self) -> tuple[int, int]:
        """``(prompts done, completion tokens written)`` over every file, now."""
        for path in _line_files(self.completions, self.parts_dir):
            start = self._offsets.get(path, 0)
            with open(path, "rb") as handle:
                handle.seek(start)
                data = handle.read()
            whole = data.rfind(b"\n") + 1
            for raw in data[:whole].splitlines():
                if raw:
                    self.prompts += 1
                    self.tokens += int(json.loads(raw).get("usage", {}).get("completion_tokens", 0))
            self._offsets[path] = start + whole
        return self.prompts, self.tokens
