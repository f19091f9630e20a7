"""``ftq export`` / ``ftq exports``: what is decided before any request (the rest runs end to end
in tests/integration/e2e/test_jobs_e2e.py)."""

from __future__ import annotations

import pytest

from cli.exports import default_name
from cli.main import main


def test_quantization_is_refused_for_a_merged_export(capsys) -> None:
    assert main(["export", "job-x", "--format", "merged", "--quantization", "q8_0"]) == 2
    assert "--quantization is for --format gguf only" in capsys.readouterr().err


def test_an_unknown_quantization_is_refused_by_the_parser(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["export", "job-x", "--format", "gguf", "--quantization", "q4_k"])
    assert exc.value.code == 2
    assert "invalid choice: 'q4_k'" in capsys.readouterr().err


def test_default_file_names_say_what_was_exported() -> None:
    assert default_name({"job_id": "job-1", "format": "gguf", "quantization": "q8_0"}) == "job-1-gguf-q8_0.gguf"
    assert default_name({"job_id": "job-1", "format": "merged", "quantization": None}) == "job-1-merged.zip"
