"""Submission checks with the model's own tokenizer and files: POST /v1/jobs/preview and POST /v1/jobs.

The counts are the trainer's own (``trainer.data.dataset.load_samples``); a dataset that trains
nothing, a model whose config.json does not describe its weights, are 422s naming the field, and
nothing is stored. Eval rows and the job summary come from the worker's recorder.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select
from transformers import AutoTokenizer

from core.files.models import File
from core.jobs.models import Job
from tests.integration.helpers import spec
from trainer.data.dataset import load_samples
from worker.recorder import apply_events

pytestmark = pytest.mark.integration

CHAT = [{"messages": [{"role": "system", "content": "You answer in one short line."},
                      {"role": "user", "content": f"What is {i} plus one?"},
                      {"role": "assistant", "content": f"The answer is {i + 1}."}]} for i in range(6)]


def upload_records(client: TestClient, records: list[dict], purpose: str = "train") -> str:
    content = "".join(json.dumps(r) + "\n" for r in records)
    response = client.post("/v1/files", files={"file": ("d.jsonl", content)}, data={"purpose": purpose})
    assert response.status_code == 201, response.text
    return response.json()["id"]


def jobs(store) -> int:
    with store.sessions() as session:
        return session.scalar(select(func.count()).select_from(Job))


class TestPreview:
    def test_counts_are_the_trainers_and_the_example_marks_the_answer(self, client: TestClient, store, model_root: Path) -> None:
        file_id = upload_records(client, CHAT)
        response = client.post("/v1/jobs/preview", json=spec(file_id, hyperparameters={"max_seq_len": 128, "batch_tokens": 256}))
        assert response.status_code == 200, response.text
        report = response.json()
        with store.sessions() as session:
            path = session.get(File, file_id).path
        tokenizer = AutoTokenizer.from_pretrained(model_root / "tiny")
        samples = load_samples(path, tokenizer, "chat", 128)
        assert report["checked"] and report["format"] == "chat" and report["records"] == 6
        assert report["tokens"] == sum(len(s) for s in samples)
        assert report["trainable_tokens"] == sum(s.num_loss_tokens for s in samples)
        assert 0 < report["trainable_fraction"] < 1
        trained = "".join(run["text"] for run in report["example"] if run["trainable"])
        assert "The answer is 1." in trained and "What is 0" not in trained
        assert jobs(store) == 0, "a preview creates no job"

    def test_truncation_is_counted_and_warned(self, client: TestClient, store) -> None:
        long = {"prompt": "tell me ", "completion": "the cat sat on the mat " * 20}
        file_id = upload_records(client, [long, {"prompt": "hi", "completion": "hello there"}])
        body = spec(file_id, hyperparameters={"max_seq_len": 16, "batch_tokens": 64})
        report = client.post("/v1/jobs/preview", json=body).json()
        assert report["truncated_records"] == 1 and report["truncated_trainable_tokens"] > 0
        assert any("longer than max_seq_len=16" in w for w in report["warnings"])
        created = client.post("/v1/jobs", json=body)
        assert created.status_code == 201, created.text
        assert created.json()["preflight"]["warnings"] == report["warnings"], "the warnings are stored on the job"


    def test_a_low_trainable_fraction_is_a_warning_on_the_job(self, client: TestClient, store) -> None:
        system = "Follow the style guide: be brief, be kind, cite nothing, never use lists. " * 6
        records = [{"messages": [{"role": "system", "content": system}, {"role": "user", "content": "ok?"},
                                 {"role": "assistant", "content": "ok"}]} for _ in range(3)]
        created = client.post("/v1/jobs", json=spec(upload_records(client, records)))
        assert created.status_code == 201, created.text
        preflight = created.json()["preflight"]
        assert preflight["trainable_fraction"] < 0.05
        assert any(w.startswith("only ") and "trainable" in w for w in preflight["warnings"])


class TestRefusedAtTheDoor:
    def test_every_answer_cut_by_max_seq_len_is_422_naming_max_seq_len(self, client: TestClient, store) -> None:
        records = [{"prompt": "the cat sat on the mat " * 10, "completion": "yes"} for _ in range(3)]
        file_id = upload_records(client, records)
        body = spec(file_id, hyperparameters={"max_seq_len": 16, "batch_tokens": 64})
        for route in ("/v1/jobs", "/v1/jobs/preview"):
            response = client.post(route, json=body)
            assert response.status_code == 422, response.text
            error = response.json()["error"]
            assert error["param"] == "hyperparameters.max_seq_len"
            assert "every record is cut before its first trainable token" in error["message"]
        assert jobs(store) == 0

    def test_a_template_that_drops_the_assistant_turn_is_422_naming_why(self, client: TestClient, store, model_root: Path) -> None:
        config = json.loads((model_root / "tiny" / "tokenizer_config.json").read_text())
        (model_root / "tiny" / "chat_template.jinja").write_text(
            "{% for m in messages %}{% if m['role'] != 'assistant' %}{{ m['content'] }}\n{% endif %}{% endfor %}")
        config.pop("chat_template", None)
        (model_root / "tiny" / "tokenizer_config.json").write_text(json.dumps(config))
        response = client.post("/v1/jobs", json=spec(upload_records(client, CHAT)))
        assert response.status_code == 422, response.text
        error = response.json()["error"]
        assert error["param"] == "training_file" and "chat template puts no assistant tokens" in error["message"]
        assert jobs(store) == 0

    def test_a_config_that_claims_a_bigger_model_than_its_weights_is_422(self, client: TestClient, store, model_root: Path) -> None:
        path = model_root / "tiny" / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "hidden_size": 8192, "vocab_size": 128256,
                                    "num_hidden_layers": 80}))
        response = client.post("/v1/jobs", json=spec(upload_records(client, CHAT)))
        assert response.status_code == 422
        error = response.json()["error"]
        assert error["param"] == "model" and "hidden_size 8192" in error["message"] and "[512, 64]" in error["message"]

    @pytest.mark.parametrize(
        ("change", "wanted"),
        [({"model_type": "no-such-arch"}, "not an architecture"), (None, "no weight files")],
    )
    def test_unknown_architecture_or_missing_weights_are_422(
        self, client: TestClient, store, model_root: Path, change: dict | None, wanted: str
    ) -> None:
        tiny = model_root / "tiny"
        if change is None:
            (tiny / "model.safetensors").unlink()
        else:
            (tiny / "config.json").write_text(json.dumps({**json.loads((tiny / "config.json").read_text()), **change}))
        response = client.post("/v1/jobs", json=spec(upload_records(client, CHAT)))
        assert response.status_code == 422
        assert response.json()["error"]["param"] == "model" and wanted in response.json()["error"]["message"]
        assert jobs(store) == 0


class TestWeightsCheckedAtSubmission:
    """Issue 22 item 9: a model directory with a truncated .safetensors passed submission (only its
    header was read) and the job failed on the worker with ``SafetensorError ... incomplete metadata``."""

    def test_a_truncated_safetensors_is_422_naming_the_file_and_the_fix(self, client: TestClient, store,
                                                                        model_root: Path) -> None:
        weights = model_root / "tiny" / "model.safetensors"
        whole = weights.stat().st_size
        with weights.open("r+b") as fh:
            fh.truncate(whole - 100)
        body = spec(upload_records(client, CHAT))
        for route in ("/v1/jobs", "/v1/jobs/preview"):
            response = client.post(route, json=body)
            assert response.status_code == 422, response.text
            error = response.json()["error"]
            assert error["param"] == "model"
            assert "model.safetensors" in error["message"] and "re-download it" in error["message"]
            assert f"{whole - 100:,} bytes, but its header declares {whole:,}" in error["message"]
        assert jobs(store) == 0

    def test_a_safetensors_longer_than_its_header_says_is_422(self, client: TestClient, store,
                                                            model_root: Path) -> None:
        with (model_root / "tiny" / "model.safetensors").open("ab") as fh:
            fh.write(b"\0" * 10)
        response = client.post("/v1/jobs", json=spec(upload_records(client, CHAT)))
        assert response.status_code == 422
        assert "longer than its header says" in response.json()["error"]["message"]

    def test_a_shard_the_index_names_but_the_directory_lacks_is_422(self, client: TestClient, store,
                                                                  model_root: Path) -> None:
        tiny = model_root / "tiny"
        (tiny / "model.safetensors").rename(tiny / "model-00001-of-00002.safetensors")
        index = {"metadata": {}, "weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors",
                                                "lm_head.weight": "model-00002-of-00002.safetensors"}}
        (tiny / "model.safetensors.index.json").write_text(json.dumps(index))
        response = client.post("/v1/jobs", json=spec(upload_records(client, CHAT)))
        assert response.status_code == 422
        error = response.json()["error"]
        assert error["param"] == "model" and "model-00002-of-00002.safetensors" in error["message"]
        assert "re-download it" in error["message"]


class TestRepeatWarning:
    """Issue 22 item 9: ``max_steps: 10000000`` on a one-record file was accepted without a word."""

    def test_max_steps_that_repeat_a_one_record_file_are_a_warning_on_the_job(self, client: TestClient,
                                                                              store) -> None:
        body = spec(upload_records(client, CHAT[:1]), hyperparameters={"max_steps": 10_000_000})
        preview = client.post("/v1/jobs/preview", json=body).json()
        created = client.post("/v1/jobs", json=body)
        assert created.status_code == 201, created.text
        warnings = created.json()["preflight"]["warnings"]
        assert warnings == preview["warnings"]
        [repeat] = [w for w in warnings if w.startswith("max_steps ")]
        assert repeat.startswith("max_steps 10000000 repeats the training file about 10,000,000 times (one pass "
                                 "over its 1 record, ")
        assert repeat.endswith("is about 1 step); set epochs or fewer max_steps")

    def test_a_step_of_several_micro_batches_counts_them(self, client: TestClient, store) -> None:
        body = spec(upload_records(client, CHAT[:1]), hyperparameters={"max_steps": 60, "grad_accum": 2})
        warnings = client.post("/v1/jobs/preview", json=body).json()["warnings"]
        assert any(w.startswith("max_steps 60 repeats the training file about 120 times") for w in warnings), warnings

    def test_max_steps_within_a_hundred_passes_and_epochs_are_not_warned(self, client: TestClient, store) -> None:
        file_id = upload_records(client, CHAT)
        for hyperparameters in ({"max_steps": 100}, {"epochs": 3.0}):
            body = spec(file_id, hyperparameters=hyperparameters)
            warnings = client.post("/v1/jobs/preview", json=body).json()["warnings"]
            assert not any("repeats the training file" in w for w in warnings), warnings

    def test_an_unchecked_dataset_is_counted_by_its_records(self, client: TestClient, store) -> None:
        pair = {"input": {"messages": [{"role": "user", "content": "hi"}]},
                "preferred_output": [{"role": "assistant", "content": "hello"}],
                "non_preferred_output": [{"role": "assistant", "content": "go away"}]}
        body = spec(upload_records(client, [pair, pair]), objective="dpo", hyperparameters={"max_steps": 5000})
        created = client.post("/v1/jobs", json=body)
        assert created.status_code == 201, created.text
        preflight = created.json()["preflight"]
        assert preflight["checked"] is False
        assert ("max_steps 5000 repeats the training file at least 2,500 times (one pass over its 2 records is at "
                "most 2 steps); set epochs or fewer max_steps") in preflight["warnings"]


class TestResults:
    def test_eval_rows_in_metrics_and_the_summary_on_the_job(self, client: TestClient, store) -> None:
        job_id = client.post("/v1/jobs", json=spec(upload_records(client, CHAT))).json()["id"]
        step = {"epoch": 0.1, "lr": 1e-3, "tokens": 100, "sequences": 2, "step_ms": 1.0, "data_ms": 0.1,
                "forward_ms": 0.3, "backward_ms": 0.4, "optimizer_ms": 0.1, "tokens_per_s": 1e5, "mfu": None,
                "gpu_mem_allocated": None, "gpu_mem_reserved": None, "gpu_mem_peak": None, "host_rss": 1,
                "total_steps": 3}
        events = [
            {"type": "step", "step": 1, "loss": 2.0, "grad_norm": 1.0, **step},
            {"type": "step", "step": 2, "loss": None, "grad_norm": None, **step},
            {"type": "skip", "step": 2, "loss": None, "grad_norm": None, "consecutive": 1, "limit": 3, "first_step": 2},
            {"type": "eval", "step": 2, "loss": 1.8, "tokens": 40},
            {"type": "step", "step": 3, "loss": 1.5, "grad_norm": 1.0, **step},
            {"type": "eval", "step": 3, "loss": 1.9, "tokens": 40},
            {"type": "sample", "step": 3, "final": True, "samples": [{"prompt": "hi", "completion": "hello", "tokens": 1}]},
        ]
        with store.sessions.begin() as session:
            apply_events(session, job_id, events)
        metrics = client.get(f"/v1/jobs/{job_id}/metrics").json()
        assert [(e["step"], e["loss"], e["tokens"]) for e in metrics["eval"]] == [(2, 1.8, 40), (3, 1.9, 40)]
        assert client.get(f"/v1/jobs/{job_id}").json()["summary"] == {
            "final_train_loss": 1.5, "best_train_loss": 1.5, "trained_tokens": 200, "steps": 3, "skipped_steps": 1,
            "final_eval_loss": 1.9, "best_eval_loss": 1.8, "best_eval_step": 2,
        }


class TestHubModels:
    """A hub id not in the local cache is looked up at submission (issue 15, item 6)."""

    @pytest.fixture(autouse=True)
    def _online_box_with_empty_cache(self, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))

    def test_a_box_that_cannot_reach_the_hub_refuses_an_uncached_id(
        self, client: TestClient, store, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        from tests.fixtures.stack import free_port

        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{free_port()}")  # nothing listens: offline
        response = client.post("/v1/jobs", json=spec(upload_records(client, CHAT), model="meta-llama/Does-Not-Exist-9B"))
        assert response.status_code == 422
        error = response.json()["error"]
        assert error["param"] == "model" and "cannot be reached" in error["message"]
        assert "huggingface-cli download meta-llama/Does-Not-Exist-9B" in error["message"]
        assert jobs(store) == 0

    def test_an_id_the_hub_does_not_know_is_refused_and_a_known_one_is_accepted_unchecked(
        self, client: TestClient, store, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        from tests.integration.fake_hub import FakeHub

        file_id = upload_records(client, CHAT)
        with FakeHub({"Qwen/Qwen3-0.6B"}) as hub:
            monkeypatch.setenv("HF_ENDPOINT", hub.url)
            missing = client.post("/v1/jobs", json=spec(file_id, model="meta-llama/Does-Not-Exist-9B"))
            known = client.post("/v1/jobs", json=spec(file_id, model="Qwen/Qwen3-0.6B"))
        assert missing.status_code == 422 and "the hub has no such model" in missing.json()["error"]["message"]
        assert known.status_code == 201, known.text
        preflight = known.json()["preflight"]  # its tokenizer is not on this box: accepted, said so
        assert preflight["checked"] is False and "not in this box's Hugging Face cache" in preflight["note"]


class TestRecordBounds:
    def test_a_conversation_over_the_message_bound_is_422_naming_the_line_and_the_bound(
            self, store, settings, admin_key: str) -> None:
        from api.app import create_app
        from tests.integration.helpers import bearer

        long = {"messages": [{"role": role, "content": f"{role} {i}"} for i in range(30) for role in ("user", "assistant")]}
        with TestClient(create_app(settings.model_copy(update={"record_max_messages": 50})),
                        headers=bearer(admin_key)) as client:
            file_id = upload_records(client, [*CHAT[:2], long])
            for route in ("/v1/jobs/preview", "/v1/jobs"):
                response = client.post(route, json=spec(file_id))
                assert response.status_code == 422, response.text
                error = response.json()["error"]
                assert error["param"] == "training_file"
                assert error["message"].startswith("training_file: line 3: 60 messages, more than the 50 a record may "
                                                   "have (FTQ_RECORD_MAX_MESSAGES)")
        assert jobs(store) == 0
