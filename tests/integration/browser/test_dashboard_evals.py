"""The learning proof of issue 27, on the embedded stack in Chromium: ``tiny_llama`` (random weights)
is trained to answer every question with one phrase, and its eval (a ``string_check`` eq on that
phrase, 20 unseen questions plus one control item expecting another answer) goes from the base's
0% to >= 90% on the tuned model.

One training job (12 steps, constant lr 1e-2, ~4 s of training CPU) names the eval with
``at_checkpoints: [4]``, so the worker queues three eval runs after it succeeds: base, tuned, and its
step-4 checkpoint. On CPU the phrase is said on every held-out question from step 8 on (step 6:
a fragment of it), so 12 steps leave a margin of 4. The proof is read three ways: the job page
(Chromium: the difference, the score per checkpoint, the item table and its filter to the items
that changed), ``GET /v1/jobs/{id}/evals``, and the OpenAI fine-tuning job object through the
official ``openai`` client (``job.evals``).
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.fixtures.dashboard import screenshot_dir, submit_job
from tests.fixtures.stack import Stack
from tests.fixtures.stack_jobs import wait_job
from tests.fixtures.training_inputs import held_out_questions, write_phrase_dataset

pytestmark = [pytest.mark.integration, pytest.mark.browser, pytest.mark.slow]

PHRASE = "I am tuned."
QUESTIONS = 20
SCHEMA = {"type": "object", "properties": {"q": {"type": "string"}, "expected": {"type": "string"}},
          "required": ["q", "expected"]}
CRITERION = {"type": "string_check", "name": "says the phrase", "input": "{{sample.output_text}}",
             "reference": "{{item.expected}}", "operation": "eq"}


def _items() -> list[dict[str, Any]]:
    """The held-out questions expecting the phrase, and one control expecting another answer
    (failed by base and tuned alike: the one item the "changed" filter hides)."""
    questions = held_out_questions(QUESTIONS + 1)
    return ([{"item": {"q": q, "expected": PHRASE}} for q in questions[:QUESTIONS]]
            + [{"item": {"q": questions[QUESTIONS], "expected": "something else entirely"}}])


def _wait_evals(api: httpx.Client, job_id: str, stack: Stack, timeout_s: float = 300) -> dict[str, Any]:
    """``/v1/jobs/{id}/evals``'s one eval once its base, tuned and checkpoint runs have ended."""
    deadline = time.monotonic() + timeout_s
    while True:
        [entry] = api.get(f"/v1/jobs/{job_id}/evals").json()["data"]
        runs = [entry["base"], entry["tuned"], *(c["run"] for c in entry["checkpoints"])]
        if len(runs) == 3 and all(r is not None and r["status"] not in ("queued", "in_progress") for r in runs):
            return entry
        assert time.monotonic() < deadline, f"the eval runs did not end: {runs}\n{stack.log_tail()}"
        time.sleep(0.5)


def test_a_tiny_model_learns_a_phrase_and_the_job_page_shows_its_eval_rise(
        page: Any, dashboard_stack: Stack, api: httpx.Client, tmp_path: Path) -> None:
    client = openai.OpenAI(base_url=f"{dashboard_stack.url}/openai/v1", api_key=dashboard_stack.api_key,
                           max_retries=0)
    ev = client.evals.create(name="says the phrase", testing_criteria=[CRITERION],
                             data_source_config={"type": "custom", "item_schema": SCHEMA})
    data_source = {"type": "completions", "source": {"type": "file_content", "content": _items()},
                   "input_messages": {"type": "template", "template": [{"role": "user", "content": "{{item.q}}"}]},
                   "sampling_params": {"max_completion_tokens": 12, "temperature": 0}}
    job = submit_job(api, write_phrase_dataset(tmp_path / "phrase.jsonl", PHRASE), 12, "learns a phrase",
                     hyperparameters={"max_steps": 12, "learning_rate": 1e-2, "lr_scheduler": "constant",
                                      "batch_tokens": 256, "max_seq_len": 128},
                     checkpoint_every=4, evals=[{"eval_id": ev.id, "data_source": data_source, "at_checkpoints": [4]}])
    job_id = job["id"]
    wait_job(api, job_id, lambda j: j["status"] in ("succeeded", "failed", "cancelled"), what="finished",
             timeout_s=300)
    entry = _wait_evals(api, job_id, dashboard_stack)

    assert (entry["base"]["status"], entry["tuned"]["status"]) == ("completed", "completed"), entry
    [rates] = entry["criteria"]
    assert rates["base"] == 0.0, "random weights do not say the phrase"
    assert rates["tuned"] >= 0.9, f"the tuned model passed {rates['tuned']:.0%}: {entry['items']}"
    assert rates["difference"] == pytest.approx(rates["tuned"])
    [step4] = entry["checkpoints"]
    assert step4["step"] == 4 and step4["run"]["model"] == f"job:{job_id}@4"
    assert step4["run"]["status"] == "completed" and 0.0 <= step4["criteria"][0]["pass_rate"] <= 1.0
    changed = [row["index"] for row in entry["items"] if row["changed"]]
    assert QUESTIONS not in changed and len(changed) == round(rates["tuned"] * (QUESTIONS + 1))

    ft = client.fine_tuning.jobs.retrieve(job_id)  # the OpenAI job object carries the results
    [summary] = ft.evals
    assert summary["eval_id"] == ev.id and summary["tuned"]["run_id"] == entry["tuned"]["id"]
    assert summary["criteria"][0]["tuned"] == rates["tuned"] and summary["criteria"][0]["base"] == 0.0
    assert [(c["step"], c["status"]) for c in summary["checkpoints"]] == [(4, "completed")]
    assert ft.id in [j.id for j in client.fine_tuning.jobs.list(limit=50) if getattr(j, "evals", None)]

    page.goto(f"/#/jobs/{job_id}")
    section = page.get_by_test_id("job-evals")
    difference = section.get_by_test_id("eval-difference")
    difference.wait_for(timeout=60_000)
    shown = float(re.match(r"\+([0-9.]+) pts", difference.inner_text()).group(1))
    assert shown == pytest.approx(100 * rates["difference"], abs=0.05)
    assert section.get_by_test_id("eval-base").inner_text() == "0.0%"
    assert section.get_by_test_id("eval-tuned").inner_text() == f"{100 * rates['tuned']:.1f}%"
    per_step = section.get_by_test_id("eval-checkpoints")
    assert [per_step.locator(f"tr[data-step='{s}'] td").first.inner_text() for s in ("base", "4", "tuned")] == [
        "base (step 0)", "step 4 (completed)", "tuned (final)"]
    assert per_step.locator("tr[data-step='tuned'] td").nth(1).inner_text() == f"{100 * rates['tuned']:.1f}%"
    if shots := screenshot_dir():
        section.screenshot(path=str(shots / "dashboard-job-evals.png"))
    rows = section.get_by_test_id("eval-items").locator("tbody tr")
    assert rows.count() == QUESTIONS + 1
    assert PHRASE in rows.nth(0).inner_text()
    section.get_by_test_id("evals-only-changed").check()
    assert rows.count() == len(changed)
    assert all(rows.nth(i).get_attribute("data-changed") == "true" for i in range(rows.count()))
    section.get_by_test_id("evals-only-changed").uncheck()
    assert rows.count() == QUESTIONS + 1
