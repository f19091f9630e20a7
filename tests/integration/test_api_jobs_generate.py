"""A generation job's prompts at the door (``POST /v1/jobs`` with ``kind: generate`` and
``POST /v1/jobs/generate/preview``, both stores): with a local model each prompt is tokenized as the
trainer will tokenize it, in the tokenizer pool, and a prompt + ``sampling.max_tokens`` over the
model's context (``max_position_embeddings``) or ``FTQ_GENERATE_MAX_LEN`` is a 422 naming its line
and the field to change; nothing is stored. A full fine-tune whose ``model/`` has no tokenizer files
(saved before full jobs kept one) is counted with its base's tokenizer, and refused naming ``model``
without its base. The job itself runs in tests/integration/e2e/test_generate_e2e.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select
from transformers import AutoTokenizer

from api.app import create_app
from core.jobs import artifact_store
from core.jobs.models import Job
from core.settings import Settings
from tests.integration.helpers import bearer, finish, spec, upload
from trainer.generate.job import encode
from trainer.generate.prompts import parse_line

pytestmark = pytest.mark.integration

PROMPTS = [{"prompt": "Once upon a time"}, {"messages": [{"role": "user", "content": "Say hello."}]}]
CONTEXT = 4096
"""The tiny model's ``max_position_embeddings`` (``trainer.model.tiny``)."""


def upload_prompts(client: TestClient, records: list[dict[str, Any]]) -> str:
    content = "".join(json.dumps(r) + "\n" for r in records)
    response = client.post("/v1/files", files={"file": ("p.jsonl", content)}, data={"purpose": "generate"})
    assert response.status_code == 201, response.text
    return response.json()["id"]


def generation(prompts_file: str, max_tokens: int) -> dict[str, Any]:
    return {"kind": "generate", "model": "tiny", "prompts_file": prompts_file, "sampling": {"max_tokens": max_tokens}}


def prompt_tokens(model_root: Path, records: list[dict[str, Any]]) -> list[int]:
    """What the trainer's ``encode`` makes of each record with the tiny model's tokenizer."""
    tokenizer = AutoTokenizer.from_pretrained(model_root / "tiny")
    return [len(encode(parse_line(json.dumps(r), i + 1, i), tokenizer)) for i, r in enumerate(records)]


def jobs(store) -> int:
    with store.sessions() as session:
        return session.scalar(select(func.count()).select_from(Job))


class TestPromptLengths:
    def test_a_job_that_fits_is_queued_with_its_prompts_tokens(self, client: TestClient, model_root: Path) -> None:
        tokens = prompt_tokens(model_root, PROMPTS)
        file_id = upload_prompts(client, PROMPTS)
        preview = client.post("/v1/jobs/generate/preview", json=generation(file_id, 32))
        assert preview.status_code == 200, preview.text
        created = client.post("/v1/jobs", json=generation(file_id, 32))
        assert created.status_code == 201, created.text
        for report in (preview.json(), created.json()["preflight"]):
            assert (report["records"], report["tokens"], report["max_seq_len"]) == (2, sum(tokens), CONTEXT)
            assert f"the longest prompt is {max(tokens)} tokens" in report["note"], report["note"]

    def test_max_tokens_past_the_context_is_refused_naming_the_line_and_the_most_it_may_be(
        self, client: TestClient, store, model_root: Path
    ) -> None:
        first = prompt_tokens(model_root, PROMPTS)[0]
        file_id = upload_prompts(client, PROMPTS)
        for url in ("/v1/jobs/generate/preview", "/v1/jobs"):
            refused = client.post(url, json=generation(file_id, CONTEXT - first + 1))
            assert refused.status_code == 422, refused.text
            error = refused.json()["error"]
            assert (error["param"], error["line"]) == ("sampling.max_tokens", 1), error
            assert error["message"].startswith(f"prompts_file: line 1: the prompt is {first} tokens + sampling.max_tokens")
            assert f"over the 4,096 the model holds (max_position_embeddings" in error["message"]
            assert f"set sampling.max_tokens to at most {CONTEXT - first:,}" in error["message"]
        assert jobs(store) == 0
        assert client.post("/v1/jobs", json=generation(file_id, CONTEXT - max(prompt_tokens(model_root, PROMPTS)))
                           ).status_code == 201

    def test_the_boxs_cap_refuses_a_prompt_longer_than_it(self, settings: Settings, admin_key: str, store,
                                                          model_root: Path) -> None:
        records = [{"prompt": "short"}, {"prompt": " ".join(["word"] * 40)}]
        short, long = prompt_tokens(model_root, records)
        capped = settings.model_copy(update={"generate_max_len": short + 4})
        with TestClient(create_app(capped), headers=bearer(admin_key)) as client:
            refused = client.post("/v1/jobs", json=generation(upload_prompts(client, records), 4))
        assert refused.status_code == 422, refused.text
        error = refused.json()["error"]
        assert (error["param"], error["line"]) == ("prompts_file", 2), error
        assert f"the prompt is {long} tokens, the model holds {short + 4} (FTQ_GENERATE_MAX_LEN)" in error["message"]
        assert jobs(store) == 0


def old_full_job(client: TestClient, store, settings: Settings, model_root: Path) -> str:
    """A succeeded full fine-tune of ``tiny`` whose ``model/`` is what ``save_pretrained`` of the
    model alone wrote (config and weights): a full job that finished before it kept the tokenizer."""
    created = client.post("/v1/jobs", json=spec(upload(client), method="full"))
    assert created.status_code == 201, created.text
    job_id = created.json()["id"]
    finish(store, job_id)
    weights = artifact_store.final_store_dir(settings, job_id, "full")
    weights.mkdir(parents=True)
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(model_root / "tiny" / name, weights / name)
    return job_id


class TestFullJobWithoutTokenizer:
    def test_its_prompts_are_counted_with_its_bases_tokenizer(self, client: TestClient, store, settings: Settings,
                                                              model_root: Path) -> None:
        job_id = old_full_job(client, store, settings, model_root)
        tokens = prompt_tokens(model_root, PROMPTS)
        created = client.post("/v1/jobs", json={**generation(upload_prompts(client, PROMPTS), 32),
                                                "model": f"job:{job_id}"})
        assert created.status_code == 201, created.text
        report = created.json()["preflight"]
        assert (report["tokens"], report["max_seq_len"]) == (sum(tokens), CONTEXT), report
        assert "the base's tokenizer and chat template are used" in report["note"], report["note"]

    def test_without_its_base_it_is_refused_naming_model_and_the_base(self, client: TestClient, store,
                                                                      settings: Settings, model_root: Path) -> None:
        job_id = old_full_job(client, store, settings, model_root)
        file_id = upload_prompts(client, PROMPTS)
        shutil.rmtree(model_root / "tiny")
        before = jobs(store)
        refused = client.post("/v1/jobs", json={**generation(file_id, 32), "model": f"job:{job_id}"})
        assert refused.status_code == 422, refused.text
        error = refused.json()["error"]
        assert error["param"] == "model", error
        assert f"job {job_id}'s model/ has no tokenizer files" in error["message"], error
        assert "its base 'tiny'" in error["message"] and "not available here" in error["message"], error
        assert jobs(store) == before
