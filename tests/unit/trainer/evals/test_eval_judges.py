"""An eval run's model graders (``score_model``, ``label_model``, also inside a ``multi``) judged by a
model on this box (``trainer.evals.judges``): the judge is called once per item and grader, the
evaluated model doubles as a judge that is the same model, an unreadable answer fails that item
with the judge's parse error while the run goes on, and the judge's scores reach the lines and the
run's totals. All on CPU with tiny random-weight Llamas."""

from __future__ import annotations

import dataclasses
import json
import threading
from pathlib import Path

import pytest

from trainer.evals import judges as eval_judges
from trainer.evals import run as eval_run
from trainer.evals.config import EvalConfig
from trainer.evals.results import summarize
from trainer.graders import validate
from trainer.graders.judge import read_answer
from trainer.parallel.distributed import World

pytestmark = pytest.mark.usefixtures("one_thread")
ONE = World(rank=0, world_size=1, local_rank=0)
ITEMS = [{"q": f"What is {i} plus {i}?", "answer": str(2 * i)} for i in range(4)]
ASK = "Q: {{item.q}} A: {{sample.output_text}} (key {{item.answer}})"
QUALITY = validate({"type": "score_model", "name": "quality", "model": "tiny-self", "range": [0, 1],
                    "sampling_params": {"max_completions_tokens": 4}, "input": [{"role": "user", "content": ASK}]},
                   "testing_criteria[0]")
TONE = validate({"type": "multi", "name": "tone", "calculate_output": "label", "graders": {
    "label": {"type": "label_model", "name": "label", "model": "tiny-other", "labels": ["good", "bad"],
              "passing_labels": ["good"], "sampling_params": {"max_completions_tokens": 4},
              "input": [{"role": "user", "content": "{{sample.output_text}} (key {{item.answer}})"}]}}},
                "testing_criteria[1]")
CRITERIA = [QUALITY, {**TONE, "pass_threshold": 1.0}]


def _config(tmp_path: Path, model_dir: Path, other_dir: Path, **change: object) -> EvalConfig:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"messages": [{"role": "user", "content": item["q"]}], "item": item}) + "\n"
                               for item in ITEMS))
    judges = {"tiny-self": {"model": str(model_dir), "adapter": None, "tokenizer": None},
              "tiny-other": {"model": str(other_dir), "adapter": None, "tokenizer": None}}
    config = EvalConfig(model=str(model_dir), prompts_file=str(prompts), output_dir=str(tmp_path / "out"),
                        sampling={"max_tokens": 3, "temperature": 0.0}, slots=2, chunk_prompts=2,
                        testing_criteria=CRITERIA, judges=judges)
    return dataclasses.replace(config, **change)


def _lines(config: EvalConfig) -> list[dict]:
    return [json.loads(x) for x in config.completions_path.read_text().splitlines()]


def test_a_tiny_judge_grades_each_item_once_and_an_unreadable_answer_fails_only_that_item(
        tmp_path, tiny_model_dir, tiny_models, monkeypatch):
    """The real sampler judges: one ``engine_judge`` call per item and model grader, the evaluated
    model reused for the judge that is the same model (only the other one is loaded), and each
    line's grade is what the judge's own answer reads as (a random-weight model's answer is mostly
    no score: that item's criterion errors, the next item is still graded)."""
    config = _config(tmp_path, tiny_model_dir, tiny_models["llama"])
    answers: list[tuple[str, str]] = []
    real_engine_judge = eval_judges.engine_judge

    def spy_engine_judge(engine, tokenizer):
        judge = real_engine_judge(engine, tokenizer)

        def spied(messages, params):
            answer = judge(messages, params)
            answers.append((messages[-1]["content"], answer))
            return answer

        return spied

    loaded: list[str] = []
    real_load = eval_judges.load_model

    def spy_load(judge_config, device):
        loaded.append(judge_config.model)
        return real_load(judge_config, device)

    monkeypatch.setattr(eval_judges, "engine_judge", spy_engine_judge)
    monkeypatch.setattr(eval_judges, "load_model", spy_load)
    assert eval_run.run_eval(config, lambda *_a, **_k: None, ONE) == "succeeded"
    assert loaded == [str(tiny_models["llama"])], "the judge that is the evaluated model is not loaded again"
    lines = _lines(config)
    assert [line["item"] for line in lines] == ITEMS
    assert len(answers) == 2 * len(ITEMS), "one judge call per item and model grader"
    assert any(r["error"] for line in lines for r in line["results"]), "a random-weight judge's answers include no score"
    for line in lines:
        key = f"(key {line['item']['answer']})"
        [(_, said_quality)] = [(m, a) for m, a in answers if key in m and m.startswith("Q:")]
        [(_, said_tone)] = [(m, a) for m, a in answers if key in m and not m.startswith("Q:")]
        for result, grader, said in ((line["results"][0], QUALITY, said_quality),
                                     (line["results"][1], TONE["graders"]["label"], said_tone)):
            try:
                score, _ = read_answer(grader, said)
            except ValueError:
                assert result["error"] and "the judge's answer is not" in result["error"], result
                assert result["score"] == 0.0 and result["passed"] is False
            else:
                assert result["error"] is None and result["score"] == score
        assert line["status"] == eval_run.status_of(line["results"])


def test_the_judges_answers_flow_to_the_lines_and_totals_graded_on_the_runners_thread(
        tmp_path, tiny_model_dir, tiny_models, monkeypatch):
    """A judge answering fixed verdicts (``engine_judge`` replaced): readable scores and labels
    become the results, an unreadable one errors that item (model_grader_parse_error's message) and
    the run goes on; the judge runs on the runner's thread even with ``grading_workers`` asked for."""
    config = _config(tmp_path, tiny_model_dir, tiny_models["llama"], grading_workers=2)
    scores = {"0": '{"result": 0.9}', "2": "Sure: 0.25", "4": "no idea", "6": '{"result": 1}'}
    labels = {"0": '{"result": "good"}', "2": "good", "4": "bad", "6": '"bad"'}
    threads: set[str] = set()

    def fixed_engine_judge(engine, tokenizer):
        def judge(messages, params):
            threads.add(threading.current_thread().name)
            content = messages[-1]["content"]
            key = content.rsplit("(key ", 1)[1].rstrip(")")
            return (scores if content.startswith("Q:") else labels)[key]
        return judge

    monkeypatch.setattr(eval_judges, "engine_judge", fixed_engine_judge)
    assert eval_run.grading_workers(config) == 0
    assert eval_run.run_eval(config, lambda *_a, **_k: None, ONE) == "succeeded"
    assert threads == {threading.main_thread().name}
    lines = _lines(config)
    got = [[(r["score"], r["passed"], r["error"] is not None) for r in line["results"]] for line in lines]
    assert got == [[(0.9, True, False), (1.0, True, False)],
                   [(0.0, False, True), (1.0, True, False)],   # "Sure: 0.25" is no JSON result nor a bare number
                   [(0.0, False, True), (0.0, False, False)],  # "no idea": the item errors, the label still grades
                   [(1.0, True, False), (0.0, False, False)]]
    assert "not a score: 'no idea'" in lines[2]["results"][0]["error"]
    assert [line["status"] for line in lines] == ["pass", "error", "error", "fail"]
    totals = summarize(lines, CRITERIA)
    assert totals["result_counts"] == {"total": 4, "passed": 1, "failed": 1, "errored": 2}
    quality, tone = totals["per_testing_criteria_results"]
    assert (quality["passed"], quality["errored"], quality["mean_score"]) == (2, 2, pytest.approx(1.9 / 4))
    assert (tone["passed"], tone["failed"], tone["pass_rate"]) == (2, 2, 0.5)


def test_the_judges_travel_in_job_json_and_a_model_grader_without_one_is_refused(tmp_path, tiny_model_dir,
                                                                                   tiny_models):
    config = _config(tmp_path, tiny_model_dir, tiny_models["llama"])
    with pytest.raises(ValueError, match=r"judges: no entry for 'tiny-other', the judge "
                                         r"testing_criteria\[1\]\.graders\.label\.model names"):
        dataclasses.replace(config, judges={"tiny-self": config.judges["tiny-self"]})
    config.save(tmp_path / "job.json")  # what the worker writes and ``python -m trainer eval`` reads
    assert EvalConfig.load(tmp_path / "job.json") == config
