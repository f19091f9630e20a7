"""DPO at the API: objective and file format must agree (422 naming the file field), dpo settings
are validated and stored, and a DPO step's metrics come back from /metrics."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from tests.integration.helpers import spec, upload
from trainer.events import STEP_FIELDS, make_event
from worker.recorder import apply_events

pytestmark = pytest.mark.integration

PAIR = {
    "input": {"messages": [{"role": "user", "content": "hi"}]},
    "preferred_output": [{"role": "assistant", "content": "Hello!"}],
    "non_preferred_output": [{"role": "assistant", "content": "Go away."}],
}


class TestDpoJobs:
    def test_a_dpo_job_on_a_chat_file_names_the_training_file(self, client: TestClient) -> None:
        chat = upload(client)
        response = client.post("/v1/jobs", json=spec(chat, objective="dpo"))
        assert response.status_code == 422, response.text
        error = response.json()["error"]
        assert error["param"] == "training_file" and "preference" in error["message"] and "objective" in error["message"]

    def test_a_preference_validation_file_must_go_with_dpo_too(self, client: TestClient) -> None:
        pairs = upload(client, record=PAIR)
        chat_validation = upload(client, purpose="validation")
        response = client.post("/v1/jobs", json=spec(pairs, objective="dpo", validation_file=chat_validation))
        assert response.status_code == 422 and response.json()["error"]["param"] == "validation_file", response.text

    def test_bad_dpo_settings_name_the_field(self, client: TestClient) -> None:
        pairs = upload(client, record=PAIR)
        response = client.post("/v1/jobs", json=spec(pairs, objective="dpo", dpo={"beta": 0}))
        assert response.status_code == 422 and "dpo.beta" in response.text, response.text

    def test_a_dpo_job_is_stored_and_its_reward_metrics_are_served(self, client: TestClient, store) -> None:
        pairs = upload(client, record=PAIR)
        response = client.post("/v1/jobs", json=spec(pairs, objective="dpo", dpo={"beta": 0.25}))
        assert response.status_code == 201, response.text
        job = response.json()
        assert (job["spec"]["objective"], job["spec"]["dpo"]) == ("dpo", {"beta": 0.25, "label_smoothing": 0.0})
        step = {"step": 1, "total_steps": 3, "epoch": 0.3, "loss": 0.69, "lr": 1e-4, "grad_norm": 1.0, "tokens": 90,
                "sequences": 2, "step_ms": 10.0, "data_ms": 1.0, "forward_ms": 3.0, "backward_ms": 4.0,
                "optimizer_ms": 1.0, "tokens_per_s": 9000.0, "mfu": None, "gpu_mem_allocated": None,
                "gpu_mem_reserved": None, "gpu_mem_peak": None, "host_rss": 1, "ranks": None,
                "reward_margin": 0.125, "reward_accuracy": 0.5, "chosen_logp": -12.5, "rejected_logp": -20.25}
        step.update({k: None for k in STEP_FIELDS if k not in step})
        with store.sessions() as session:
            apply_events(session, job["id"], [make_event("step", **step)])
            session.commit()
        [row] = client.get(f"/v1/jobs/{job['id']}/metrics").json()["data"]
        assert {k: row[k] for k in ("reward_margin", "reward_accuracy", "chosen_logp", "rejected_logp")} == {
            "reward_margin": 0.125, "reward_accuracy": 0.5, "chosen_logp": -12.5, "rejected_logp": -20.25}


def test_token_stats_of_a_preference_file_count_both_sequences(client: TestClient, settings) -> None:
    from transformers import AutoTokenizer

    from trainer.objectives.preference import tokenize_pair
    from trainer.model.tiny import make_tiny_model

    model_dir = make_tiny_model(settings.model_root / "tiny", "llama")
    pairs = upload(client, record=PAIR)
    response = client.get(f"/v1/files/{pairs}/tokens", params={"model": "tiny", "max_seq_len": 4096})
    assert response.status_code == 200, response.text
    pair = tokenize_pair(PAIR, AutoTokenizer.from_pretrained(model_dir))
    body = response.json()
    assert body["records"] == 1 and body["tokens"]["total"] == len(pair.chosen) + len(pair.rejected)
    assert body["loss_tokens"]["total"] == pair.chosen.num_loss_tokens + pair.rejected.num_loss_tokens > 0
    assert body["over_max_seq_len"]["records"] == 0
