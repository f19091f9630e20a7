"""The JSON-lines event format the worker parses."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import json
import textwrap

import pytest

from trainer import objectives
from trainer.events import BASE_STEP_FIELDS, STEP_FIELDS, Emitter, StepEvent, encode, make_event, parse_line


def _step_event(**values: object) -> StepEvent:
    fields = {name: None for name in BASE_STEP_FIELDS}
    fields.update(step=1, total_steps=10, epoch=0.1, lr=1e-3, tokens=64, sequences=2, step_ms=10.0,
                  data_ms=1.0, forward_ms=4.0, backward_ms=4.0, optimizer_ms=1.0)
    fields.update(values)
    return StepEvent(**fields)


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
        step = _step_event(loss=float("nan"), grad_norm=float("inf"), lr=1e-3)
        line = encode(make_event("step", **step.fields()))
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


class TestStepEvent:
    def test_step_fields_are_the_dataclass_fields_then_the_objectives_in_order(self):
        assert BASE_STEP_FIELDS == tuple(f.name for f in dataclasses.fields(StepEvent))[:-1]
        assert STEP_FIELDS == BASE_STEP_FIELDS + objectives.metric_names()
        assert STEP_FIELDS[:3] == ("step", "total_steps", "epoch") and BASE_STEP_FIELDS[-2:] == ("host_rss", "ranks")
        assert {"token_accuracy", "reward_margin", "reward_accuracy", "chosen_logp", "rejected_logp"} <= set(STEP_FIELDS)

    def test_every_field_has_a_one_line_docstring(self):
        body = ast.parse(textwrap.dedent(inspect.getsource(StepEvent))).body[0].body
        documented = [
            field.target.id
            for field, doc in zip(body, body[1:])
            if isinstance(field, ast.AnnAssign)
            and isinstance(doc, ast.Expr)
            and isinstance(doc.value, ast.Constant)
            and "\n" not in doc.value.value
        ]
        assert tuple(documented) == (*BASE_STEP_FIELDS, "metrics")

    def test_a_step_built_from_the_dataclass_round_trips(self):
        step = _step_event(loss=2.5, mfu=0.4, metrics={"reward_margin": 0.25})
        event = parse_line(encode(make_event("step", **step.fields())))
        assert event["reward_margin"] == 0.25 and event["token_accuracy"] is None
        assert StepEvent.of(event) == step

    def test_a_metric_no_objective_declares_is_refused_by_name(self):
        with pytest.raises(ValueError, match=r"step\.loss_scale: no registered objective"):
            _step_event(metrics={"loss_scale": 1.0}).fields()

    def test_an_unknown_step_field_is_refused_by_name(self):
        payload = _step_event().fields() | {"loss_scale": 1.0}
        with pytest.raises(ValueError, match=r"step\.loss_scale: not a field of StepEvent"):
            make_event("step", **payload)

    def test_a_missing_step_field_is_refused_by_name(self):
        payload = _step_event().fields()
        del payload["gpu_mem_peak"]
        with pytest.raises(ValueError, match=r"step\.gpu_mem_peak: missing"):
            make_event("step", **payload)
