"""``/v1/evals`` on both stores: an eval and a run (a queued job of kind ``eval``), its results read
from graded lines where its job writes them, paging and filters, cancel and delete, and refusals
that store nothing (the worker's side is tests/integration/e2e/test_openai_e2e.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from core.evals.models import Eval, EvalRun
from core.files.models import File
from core.jobs import artifact_store
from core.jobs.models import Job

pytestmark = pytest.mark.integration

SCHEMA = {"type": "object", "properties": {"q": {"type": "string"}, "a": {"type": "string"}}, "required": ["q", "a"]}
CRITERIA = [{"type": "string_check", "name": "exact", "input": "{{sample.output_text}}", "reference": "{{item.a}}",
             "operation": "eq"}]
ITEMS = [{"q": "one", "a": "1"}, {"q": "two", "a": "2"}, {"q": "three", "a": "3"}]


def run_body(content: list[dict[str, Any]], **source: Any) -> dict[str, Any]:
    return {"name": "base", "data_source": {
        "type": "completions", "model": "tiny", "source": {"type": "file_content", "content": content},
        "input_messages": {"type": "template", "template": [{"role": "user", "content": "Say {{item.q}}"}]},
        "sampling_params": {"max_completion_tokens": 4, "temperature": 0}, **source}}


def counts(store) -> tuple[int, ...]:
    with store.sessions() as session:
        return tuple(session.scalar(select(func.count()).select_from(t)) for t in (Eval, EvalRun, Job, File))


def graded(index: int, text: str) -> dict[str, Any]:
    item = ITEMS[index]
    passed = text == item["a"]
    return {"index": index, "messages": [{"role": "user", "content": f"Say {item['q']}"}], "item": item,
            "choices": [{"index": 0, "text": text, "finish_reason": "stop", "tokens": 1}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 1}, "status": "pass" if passed else "fail",
            "results": [{"name": "exact", "type": "string_check", "score": float(passed), "passed": passed,
                         "sample": None, "error": None}]}


@pytest.fixture
def ev(client: TestClient) -> dict[str, Any]:
    created = client.post("/v1/evals", json={"name": "numbers", "testing_criteria": CRITERIA,
                                             "data_source_config": {"type": "custom", "item_schema": SCHEMA}})
    assert created.status_code == 200, created.text
    return created.json()


class TestRuns:
    def test_a_run_is_an_eval_job_whose_graded_lines_are_its_results(self, client: TestClient, store, ev) -> None:
        created = client.post(f"/v1/evals/{ev['id']}/runs", json=run_body([{"item": i} for i in ITEMS]))
        assert created.status_code == 200, created.text
        run = created.json()
        assert (run["object"], run["status"], run["model"], run["result_counts"]["total"]) == (
            "eval.run", "queued", "tiny", 0)
        job = client.get(f"/v1/jobs/{run['job_id']}").json()
        assert (job["kind"], job["status"], job["model"]) == ("eval", "queued", "tiny")
        assert job["spec"]["testing_criteria"] == CRITERIA and job["spec"]["sampling"]["max_tokens"] == 4
        with store.sessions() as session:
            prompts = session.get(File, job["training_file"])
            lines = [json.loads(x) for x in Path(prompts.path).read_text().splitlines()]
            output_dir = Path(session.get(Job, run["job_id"]).output_dir)
        assert lines[1] == {"messages": [{"role": "user", "content": "Say two"}], "item": ITEMS[1]}
        assert prompts.filename == f"{run['id']}.prompts.jsonl" and prompts.purpose == "generate"

        parts = output_dir / "completions.parts"
        parts.mkdir(parents=True)
        (parts / "rank-0.jsonl").write_text("".join(json.dumps(graded(i, t)) + "\n" for i, t in enumerate("1x3")))
        read = client.get(f"/v1/evals/{ev['id']}/runs/{run['id']}").json()
        assert read["result_counts"] == {"total": 3, "passed": 2, "failed": 1, "errored": 0}
        [per] = read["per_testing_criteria_results"]
        assert (per["testing_criteria"], per["passed"], per["failed"]) == ("exact", 2, 1)
        assert per["pass_rate"] == pytest.approx(2 / 3)
        assert read["per_model_usage"][0]["total_tokens"] == 18

        url = f"/v1/evals/{ev['id']}/runs/{run['id']}/output_items"
        first = client.get(url, params={"limit": 2}).json()
        assert [o["datasource_item_id"] for o in first["data"]] == [0, 1] and first["has_more"]
        rest = client.get(url, params={"limit": 2, "after": first["last_id"]}).json()
        assert [o["datasource_item_id"] for o in rest["data"]] == [2] and not rest["has_more"]
        failed = client.get(url, params={"status": "fail"}).json()["data"]
        assert [(o["datasource_item"], o["sample"]["output"][0]["content"]) for o in failed] == [(ITEMS[1], "x")]
        assert client.get(f"{url}/{failed[0]['id']}").json()["results"][0]["score"] == 0.0
        assert client.get(f"{url}/outputitem_none_9").status_code == 404

        clone = client.post(f"/v1/jobs/{run['job_id']}/clone")
        assert clone.status_code == 422 and "create another run" in clone.json()["error"]["message"], clone.text
        cancelled = client.post(f"/v1/evals/{ev['id']}/runs/{run['id']}/cancel")
        assert cancelled.status_code == 200 and cancelled.json()["status"] == "canceled", cancelled.text
        assert client.post(f"/v1/evals/{ev['id']}/runs/{run['id']}/cancel").status_code == 409
        canceled = client.get(f"/v1/evals/{ev['id']}/runs", params={"status": "canceled"}).json()["data"]
        assert [r["id"] for r in canceled] == [run["id"]]
        assert client.delete(f"/v1/evals/{ev['id']}/runs/{run['id']}").json()["deleted"]
        assert client.delete(f"/v1/evals/{ev['id']}").json()["deleted"]
        assert client.get(f"/v1/evals/{ev['id']}").status_code == 404

    def test_an_items_file_is_uploaded_with_purpose_evals_and_a_bad_line_named(self, client: TestClient, ev) -> None:
        bad = client.post("/v1/files", files={"file": ("i.jsonl", '{"item": {"q": "a", "a": "b"}}\n"text"\n')},
                          data={"purpose": "evals"})
        assert bad.status_code == 422 and bad.json()["error"]["line"] == 2, bad.text
        good = client.post("/v1/files", files={"file": ("i.jsonl", "".join(json.dumps({"item": i}) + "\n"
                                                                          for i in ITEMS))}, data={"purpose": "evals"})
        assert good.status_code == 201 and good.json()["num_records"] == 3, good.text
        body = run_body([], source={"type": "file_id", "id": good.json()["id"]})
        assert client.post(f"/v1/evals/{ev['id']}/runs", json=body).status_code == 200


class TestRefusals:
    @pytest.mark.parametrize(("content", "change", "param", "message"), [
        ([{"item": ITEMS[0]}, {"item": {"q": "two"}}], {}, "data_source.source.content",
         "data_source.source.content: line 2: item.a: missing"),
        ([{"item": ITEMS[0]}], {"input_messages": {"type": "template", "template": [
            {"role": "user", "content": "{{item.nope}}"}]}}, "data_source.input_messages.template[0].content",
         "data_source.source.content: line 1:"),
        ([{"item": ITEMS[0]}], {"model": "job:job-0123456789abcdef01234567"}, "data_source.model",
         "model: no training job"),
        ([{"item": ITEMS[0]}], {"sampling_params": {"max_completion_tokens": 5000}},
         "data_source.sampling_params.max_completion_tokens", "over the 4,096 the model holds"),
        ([{"item": ITEMS[0]}], {"type": "jsonl"}, "data_source.type", "ftq runs 'completions'"),
    ])
    def test_a_bad_run_names_its_field_or_line_and_stores_nothing(self, client: TestClient, store, ev, content,
                                                                  change, param, message) -> None:
        before = counts(store)
        body = run_body(content)
        body["data_source"].update(change)
        refused = client.post(f"/v1/evals/{ev['id']}/runs", json=body)
        assert refused.status_code == 422, refused.text
        assert refused.json()["error"]["param"] == param and message in refused.json()["error"]["message"], refused.text
        assert counts(store) == before

    def test_bad_evals_name_their_field_and_an_unknown_eval_is_404(self, client: TestClient, store) -> None:
        before = counts(store)
        config = {"type": "custom", "item_schema": SCHEMA}
        for criteria, param in (([{**CRITERIA[0], "operation": "eqq"}], "testing_criteria[0].operation"),
                                ([{"type": "python", "name": "p", "source": "def grade(:"}],
                                 "testing_criteria[0].source"),
                                ([], "testing_criteria")):
            refused = client.post("/v1/evals", json={"data_source_config": config, "testing_criteria": criteria})
            assert refused.status_code == 422 and refused.json()["error"]["param"] == param, refused.text
        assert counts(store) == before
        assert client.get("/v1/evals/eval_missing").status_code == 404
        assert client.post("/v1/evals/eval_missing/runs", json=run_body([{"item": ITEMS[0]}])).status_code == 404


def train_file(client: TestClient) -> str:
    record = {"messages": [{"role": "user", "content": "Say one"}, {"role": "assistant", "content": "1"}]}
    uploaded = client.post("/v1/files", files={"file": ("t.jsonl", (json.dumps(record) + "\n") * 20)},
                           data={"purpose": "train"})
    assert uploaded.status_code == 201, uploaded.text
    return uploaded.json()["id"]


class TestJobEvals:
    """A training job names evals: checked at submission, run on base and tuned once it succeeded
    (the worker's ``start_job_evals`` calls ``start_runs`` so), compared at ``/v1/jobs/{id}/evals``."""

    def test_a_job_runs_its_evals_on_base_and_tuned_and_compares_them(self, client: TestClient, store, settings,
                                                                        ev) -> None:
        from core.evals.after_training import start_runs
        from core.jobs import artifact_store
        from core.jobs.submit import Origin, record
        from tests.integration.helpers import finish

        data_source = run_body([{"item": i} for i in ITEMS])["data_source"]
        data_source.pop("model")
        body = {"model": "tiny", "training_file": train_file(client), "hyperparameters": {"max_steps": 1}}
        before = counts(store)
        for change, param in (({"eval_id": "eval_missing"}, "evals[0].eval_id"),
                              ({"data_source": {**data_source, "source": {"type": "file_content", "content": [
                                  {"item": {"q": "x"}}]}}}, "evals[0].data_source.source.content")):
            refused = client.post("/v1/jobs", json={**body, "evals": [{"eval_id": ev["id"], "data_source": data_source,
                                                                        **change}]})
            assert refused.status_code == 422 and refused.json()["error"]["param"] == param, refused.text
        assert counts(store) == before
        job = client.post("/v1/jobs", json={**body, "evals": [{"eval_id": ev["id"], "data_source": data_source}]})
        assert job.status_code == 201, job.text
        job_id = job.json()["id"]
        assert client.get(f"/v1/jobs/{job_id}/evals").json()["data"][0]["base"] is None  # not before it succeeds

        finish(store, job_id)
        artifact_store.final_store_dir(settings, job_id, "lora").mkdir(parents=True)

        def submit_run(session, spec, owner, attach):
            return record(session, spec, owner, Origin(attach=attach), settings=settings, preflight=None)[0]

        started = start_runs(store.sessions, job_id, settings=settings, record=submit_run)
        assert len(started) == 2
        runs = client.get(f"/v1/evals/{ev['id']}/runs").json()["data"]
        assert [(r["model"], r["metadata"]["ftq_side"]) for r in runs] == [("tiny", "base"), (f"job:{job_id}", "tuned")]
        with store.sessions() as session:
            dirs = {r["metadata"]["ftq_side"]: Path(session.get(Job, r["job_id"]).output_dir) for r in runs}
        for side, texts in (("base", "1x3"), ("tuned", "123")):
            (dirs[side] / "completions.parts").mkdir(parents=True)
            (dirs[side] / "completions.parts" / "rank-0.jsonl").write_text(
                "".join(json.dumps(graded(i, t)) + "\n" for i, t in enumerate(texts)))
        [compared] = client.get(f"/v1/jobs/{job_id}/evals").json()["data"]
        [exact] = compared["criteria"]
        assert exact["base"] == pytest.approx(2 / 3) and exact["tuned"] == 1.0
        assert exact["difference"] == pytest.approx(1 / 3)
        assert compared["tuned"]["result_counts"]["passed"] == 3 and compared["base"]["result_counts"]["passed"] == 2
        assert [(row["index"], row["changed"]) for row in compared["items"]] == [(0, False), (1, True), (2, False)]
        assert (compared["items"][1]["base"]["output"], compared["items"][1]["tuned"]["output"]) == ("x", "2")

    def test_checkpoint_runs_are_checked_started_and_scored_per_step(self, client: TestClient, store, settings, ev,
                                                                       oai) -> None:
        """``at_checkpoints``: refused naming the field when the job writes no such checkpoint; after
        success one run per recorded checkpoint (``job:<id>@<step>``), a named step never written a
        warning in the job's log; the scores per step in ``/v1/jobs/{id}/evals`` and in the OpenAI
        job object's ``evals`` (read through the ``openai`` client)."""
        from core.evals.after_training import start_runs
        from core.jobs import artifact_store
        from core.jobs.models import Checkpoint, JobEvent
        from core.jobs.submit import Origin, record
        from tests.integration.helpers import finish

        data_source = run_body([{"item": i} for i in ITEMS])["data_source"]
        data_source.pop("model")
        body = {"model": "tiny", "training_file": train_file(client), "hyperparameters": {"max_steps": 6},
                "checkpoint_every": 2}
        before = counts(store)
        for change, param in (({"checkpoint_every": 0}, "evals[0].at_checkpoints"),
                              ({"hyperparameters": {"max_steps": 100}, "checkpoint_every": 1}, "evals[0].at_checkpoints"),
                              ({"method": "full"}, "evals[0].at_checkpoints")):
            refused = client.post("/v1/jobs", json={**body, **change, "evals": [
                {"eval_id": ev["id"], "data_source": data_source, "at_checkpoints": "all"}]})
            assert refused.status_code == 422 and refused.json()["error"]["param"] == param, refused.text
        for steps, param in (([3], "evals[0].at_checkpoints[0]"), ([2, 6], "evals[0].at_checkpoints[1]"),
                             ([0], "evals.0.at_checkpoints")):
            refused = client.post("/v1/jobs", json={**body, "evals": [
                {"eval_id": ev["id"], "data_source": data_source, "at_checkpoints": steps}]})
            assert refused.status_code == 422 and refused.json()["error"]["param"] == param, refused.text
        assert counts(store) == before
        job = client.post("/v1/jobs", json={**body, "evals": [{"eval_id": ev["id"], "data_source": data_source,
                                                                 "at_checkpoints": [2, 4]}]})
        assert job.status_code == 201, job.text
        job_id = job.json()["id"]
        assert oai.fine_tuning.jobs.retrieve(job_id).evals[0]["checkpoints"] == []

        finish(store, job_id)
        artifact_store.final_store_dir(settings, job_id, "lora").mkdir(parents=True)
        ckpt = artifact_store.checkpoint_store_dir(settings, job_id, 2)
        ckpt.mkdir(parents=True)
        (ckpt / "adapter_config.json").write_text("{}")
        with store.sessions() as session:  # step 4's checkpoint was never written
            session.add(Checkpoint(job_id=job_id, step=2, path=str(ckpt), bytes=2, final=False))
            session.add(Checkpoint(job_id=job_id, step=6, path=str(ckpt), bytes=2, final=True))
            session.commit()

        def submit_run(session, spec, owner, attach):
            return record(session, spec, owner, Origin(attach=attach), settings=settings, preflight=None)[0]

        assert len(start_runs(store.sessions, job_id, settings=settings, record=submit_run)) == 3
        runs = client.get(f"/v1/evals/{ev['id']}/runs").json()["data"]
        assert [(r["model"], r["metadata"]["ftq_side"], r["metadata"].get("ftq_step")) for r in runs] == [
            ("tiny", "base", None), (f"job:{job_id}", "tuned", None), (f"job:{job_id}@2", "checkpoint", "2")]
        with store.sessions() as session:
            logs = session.scalars(select(JobEvent.data).where(JobEvent.job_id == job_id, JobEvent.type == "log")).all()
            dirs = [Path(session.get(Job, r["job_id"]).output_dir) for r in runs]
        assert any("no checkpoint at step(s) 4" in p["message"] for p in logs), logs
        for directory, texts in zip(dirs, ("1xx", "123", "1x3")):
            (directory / "completions.parts").mkdir(parents=True)
            (directory / "completions.parts" / "rank-0.jsonl").write_text(
                "".join(json.dumps(graded(i, t)) + "\n" for i, t in enumerate(texts)))
        [compared] = client.get(f"/v1/jobs/{job_id}/evals").json()["data"]
        [step2] = compared["checkpoints"]
        assert step2["step"] == 2 and step2["run"]["model"] == f"job:{job_id}@2"
        assert step2["criteria"] == [{"name": "exact", "pass_rate": pytest.approx(2 / 3),
                                      "mean_score": pytest.approx(2 / 3)}]
        assert compared["criteria"][0]["mean_score_difference"] == pytest.approx(2 / 3)
        [summary] = oai.fine_tuning.jobs.retrieve(job_id).evals  # the openai client keeps the extra field
        assert summary["base"]["run_id"] == runs[0]["id"] and summary["tuned"]["status"] == "queued"
        assert summary["criteria"][0]["difference"] == pytest.approx(2 / 3)
        assert [(c["step"], c["run_id"], c["criteria"][0]["pass_rate"]) for c in summary["checkpoints"]] == [
            (2, runs[2]["id"], pytest.approx(2 / 3))]


LM_TASK = {"task": "numbers", "output_type": "multiple_choice", "doc_to_text": "Say {{q}}:",
           "doc_to_choice": ["1", "2", "3"], "doc_to_target": "{{['1', '2', '3'].index(a)}}",
           "metric_list": [{"metric": "acc"}, {"metric": "acc_norm", "pass_threshold": 0.5}]}


def lm_body(**change: Any) -> dict[str, Any]:
    return {"name": "lm", "data_source": {"type": "lm_eval", "model": "tiny", "task": LM_TASK,
                                          "source": {"type": "file_content", "content": [{"item": i} for i in ITEMS]},
                                          **change}}


class TestLmEvalRuns:
    def test_an_lm_eval_run_is_an_eval_job_of_the_task_s_metrics(self, client: TestClient, store, ev) -> None:
        created = client.post(f"/v1/evals/{ev['id']}/runs", json=lm_body())
        assert created.status_code == 200, created.text
        run = created.json()
        assert run["data_source"]["type"] == "lm_eval" and run["data_source"]["task"] == LM_TASK
        job = client.get(f"/v1/jobs/{run['job_id']}").json()
        assert job["kind"] == "eval" and job["spec"]["lm_eval"]["task"] == "numbers"
        assert job["spec"]["testing_criteria"] == [{"name": "acc", "type": "lm_eval", "pass_threshold": 1.0},
                                                   {"name": "acc_norm", "type": "lm_eval", "pass_threshold": 0.5}]
        assert job["spec"]["sampling"]["max_tokens"] == 1
        with store.sessions() as session:
            lines = [json.loads(x) for x in Path(session.get(File, job["training_file"]).path).read_text().splitlines()]
        assert [line["item"] for line in lines] == ITEMS
        assert client.post(f"/v1/evals/{ev['id']}/runs/{run['id']}/cancel").json()["status"] == "canceled"

    @pytest.mark.parametrize(("change", "param", "message"), [
        ({"task": {**LM_TASK, "dataset_path": "hellaswag"}}, "data_source.task.dataset_path", "nothing is downloaded"),
        ({"task": {**LM_TASK, "output_type": "loglikelihood_rolling"}}, "data_source.task.output_type", "one of"),
        ({"task": {**LM_TASK, "metric_list": [{"metric": "bleu"}]}}, "data_source.task.metric_list[0].metric",
         "fetched from the hub"),
        ({"task": {**LM_TASK, "metric_list": [{"metric": "acc", "aggregation": "median"}]}},
         "data_source.task.metric_list[0].aggregation", "mean"),
        ({"task": {**LM_TASK, "process_results": "x"}}, "data_source.task.process_results", "not supported"),
        ({"task": {**LM_TASK, "num_fewshot": 5}}, "data_source.task.num_fewshot", "few-shot"),
        ({"task": {**LM_TASK, "doc_to_text": "{{ q.__class__ }}"}}, "data_source.task.doc_to_text", "Python's internals"),
        ({"task": {k: v for k, v in LM_TASK.items() if k != "doc_to_choice"}}, "data_source.task.doc_to_choice",
         "names its choices"),
        ({"input_messages": {"type": "template", "template": []}}, "data_source.input_messages", "not taken"),
        ({"source": {"type": "file_content", "content": [{"item": {"q": 1}}]}}, "data_source.source.content",
         "line 1"),
    ])
    def test_a_bad_task_names_its_field_and_stores_nothing(self, client: TestClient, store, ev, change, param,
                                                          message) -> None:
        before = counts(store)
        refused = client.post(f"/v1/evals/{ev['id']}/runs", json=lm_body(**change))
        assert refused.status_code == 422, refused.text
        assert refused.json()["error"]["param"] == param and message in refused.json()["error"]["message"], refused.text
        assert counts(store) == before

    def test_a_training_job_s_evals_may_be_lm_eval_tasks_checked_at_submission(self, client: TestClient, store,
                                                                                ev) -> None:
        data_source = lm_body()["data_source"]
        data_source.pop("model")
        body = {"model": "tiny", "training_file": train_file(client), "hyperparameters": {"max_steps": 1}}
        before = counts(store)
        bad = {**data_source, "task": {**LM_TASK, "output_type": "generate"}}
        refused = client.post("/v1/jobs", json={**body, "evals": [{"eval_id": ev["id"], "data_source": bad}]})
        assert refused.status_code == 422, refused.text
        assert refused.json()["error"]["param"] == "evals[0].data_source.task.output_type", refused.text
        assert counts(store) == before
        job = client.post("/v1/jobs", json={**body, "evals": [{"eval_id": ev["id"], "data_source": data_source}]})
        assert job.status_code == 201, job.text
        assert client.post(f"/v1/jobs/{job.json()['id']}/cancel").status_code == 200


def judged(model: str, *, nested: bool = False) -> list[dict[str, Any]]:
    """``CRITERIA`` and a ``score_model`` judged by ``model`` (inside a ``multi`` with ``nested``)."""
    judge = {"type": "score_model", "name": "judge", "model": model,
             "input": [{"role": "user", "content": "Is {{sample.output_text}} {{item.a}}?"}]}
    if nested:
        judge = {"type": "multi", "name": "mix", "calculate_output": "j", "graders": {"j": judge}}
    return [*CRITERIA, judge]


def eval_body(criteria: list[dict[str, Any]], **more: Any) -> dict[str, Any]:
    return {"name": "judged", "testing_criteria": criteria,
            "data_source_config": {"type": "custom", "item_schema": SCHEMA}, **more}


def trained_in(client: TestClient, store, settings, project: str) -> str:
    """A succeeded LoRA job of ``project`` whose final adapter is on disk."""
    from core.projects import service as projects
    from tests.integration.helpers import finish

    with store.sessions() as session:
        projects.create_project(session, project)
        session.commit()
    record = {"messages": [{"role": "user", "content": "Say one"}, {"role": "assistant", "content": "1"}]}
    uploaded = client.post("/v1/files", files={"file": ("t.jsonl", (json.dumps(record) + "\n") * 20)},
                           data={"purpose": "train", "project": project})
    assert uploaded.status_code == 201, uploaded.text
    job = client.post("/v1/jobs", json={"model": "tiny", "training_file": uploaded.json()["id"], "project": project,
                                        "hyperparameters": {"max_steps": 1}})
    assert job.status_code == 201, job.text
    finish(store, job.json()["id"])
    artifact_store.final_store_dir(settings, job.json()["id"], "lora").mkdir(parents=True)
    return job.json()["id"]


class TestJudges:
    """A ``score_model``/``label_model`` criterion's ``model`` is its judge: resolved at evals.create and
    runs.create as a run's model is (refused naming ``testing_criteria[i].model``, nothing stored), and
    handed to the trainer resolved (``EvalConfig.judges``) by the worker's ``build_generate_config``."""

    def test_a_judge_reaches_the_workers_eval_config_resolved(self, client: TestClient, store, settings,
                                                              tmp_path: Path) -> None:
        from core.jobs.generation import build_generate_config
        from trainer.evals.config import EvalConfig

        job_id = trained_in(client, store, settings, "judges")
        created = client.post("/v1/evals", json=eval_body([*judged("tiny"), {**judged(f"job:{job_id}")[1],
                                                                             "name": "tuned judge"}],
                                                            project="judges"))
        assert created.status_code == 200, created.text
        assert [c.get("model") for c in created.json()["testing_criteria"]] == [None, "tiny", f"job:{job_id}"]
        run = client.post(f"/v1/evals/{created.json()['id']}/runs", json=run_body([{"item": i} for i in ITEMS]))
        assert run.status_code == 200, run.text
        with store.sessions() as session:
            row = session.get(Job, run.json()["job_id"])
            config = build_generate_config(session, row, settings=settings, output_dir=str(tmp_path))
        assert isinstance(config, EvalConfig) and config.grading_workers is None
        final = str(artifact_store.final_store_dir(settings, job_id, "lora"))
        assert config.judges == {"tiny": {"model": config.model, "adapter": None, "tokenizer": None},
                                 f"job:{job_id}": {"model": config.model, "adapter": final, "tokenizer": None}}

    def test_an_unknown_or_foreign_judge_is_refused_naming_its_field_and_stores_nothing(
            self, client: TestClient, store, settings) -> None:
        foreign = trained_in(client, store, settings, "other")
        before = counts(store)
        for criteria, status, param, message in (
                (judged("nope"), 422, "testing_criteria[1].model", "no directory"),
                (judged(f"job:{foreign}"), 422, "testing_criteria[1].model", "no training job"),
                (judged("job:job-0123456789abcdef01234567", nested=True), 422,
                 "testing_criteria[1].graders.j.model", "no training job"),
                (judged("ft:tiny:ftq::job-0123456789abcdef01234567"), 404, "testing_criteria[1].model",
                 "does not exist")):
            refused = client.post("/v1/evals", json=eval_body(criteria))
            assert refused.status_code == status, refused.text
            error = refused.json()["error"]
            assert error["param"] == param and message in error["message"], refused.text
        openai = client.post("/openai/v1/evals", json=eval_body(judged("nope")))
        assert openai.status_code == 400 and openai.json()["error"]["param"] == "testing_criteria[1].model"
        assert counts(store) == before

        ev = client.post("/v1/evals", json=eval_body(judged(f"job:{foreign}"), project="other"))
        assert ev.status_code == 200, ev.text  # its own project's job is a judge
        shutil.rmtree(artifact_store.final_store_dir(settings, foreign, "lora"))
        before = counts(store)
        refused = client.post(f"/v1/evals/{ev.json()['id']}/runs", json=run_body([{"item": ITEMS[0]}]))
        assert refused.status_code == 422 and refused.json()["error"]["param"] == "testing_criteria[1].model", \
            refused.text
        assert counts(store) == before
