"""The JSON-lines event format the worker parses."""

from __future__ import annotations

import io
import json

import pytest

from trainer.events import Emitter, encode, make_event, parse_line


class TestEvents:
    def test_emitter_writes_one_parseable_line_per_event(self):
        out = io.StringIO()
        emit = Emitter(out)
        emit("log", level="info", message="hi")
        emit(
            "done",
            status="succeeded",
            error_code=None,
            message=None,
            adapter_path="a",
            steps=3,
        )
        lines = out.getvalue().splitlines()
        assert [parse_line(line)["type"] for line in lines] == ["log", "done"]
        assert parse_line(lines[1])["steps"] == 3

    def test_non_finite_floats_become_null(self):
        line = encode(
            make_event("step", loss=float("nan"), grad_norm=float("inf"), lr=1e-3)
        )
        event = json.loads(line)
        assert (
            event["loss"] is None and event["grad_norm"] is None and event["lr"] == 1e-3
        )

    def test_stray_library_output_is_not_an_event(self):
        assert parse_line("Loading weights: 100%") is None
        assert parse_line('{"type": "unknown"}') is None
        assert (
            parse_line(b'{"type":"log","time":1,"level":"info","message":"x"}')[
                "message"
            ]
            == "x"
        )

    def test_done_needs_a_known_status(self):
        with pytest.raises(ValueError, match="done.status"):
            make_event("done", status="exploded")
