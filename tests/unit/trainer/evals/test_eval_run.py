"""``python -m trainer eval``: each item generated, graded and written once; a resumed run
grades only the items with no line (a spy on the real ``grade_all`` counts the calls)."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from trainer.evals import run as eval_run
from trainer.evals.config import EvalConfig
from trainer.generate import outputs
from trainer.generate.engine import Engine
from trainer.parallel.distributed import World

pytestmark = pytest.mark.usefixtures("one_thread")
ONE = World(rank=0, world_size=1, local_rank=0)
ITEMS = [{"q": f"What is {i} plus {i}?", "answer": str(2 * i)} for i in range(5)]
CRITERIA = [{"type": "string_check", "name": "not empty marker", "input": "{{sample.output_text}}",
             "reference": "{{item.answer}}!!", "operation": "ne"},
            {"type": "string_check", "name": "exact", "input": "{{sample.output_text}}",
             "reference": "{{item.answer}}", "operation": "eq"}]


def _config(tmp_path: Path, model_dir: Path) -> EvalConfig:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"messages": [{"role": "user", "content": item["q"]}], "item": item}) + "\n"
                               for item in ITEMS))
    return EvalConfig(model=str(model_dir), prompts_file=str(prompts), output_dir=str(tmp_path / "out"),
                      sampling={"max_tokens": 3, "temperature": 0.0}, slots=2, chunk_prompts=2,
                      testing_criteria=CRITERIA)


def _run(config: EvalConfig, monkeypatch: pytest.MonkeyPatch, stop_after: int | None = None) -> tuple[str, list]:
    graded: list[str] = []
    real = eval_run.grade_all

    def spy(criteria, text, item, **kwargs):
        graded.append(item["answer"])
        return real(criteria, text, item, **kwargs)

    monkeypatch.setattr(eval_run, "grade_all", spy)
    progress = []

    def emit(type_: str, **payload: object) -> None:
        if type_ == "progress":
            progress.append(payload)
            if stop_after is not None and len(progress) == stop_after + 1:
                os.kill(os.getpid(), signal.SIGTERM)

    return eval_run.run_eval(config, emit, ONE), graded


def test_every_item_is_graded_once_and_a_resumed_run_grades_only_the_rest(tmp_path, tiny_model_dir, monkeypatch):
    config = _config(tmp_path, tiny_model_dir)
    status, graded = _run(config, monkeypatch, stop_after=1)
    assert status == "cancelled" and graded == ["0", "2"]
    assert sorted(outputs.read_lines(config.completions_path, config.parts_dir)) == [0, 1]
    status, graded = _run(config, monkeypatch)
    assert status == "succeeded" and graded == ["4", "6", "8"], "items 0 and 1 are not graded again"
    lines = [json.loads(x) for x in config.completions_path.read_text().splitlines()]
    assert [line["item"] for line in lines] == ITEMS
    for line in lines:
        text = line["choices"][0]["text"]
        assert [r["name"] for r in line["results"]] == ["not empty marker", "exact"]
        assert line["results"][0]["passed"] is True
        assert line["results"][1]["passed"] is (text == line["item"]["answer"])
        assert line["status"] == ("pass" if text == line["item"]["answer"] else "fail")


PYTHON = {"type": "python", "name": "py", "source": "def grade(sample, item):\n    return 1.0\n"}


def _pooled(tmp_path: Path, model_dir: Path, workers: int | None, criteria: list | None = None) -> EvalConfig:
    config = _config(tmp_path, model_dir)
    return dataclasses.replace(config, grading_workers=workers, testing_criteria=criteria or CRITERIA)


def test_pooled_grading_overlaps_the_next_chunks_generation_and_keeps_the_order(tmp_path, tiny_model_dir, monkeypatch):
    """With workers, chunk 1's items are graded while chunk 2 generates (a grade of chunk 1 waits
    for the second ``generate`` call to start: run in turn, it would wait in vain), two at once
    (a barrier of two), and the lines are still written in prompt order."""
    config = _pooled(tmp_path, tiny_model_dir, workers=2)
    second_chunk = threading.Event()
    calls: list[int] = []
    real_generate = Engine.generate

    def generate(self, requests, *args, **kwargs):
        calls.append(len(requests))
        if len(calls) == 2:
            second_chunk.set()
        return real_generate(self, requests, *args, **kwargs)

    monkeypatch.setattr(Engine, "generate", generate)
    together = threading.Barrier(2, timeout=60)
    overlapped: list[bool] = []
    real_grade = eval_run.grade_all

    def grade(criteria, text, item, **kwargs):
        if item["answer"] in ("0", "2"):  # the first chunk's two items
            together.wait()
            overlapped.append(second_chunk.wait(timeout=60))
        return real_grade(criteria, text, item, **kwargs)

    monkeypatch.setattr(eval_run, "grade_all", grade)
    assert eval_run.run_eval(config, lambda *_a, **_k: None, ONE) == "succeeded"
    assert calls == [2, 2, 1] and overlapped == [True, True]
    lines = [json.loads(x) for x in config.completions_path.read_text().splitlines()]
    assert [line["item"] for line in lines] == ITEMS and [line["index"] for line in lines] == list(range(5))


def test_a_stopped_pooled_run_writes_the_chunk_it_generated_and_resumes_after_it(tmp_path, tiny_model_dir,
                                                                                 monkeypatch):
    """Stopped after chunk 1 is written (by then chunk 2 has generated and is being graded):
    chunk 2 is written too, whole; the resumed run generates and grades only item 4."""
    config = _pooled(tmp_path, tiny_model_dir, workers=2)
    status, graded = _run(config, monkeypatch, stop_after=1)
    assert status == "cancelled" and sorted(graded) == ["0", "2", "4", "6"]
    assert sorted(outputs.read_lines(config.completions_path, config.parts_dir)) == [0, 1, 2, 3]
    status, graded = _run(config, monkeypatch)
    assert status == "succeeded" and graded == ["8"]
    assert [json.loads(x)["item"] for x in config.completions_path.read_text().splitlines()] == ITEMS


def test_grading_is_pooled_by_default_only_where_a_python_grader_runs(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    multi = {"type": "multi", "name": "m", "graders": {"p": PYTHON}, "calculate_output": "p"}
    assert eval_run.grading_workers(_pooled(tmp_path, tiny_model_dir, None)) == 0
    assert eval_run.grading_workers(_pooled(tmp_path, tiny_model_dir, None, [*CRITERIA, PYTHON])) == 8
    assert eval_run.grading_workers(_pooled(tmp_path, tiny_model_dir, None, [multi])) == 8
    assert eval_run.grading_workers(_pooled(tmp_path, tiny_model_dir, 3, [PYTHON])) == 3
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert eval_run.grading_workers(_pooled(tmp_path, tiny_model_dir, None, [PYTHON])) == 2
    with pytest.raises(ValueError, match="grading_workers: -1 is not within 0..256"):
        _pooled(tmp_path, tiny_model_dir, -1)


def test_the_trainer_and_its_eval_run_import_without_lm_eval() -> None:
    """lm-eval is an optional extra: only ``trainer.evals.lm_harness`` imports it."""
    code = ("import sys, trainer, trainer.__main__, trainer.evals.run, trainer.evals.cli, trainer.training.train; "
            "assert 'lm_eval' not in sys.modules, 'lm_eval imported'")
    subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[4], check=True, timeout=120)


def test_an_lm_eval_run_on_a_worker_without_lm_eval_names_the_extra(tmp_path, tiny_model_dir, monkeypatch) -> None:
    for name in {"lm_eval", "lm_eval.api.model", *(m for m in sys.modules if m.startswith("lm_eval."))}:
        monkeypatch.setitem(sys.modules, name, None)  # importing it raises ImportError, as where it is not installed
    monkeypatch.delitem(sys.modules, "trainer.evals.lm_harness", raising=False)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    config = EvalConfig(model=str(tiny_model_dir), prompts_file=str(tmp_path / "p.jsonl"), output_dir=str(tmp_path),
                        testing_criteria=[{"name": "exact_match", "type": "lm_eval", "pass_threshold": 1.0}],
                        lm_eval={"task": "t", "output_type": "generate_until"})
    with pytest.raises(RuntimeError, match="ftq's lm_eval extra"):
        eval_run.run_eval(config, lambda *_a, **_k: None, ONE)
