"""``ftq submit``: a YAML job file's ``5e-4`` is a number (the API's job spec refuses strings for
numbers, issue 22 item 9), and the preflight's warnings are printed to stderr after the job id."""

from __future__ import annotations

import contextlib

import pytest

from cli.jobs import read_yaml
from cli.main import build_parser


class TestYamlNumbers:
    def test_exponent_numbers_without_a_dot_are_floats(self):
        assert read_yaml("learning_rate: 5e-4\nbig: 1E6\nneg: -3e+2\ndotted: 2.0e-4\nsteps: 12") == {
            "learning_rate": 5e-4, "big": 1e6, "neg": -300.0, "dotted": 2e-4, "steps": 12}

    def test_quoted_and_other_text_stays_text(self):
        assert read_yaml('a: "5e-4"\nb: 1e5x\nc: e5\nname: lr 5e-4') == {"a": "5e-4", "b": "1e5x", "c": "e5",
                                                                        "name": "lr 5e-4"}


def test_the_preflight_warnings_go_to_stderr_after_the_job_id(api, job_file, monkeypatch: pytest.MonkeyPatch,
                                                              capsys):
    from cli import jobs

    text = job_file.read_text().replace("max_steps: 5", "max_steps: 1000000")
    job_file.write_text(text.replace("hyperparameters:\n", "hyperparameters:\n  learning_rate: 5e-4\n") +
                        "name: lr 5e-4\n")
    monkeypatch.setattr(jobs, "connect", lambda: contextlib.nullcontext(api))
    args = build_parser().parse_args(["submit", str(job_file)])
    assert args.run(args) == 0
    out = capsys.readouterr()
    job = api.get(f"/v1/jobs/{out.out.strip()}").json()
    assert job["spec"]["hyperparameters"]["learning_rate"] == 5e-4 and job["name"] == "lr 5e-4"
    warnings = [line for line in out.err.splitlines() if line.startswith("warning: ")]
    assert any(line.startswith("warning: max_steps 1000000 repeats the training file about 1,000,000 times")
               for line in warnings), out.err
