"""A generation job resumed on a remote worker starts from the lines the API holds: the parts an
earlier attempt uploaded (maybe from another machine) are merged into this machine's, each prompt once."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from trainer.generate import outputs
from worker.remote_generation import FETCHED_PART, fetch_parts
from worker.transfer import TransferNotFound


class _Api:
    """The API's side of one job's ``completions.parts``: None while nothing was uploaded."""

    def __init__(self, parts: dict[str, str] | None) -> None:
        self.parts = parts

    def download_artifact(self, job_id: str, path: str, dest: Path) -> Path:
        assert (job_id, path) == ("job-1", "completions.parts")
        if self.parts is None:
            raise TransferNotFound("404")
        dest.mkdir(parents=True)
        for name, text in self.parts.items():
            (dest / name).write_text(text)
        return dest


def _lines(*indices: int) -> str:
    return "".join(json.dumps({"index": i, "usage": {"completion_tokens": 2}}) + "\n" for i in indices)


def test_the_apis_lines_this_machine_lacks_are_added_once(tmp_path: Path):
    claim = SimpleNamespace(job_id="job-1", output_dir=tmp_path)
    parts = tmp_path / "completions.parts"
    parts.mkdir()
    (parts / "rank-0.jsonl").write_text(_lines(0, 1))  # this machine's own first attempt
    api = _Api({"rank-0.jsonl": _lines(0, 1, 2, 3) + '{"index": 4, "us', "rank-fetched.jsonl": _lines(5)})
    assert fetch_parts(api, claim) == 3  # 2, 3 and 5; the torn line of 4 is not a line
    assert (parts / FETCHED_PART).read_text() == _lines(2, 3, 5)
    assert sorted(outputs.read_lines(tmp_path / "completions.jsonl", parts)) == [0, 1, 2, 3, 5]
    assert outputs.Progress(tmp_path / "completions.jsonl", parts).update() == (5, 10)  # nothing counted twice
    assert fetch_parts(api, claim) == 0  # again: nothing new
    assert fetch_parts(_Api(None), SimpleNamespace(job_id="job-1", output_dir=tmp_path / "fresh")) == 0
