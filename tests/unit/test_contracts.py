"""Contracts that cross a process boundary: each is defined once, and these tests fail when a copy
that cannot derive from it drifts.

    step event   trainer.events.StepEvent -> worker.recorder's rows, core StepMetric and its
                 migration, api MetricOut, the SSE ``step`` payload, the dashboard's chart keys
    objectives   trainer.objectives' registry (names, step fields, charts, sections) -> the step
                 event, the store's metrics JSON, MetricOut, SSE, the charts in /openapi.json,
                 the trackers, the job spec
    plan event   what the trainer prints (``detect --json``, the run's ``plan`` event) -> api PlanOut
    switches     trainer.config.Optimizations -> core OptimizationSwitches -> /openapi.json -> the form
    layout       trainer.training.layout -> trainer.training.checkpoint, worker.runner, the adapter download
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import JSON, BigInteger, Engine, Float, Integer, inspect

from api.jobs.schemas import DecisionOut, MetricOut, PlanOut
from api.jobs.sse import format_event
from core.db import make_engine, make_sessionmaker, new_id, utcnow
from core.files.models import File
from core.jobs import service
from core.jobs.models import Job, StepMetric
from core.jobs.spec import SECTIONS, JobSpec, OptimizationSwitches
from core.migrate import upgrade
from trainer.training import layout
from trainer import objectives
from trainer.config import SWITCH_VALUES, SWITCHES, TrainConfig, switch_docs
from trainer.events import BASE_STEP_FIELDS, STEP_FIELDS, StepEvent, make_event
from worker.recorder import apply_events
from worker.tracking.mlflow import STEP_METRICS

REPO = Path(__file__).resolve().parents[2]
STATIC = REPO / "api" / "web" / "static"

STORE_LEAVES_OUT = {"total_steps": "kept once per job, in job.total_steps"}
"""Step fields the store does not keep per row, and why."""
ROW_ONLY = {"job_id", "time", "metrics"}
"""Columns of a step row that are not step fields: the job it belongs to, the event's time, the
objectives' step fields (one JSON column: ``METRICS``)."""
DERIVED_SERIES = {
    "eval_loss": "the eval event's loss, drawn on the loss chart",
    "other_ms": "step_ms minus its measured parts",
}
"""Chart series the dashboard computes instead of reading from a step row."""
KERNEL_CHOICES = ("attention", "loss", "lora_kernel", "fused_ops", "parallelism")
"""The plan's decisions before the activation policy, in order (the agreed plan event; parallelism
since the trainer runs several ranks: None/ddp/fsdp2)."""
POLICY = "gradient_checkpointing"
"""The activation policy's decision (``auto | on | off | selective``), before the switches."""


def _base_type(hint: Any) -> type:
    """``int`` for ``int`` and ``int | None``; ``list`` for ``list[dict[str, Any]] | None``."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        assert len(args) == 1, hint
        hint = args[0]
    return typing.get_origin(hint) or hint


STEP_TYPES = {name: _base_type(hint) for name, hint in typing.get_type_hints(StepEvent).items() if name != "metrics"}
STORED = set(BASE_STEP_FIELDS) - set(STORE_LEAVES_OUT)
"""The step fields with a column of their own."""
METRICS = set(objectives.metric_names())
"""The objectives' step fields (floats), kept in ``step_metric.metrics``."""


RANK = {"rank": 0, "step_ms": 1.5, "data_ms": 0.1, "forward_ms": 0.5, "backward_ms": 0.7, "optimizer_ms": 0.2,
        "tokens": 64, "gpu_mem_allocated": 10, "gpu_mem_reserved": 20, "gpu_mem_peak": 30, "gpu_alloc_retries": 5,
        "host_rss": 40}
"""One entry of a step's ``ranks`` (StepEvent.ranks documents the keys)."""


def a_step(step: int = 3) -> StepEvent:
    """A step with a distinct value in every field, so a field sent to the wrong place shows."""
    values: dict[str, Any] = {}
    for i, name in enumerate(BASE_STEP_FIELDS):
        if STEP_TYPES[name] is list:
            values[name] = [{**RANK, "rank": r, "tokens": 64 + i + r} for r in range(2)]
        else:
            values[name] = (1000 + i) if STEP_TYPES[name] is int else (0.5 + i)
    metrics = {name: 0.25 + i for i, name in enumerate(objectives.metric_names())}  # every objective's: none is dropped
    return StepEvent(**{**values, "step": step, "total_steps": 10}, metrics=metrics)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    url = f"sqlite:///{tmp_path_factory.mktemp('store') / 'ftq.db'}"
    upgrade(url)
    engine = make_engine(url)
    yield engine
    engine.dispose()


def _insert_job(engine: Engine) -> str:
    job_id, file_id = new_id("job"), new_id("file")
    with make_sessionmaker(engine).begin() as session:
        session.add(File(file_id=file_id, filename="d.jsonl", purpose="train", bytes=1, sha256="0" * 64,
                         format="text", num_records=1, path="/dev/null", stats={}, created_at=utcnow()))
        session.flush()
        session.add(Job(job_id=job_id, model="tiny", method="lora", spec={}, training_file_id=file_id,
                        created_at=utcnow(), updated_at=utcnow()))
    return job_id


class TestStepEvent:
    def test_store_columns_are_the_step_fields_it_keeps(self) -> None:
        columns = {c.name for c in StepMetric.__table__.columns}
        assert columns - ROW_ONLY == STORED, "StepMetric must have one column per StepEvent field it keeps"
        assert isinstance(StepMetric.__table__.columns["metrics"].type, JSON), "the objectives' fields: one JSON column"

    def test_store_column_types_follow_the_step_types(self) -> None:
        for name in STORED:
            column = StepMetric.__table__.columns[name]
            expected = {int: (Integer, BigInteger), float: (Float,), list: (JSON,)}[STEP_TYPES[name]]
            assert isinstance(column.type, expected), f"step_metric.{name} is {column.type}, StepEvent says {STEP_TYPES[name]}"
            assert column.nullable == (not column.primary_key), f"step_metric.{name}: only the key may be NOT NULL"

    def test_migrations_at_head_create_exactly_the_models_columns(self, engine: Engine) -> None:
        migrated = {c["name"] for c in inspect(engine).get_columns("step_metric")}
        assert migrated == {c.name for c in StepMetric.__table__.columns}

    def test_metric_out_has_the_stored_fields_with_the_step_types(self) -> None:
        assert set(MetricOut.model_fields) - ROW_ONLY == STORED | METRICS
        for name in STORED:
            annotation = MetricOut.model_fields[name].annotation
            assert _base_type(annotation) is STEP_TYPES[name], f"MetricOut.{name} is {annotation}"
        for name in METRICS:
            assert _base_type(MetricOut.model_fields[name].annotation) is float, name

    def test_a_step_goes_from_trainer_to_store_to_api_and_sse_unchanged(self, engine: Engine) -> None:
        step = a_step()
        event = make_event("step", **step.fields())
        job_id = _insert_job(engine)
        with make_sessionmaker(engine).begin() as session:
            apply_events(session, job_id, [event])
        with make_sessionmaker(engine)() as session:
            [row] = service.list_metrics(session, job_id, after_step=0, limit=10)
            [stored] = [e for e in service.events_after(session, job_id, 0) if e.type == "step"]
            metric = MetricOut.of(row).model_dump()
            sse = format_event(stored.seq, stored.type, stored.data).decode()
        assert {name: metric[name] for name in STORED} == {name: getattr(step, name) for name in STORED}
        assert {name: metric[name] for name in METRICS} == step.metrics, "an objective's step field was lost in the store"
        payload = json.loads(re.search(r"^data: (.*)$", sse, re.M).group(1))
        assert set(payload) == set(STEP_FIELDS) | {"time"}
        assert StepEvent.of(payload) == step

    def test_every_series_the_dashboard_charts_is_a_step_field(self) -> None:
        js = "\n".join(p.read_text() for p in sorted(STATIC.glob("view-*.js")))
        series = set(re.findall(r'\{\s*key:\s*"(\w+)"', js))
        assert {"loss", "tokens_per_s", "gpu_mem_peak", "host_rss"} <= series, "the pattern no longer finds the series"
        unknown = series - set(BASE_STEP_FIELDS) - set(DERIVED_SERIES)
        assert not unknown, f"chart series that are no StepEvent field: {sorted(unknown)}"
        for key in DERIVED_SERIES:
            assert f"{key}:" in (STATIC / "view-job.js").read_text(), f"{key} is charted but never computed"

    def test_a_one_rank_step_stores_and_serves_null_ranks(self, engine: Engine) -> None:
        step = dataclasses.replace(a_step(), ranks=None)
        job_id = _insert_job(engine)
        with make_sessionmaker(engine).begin() as session:
            apply_events(session, job_id, [make_event("step", **step.fields())])
        with make_sessionmaker(engine)() as session:
            [row] = service.list_metrics(session, job_id, after_step=0, limit=10)
        assert row.ranks is None and MetricOut.of(row).ranks is None

    def test_every_metric_field_the_dashboard_reads_exists(self) -> None:
        readable = STORED | METRICS | {"time"}
        for name in ("view-job.js", "view-jobs.js", "view-gpus.js"):
            reads = set(re.findall(r"\b(?:row|last|metric)\.(\w+)", (STATIC / name).read_text()))
            assert reads, name
            assert not reads - readable, f"{name} reads {sorted(reads - readable)} from a metric row"


class TestObjectives:
    """Each objective's declaration reaches every reader; adding a step field to one needs no other edit."""

    def test_the_step_event_carries_every_objectives_fields_after_its_own(self) -> None:
        assert STEP_FIELDS == BASE_STEP_FIELDS + objectives.metric_names()
        assert not set(BASE_STEP_FIELDS) & METRICS

    def test_the_api_schema_charts_every_step_field_of_every_objective(self) -> None:
        from api.app import create_app

        schema = create_app().openapi()["components"]["schemas"]["MetricOut"]
        charted = {(c["objective"], s["key"]) for c in schema["x-charts"] for s in c["series"]}
        declared = {(d.name, m.name) for d in objectives.declarations() for m in d.metrics}
        assert charted == declared
        assert METRICS <= set(schema["properties"])
        ids = [c["id"] for c in schema["x-charts"]]
        assert len(ids) == len(set(ids)), f"two charts share a test id: {ids}"

    def test_the_job_page_reads_the_charts_from_the_schema_and_spells_no_objective_field(self) -> None:
        js = (STATIC / "view-job.js").read_text()
        assert '"/openapi.json"' in js and '"x-charts"' in js and "MetricOut" in js
        spelled = [name for name in METRICS if re.search(rf"\b{name}\b", js)]
        assert not spelled, f"view-job.js spells objective step fields itself: {spelled}"

    def test_the_trackers_send_every_objectives_fields(self) -> None:
        assert METRICS <= set(STEP_METRICS)
        assert "token_accuracy" in STEP_METRICS

    def test_the_job_spec_offers_every_objective_and_its_section(self) -> None:
        hint = JobSpec.model_fields["objective"].annotation
        assert typing.get_args(hint) == objectives.names()
        assert set(SECTIONS) == set(objectives.sections()) <= set(JobSpec.model_fields)
        for name, section in objectives.sections().items():
            defaults = {f.name: f.default for f in dataclasses.fields(section)}
            assert SECTIONS[name]().model_dump() == defaults, name
            assert set(TrainConfig.__dataclass_fields__[name].default_factory().__dict__) == set(defaults), name

    def test_each_objectives_formats_are_known_to_the_upload_validator(self) -> None:
        from core.files.validate import FORMATS

        assert set(objectives.formats()) <= set(FORMATS)


def assert_fits_plan_schema(plan: dict[str, Any]) -> None:
    """``plan`` validates as the API's PlanOut, and the API drops none of its fields."""
    PlanOut.model_validate(plan)
    assert not set(plan) - set(PlanOut.model_fields), f"PlanOut lacks {sorted(set(plan) - set(PlanOut.model_fields))}"
    for decision in plan["decisions"]:
        assert set(decision) == set(DecisionOut.model_fields), decision


@pytest.fixture(scope="module")
def detect_report() -> dict[str, Any]:
    """What a CPU worker stores: the trainer's ``detect --json`` on this machine."""
    done = subprocess.run(
        [sys.executable, "-m", "trainer", "detect", "--json", "--device", "cpu"],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore"},
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


class TestPlanEvent:
    def test_the_agreed_shape_fits_the_api_schema(self) -> None:
        decision = {"name": "attention", "requested": "auto", "enabled": True, "backend": "sdpa", "reason": "CPU"}
        plan = {
            "device": "cpu", "dtype": "float32", "model_attention": "sdpa", "decisions": [decision],
            "hardware": {"device": "cpu"}, "total_steps": 3, "resumed_from_step": None, "time": 1.0,
            "model": {"name": "tiny", "params": 10, "trainable_params": 2, "layers": 1},
        }
        assert_fits_plan_schema(plan)

    @pytest.mark.parametrize("device", ["cpu", "cuda"])
    def test_the_trainers_plan_fits_the_api_schema(self, device: str) -> None:
        from trainer.plan import planner as planning
        from trainer.config import DataConfig, ModelConfig, OptimConfig, Optimizations, TrainConfig
        from trainer.plan.hardware import Hardware

        gpu = device == "cuda"
        hw = Hardware(
            device=device, name="NVIDIA H100 80GB HBM3" if gpu else "x86_64", capability=(9, 0) if gpu else None,
            gpu_count=int(gpu), gpu_memory=80 << 30 if gpu else None, host_memory=512 << 30, pinned_memory=gpu,
            bf16=gpu, triton=gpu, attention_kernels=("sdpa", "flex_attention", "varlen"), bitsandbytes=False,
            cpu_count=16, torch_version="2.9.0", cuda_version="13.0" if gpu else None,
            peak_flops=989e12 if gpu else None, varlen_options=("window_size", "return_aux"), triton_varlen=None,
        )
        config = TrainConfig(model=ModelConfig("m"), data=DataConfig("t.jsonl"), optim=OptimConfig(max_steps=1),
                             output_dir="/o", optimizations=Optimizations(moe_grouped_routing="off"))
        plan = planning.plan(hw, config).to_dict()
        assert_fits_plan_schema(plan)
        requested = {d["name"]: d["requested"] for d in plan["decisions"]}
        assert list(requested) == [*KERNEL_CHOICES, POLICY, *SWITCHES]
        assert requested == {**dict.fromkeys(requested, "auto"), "moe_grouped_routing": "off"}

    @pytest.mark.slow  # the trainer CLI in a subprocess
    def test_the_trainers_detect_plan_fits_the_api_schema(self, detect_report: dict[str, Any]) -> None:
        plan = detect_report["plan"]
        assert_fits_plan_schema(plan)
        names = [d["name"] for d in plan["decisions"]]
        assert names == [*KERNEL_CHOICES, POLICY, *SWITCHES]
        assert {d["requested"] for d in plan["decisions"][: len(KERNEL_CHOICES)]} == {"auto"}

    @pytest.mark.slow  # the trainer CLI in a subprocess
    def test_the_trainer_reports_every_switch_the_api_checks(self, detect_report: dict[str, Any]) -> None:
        assert list(detect_report["capabilities"]) == list(SWITCHES)

    def test_an_old_or_broken_plan_is_null_not_an_error(self) -> None:
        assert PlanOut.of(None) is None
        assert PlanOut.of([{"name": "packed_metadata_cache", "enabled": True}]) is None


class TestSwitches:
    def test_the_job_spec_has_every_switch_of_the_trainer(self) -> None:
        assert list(OptimizationSwitches.model_fields) == list(SWITCHES)
        assert OptimizationSwitches().model_dump() == dict.fromkeys(SWITCHES, "auto")

    def test_the_api_schema_lists_the_switches_with_their_docs(self) -> None:
        from api.app import create_app

        schema = create_app().openapi()["components"]["schemas"]["OptimizationSwitches"]
        assert list(schema["properties"]) == list(SWITCHES)
        assert schema["additionalProperties"] is False
        for name, (title, description) in switch_docs().items():
            prop = schema["properties"][name]
            assert (prop["title"], prop["description"]) == (title, description)
            assert (tuple(prop["enum"]), prop["default"]) == (SWITCH_VALUES, "auto")

    def test_the_form_reads_the_switches_from_the_schema(self) -> None:
        js = (STATIC / "view-new.js").read_text()
        assert '"/openapi.json"' in js and '"OptimizationSwitches"' in js
        spelled = [name for name in SWITCHES if name in js]
        assert not spelled, f"view-new.js spells switches itself: {spelled}"


class TestCheckpointLayout:
    def test_a_checkpoint_name_parses_back_to_its_step(self) -> None:
        for step in (0, 7, 123456, 1234567):
            assert layout.parse_checkpoint_step(layout.checkpoint_dir("/o", step).name) == step
        assert layout.checkpoint_dir("/o", 42) == Path("/o/checkpoints/step-000042")
        for other in ("step-000042.tmp", "step-42", "step-00004x", "adapter", "step-000042-attempt2"):
            assert layout.parse_checkpoint_step(other) is None, other

    def test_export_dir_by_method(self) -> None:
        assert layout.export_dir("/o", "lora") == layout.export_dir("/o", "qlora") == Path("/o/adapter")
        assert layout.export_dir("/o", "full") == Path("/o/model")

    def test_the_trainer_resumes_from_what_the_layout_names(self, tmp_path: Path) -> None:
        from trainer.training import checkpoint

        for step in (5, 10):
            layout.checkpoint_dir(tmp_path, step).mkdir(parents=True)
            (layout.checkpoint_dir(tmp_path, step) / "trainer_state.json").write_text("{}")
        layout.checkpoint_dir(tmp_path, 15).with_suffix(".tmp").mkdir()
        assert checkpoint.latest_checkpoint(tmp_path) == layout.checkpoint_dir(tmp_path, 10)

    def test_no_other_module_spells_the_layout(self) -> None:
        spelled = re.compile(r'f"step-\{|step-\(\\d|/ "checkpoints"|/ "adapter"|"model" if .*method')
        offenders = [
            str(path.relative_to(REPO))
            for top in ("trainer", "worker", "api", "core", "cli")
            for path in sorted((REPO / top).rglob("*.py"))
            if path != REPO / "trainer" / "training" / "layout.py" and spelled.search(path.read_text())
        ]
        assert not offenders, f"use trainer.training.layout instead of spelling the layout in {offenders}"
