"""GET /v1/files/{id}/tokens: the numbers are the ones training's own tokenization gives."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient
from transformers import AutoTokenizer

from core.files.models import File
from core.settings import Settings
from tests.helpers import CHAT_RECORD
from trainer.dataset import read_records, tokenize_record
from trainer.tiny import make_tiny_model

pytestmark = pytest.mark.integration

RECORDS = [
    CHAT_RECORD,
    {"messages": [{"role": "system", "content": "be brief"}, *CHAT_RECORD["messages"]]},
    {
        "messages": [
            {"role": "user", "content": "count to twenty please " * 20},
            {
                "role": "assistant",
                "content": "one two three four five six seven eight nine ten " * 3,
            },
            {"role": "user", "content": "again"},
            {"role": "assistant", "content": "eleven twelve"},
        ]
    },
]


def upload(client: TestClient, records: list[dict]) -> str:
    content = "".join(json.dumps(r) + "\n" for r in records).encode()
    response = client.post(
        "/v1/files",
        files={"file": ("d.jsonl", content, "application/jsonl")},
        data={"purpose": "train"},
    )
    assert response.status_code == 201, response.text
    return response.json()["id"]


def test_stats_match_training_tokenization(
    client: TestClient, store, settings: Settings
) -> None:
    model_dir = make_tiny_model(settings.model_root / "tiny", "llama")
    file_id = upload(client, RECORDS)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    with store.sessions() as session:
        path = session.get(File, file_id).path
    samples = [tokenize_record(r, "chat", tokenizer) for _, r in read_records(path)]
    lengths = [len(s) for s in samples]
    loss = [s.num_loss_tokens for s in samples]
    max_seq_len = sorted(lengths)[1]  # exactly one record is longer

    response = client.get(
        f"/v1/files/{file_id}/tokens",
        params={"model": "tiny", "max_seq_len": max_seq_len},
    )

    assert response.status_code == 200, response.text
    body = response.json()
    assert body["file_id"] == file_id and body["model"] == "tiny"
    assert body["records"] == 3
    assert body["tokens"] == {
        "total": sum(lengths),
        "min": min(lengths),
        "mean": round(sum(lengths) / 3, 2),
        "max": max(lengths),
    }
    assert body["loss_tokens"] == {
        "total": sum(loss),
        "min": min(loss),
        "mean": round(sum(loss) / 3, 2),
        "max": max(loss),
    }
    assert 0 < body["loss_tokens"]["total"] < body["tokens"]["total"]
    assert body["over_max_seq_len"] == {"max_seq_len": max_seq_len, "records": 1}
    assert body["capped"] is False
    default = client.get(f"/v1/files/{file_id}/tokens", params={"model": "tiny"}).json()
    assert default["over_max_seq_len"] == {"max_seq_len": 4096, "records": 0}


def test_unknown_file_is_404(client: TestClient, settings: Settings) -> None:
    make_tiny_model(settings.model_root / "tiny", "llama")
    response = client.get("/v1/files/file-nope/tokens", params={"model": "tiny"})
    assert response.status_code == 404
    assert "file-nope" in response.text


@pytest.mark.parametrize(
    ("model", "fragment"),
    [
        ("../etc", "'..' is not allowed"),
        ("no such model", "not a hub id"),
        ("empty", "no config.json"),
    ],
)
def test_bad_model_is_422_with_the_resolvers_message(
    client: TestClient, settings: Settings, model: str, fragment: str
) -> None:
    (settings.model_root / "empty").mkdir(parents=True, exist_ok=True)
    file_id = upload(client, [CHAT_RECORD])
    response = client.get(f"/v1/files/{file_id}/tokens", params={"model": model})
    assert response.status_code == 422, response.text
    assert fragment in response.text


def test_model_without_tokenizer_is_422(client: TestClient, settings: Settings) -> None:
    bare = settings.model_root / "bare"
    bare.mkdir(parents=True)
    (bare / "config.json").write_text(json.dumps({"model_type": "llama"}))
    file_id = upload(client, [CHAT_RECORD])
    response = client.get(f"/v1/files/{file_id}/tokens", params={"model": "bare"})
    assert response.status_code == 422, response.text
    assert "no tokenizer could be loaded" in response.text
