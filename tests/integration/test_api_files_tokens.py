"""GET /v1/files/{id}/tokens: the numbers are the ones training's own tokenization gives."""

from __future__ import annotations

import json
import threading

import pytest
from fastapi.testclient import TestClient
from transformers import AutoTokenizer

from core.files.models import File
from core.settings import Settings
from tests.helpers import CHAT_RECORD
from tests.integration.helpers import bearer, make_user
from trainer.data.dataset import read_records, tokenize_record
from trainer.model.tiny import make_tiny_model

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


def _chat_lines(records: list[dict]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in records).encode()


def _upload_as(client: TestClient, key: str, records: list[dict]) -> str:
    response = client.post("/v1/files", files={"file": ("d.jsonl", _chat_lines(records), "application/jsonl")},
                           data={"purpose": "train"}, headers=bearer(key))
    assert response.status_code == 201, response.text
    return response.json()["id"]


def _turns(n: int) -> dict:
    return {"messages": [{"role": role, "content": f"{role} turn {i}"} for i in range(n) for role in ("user", "assistant")]}


@pytest.mark.parametrize(("bound", "record", "named"), [
    ({"record_max_messages": 10}, _turns(6), "12 messages, more than the 10 a record may have (FTQ_RECORD_MAX_MESSAGES)"),
    ({"record_max_chars": 200}, _turns(10), "characters, more than the 200 a record may have (FTQ_RECORD_MAX_CHARS)"),
])
def test_a_record_over_a_bound_is_422_naming_its_line_and_the_bound(store, settings: Settings, admin_key: str,
                                                                     bound: dict, record: dict, named: str) -> None:
    from api.app import create_app

    with TestClient(create_app(settings.model_copy(update=bound)), headers=bearer(admin_key)) as client:
        file_id = upload(client, [CHAT_RECORD, record])
        response = client.get(f"/v1/files/{file_id}/tokens", params={"model": "tiny"})
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["param"] == "file" and error["message"].startswith("file: line 2: ") and named in error["message"]


SPIN = "spin"
"""A record whose first message is this makes the template below loop for hours (10^10 empty
iterations in the sandbox's largest ranges): longer than any budget on any machine, so the budget
always runs out on it, and every other record renders at once."""


def _spinning_template(settings: Settings) -> None:
    model = settings.model_root / "tiny"
    config = json.loads((model / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    (model / "chat_template.jinja").write_text(
        f"{{% if messages[0]['content'] == '{SPIN}' %}}{{% for a in range(100000) %}}{{% for b in range(100000) %}}"
        "{% endfor %}{% endfor %}{% endif %}"
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{{ eos_token }}{% endfor %}")


@pytest.mark.slow  # ~25 s: two 10 s budgets run out one after the other
@pytest.mark.parametrize("store", ["sqlite"], indirect=True)  # the pool's fairness, not the store's
def test_a_slow_request_does_not_hold_back_another_users(store, settings: Settings) -> None:
    """Alice asks twice for a record that takes longer than any budget, then Bob for a small file:
    Bob is answered while Alice's second request still waits or runs, and each of Alice's answers
    422 naming the line; her next small request gets a fresh worker. The budget (10 s) only has to
    outlast Bob's small request on a warm pool (milliseconds; seconds on a loaded 2-core machine),
    and each budget spins a core, so it is kept short."""
    from api.app import create_app

    _spinning_template(settings)
    alice, bob = make_user(store, "alice"), make_user(store, "bob")
    slow = settings.model_copy(update={"tokenizer_workers": 2, "tokenizer_budget_s": 10.0})
    with TestClient(create_app(slow)) as client:
        spinning = {"messages": [{"role": "user", "content": SPIN}, {"role": "assistant", "content": "ok"}]}
        huge = _upload_as(client, alice, [spinning])
        small_alice, small_bob = _upload_as(client, alice, [CHAT_RECORD]), _upload_as(client, bob, RECORDS)
        warm = client.get(f"/v1/files/{small_alice}/tokens", params={"model": "tiny"}, headers=bearer(alice))
        assert warm.status_code == 200, warm.text  # the fork server is up: a worker starts in milliseconds
        done: dict[str, object] = {}

        def ask(name: str, key: str, file_id: str) -> None:
            done[name] = client.get(f"/v1/files/{file_id}/tokens", params={"model": "tiny"}, headers=bearer(key))

        alices = [threading.Thread(target=ask, args=(f"alice{i}", alice, huge)) for i in range(2)]
        for thread in alices:
            thread.start()
        pool = client.app_state["ftq"].tokenizers
        while pool.running < 1:  # alice's first holds a worker (her second waits: one is kept for others)
            threading.Event().wait(0.02)
        ask("bob", bob, small_bob)
        assert done["bob"].status_code == 200, done["bob"].text
        assert done["bob"].json()["records"] == len(RECORDS)
        assert any(thread.is_alive() for thread in alices), "bob was answered only after alice's requests ended"
        for thread in alices:
            thread.join(timeout=300)
        for name in ("alice0", "alice1"):
            assert done[name].status_code == 422, done[name].text
            error = done[name].json()["error"]
            assert error["param"] == "file" and error["message"].startswith("file: line 1: tokenizing took longer")
            assert "FTQ_TOKENIZER_BUDGET_S" in error["message"]
        again = client.get(f"/v1/files/{small_alice}/tokens", params={"model": "tiny"}, headers=bearer(alice))
        assert again.status_code == 200, again.text


def test_a_template_that_raises_on_a_record_is_422_naming_the_line(client: TestClient, settings: Settings) -> None:
    """Token statistics answered 500 for a record the model's template refuses (it is a 422 in the preflight)."""
    model = settings.model_root / "tiny"
    config = json.loads((model / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    (model / "chat_template.jinja").write_text(
        "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
        "{% for m in messages %}{{ m['content'] }}{{ eos_token }}{% endfor %}")
    file_id = upload(client, RECORDS)
    response = client.get(f"/v1/files/{file_id}/tokens", params={"model": "tiny"})
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["param"] == "file" and error["message"].startswith("file: line 2: the model's tokenizer or chat template fails")
    assert "System role not supported" in error["message"]


@pytest.mark.parametrize("store", ["sqlite"], indirect=True)
def test_the_api_starts_a_tokenizer_process_ahead_of_the_first_request(admin_key: str, settings: Settings) -> None:
    """``tokenizer_prestart`` (on by default; the suite turns it off): the API starts one worker
    as it starts, and the first token statistics use that worker instead of starting one."""
    from api.app import create_app

    with TestClient(create_app(settings.model_copy(update={"tokenizer_prestart": True})),
                    headers=bearer(admin_key)) as warm:
        pool = warm.app_state["ftq"].tokenizers
        assert pool._started == 1  # counted at once, so a request arriving now does not start a second
        deadline = threading.Event()
        for _ in range(3000):  # until the fork server has imported transformers and the worker is up
            if pool._idle:
                break
            deadline.wait(0.1)
        assert len(pool._idle) == 1, "the prestarted worker never became idle"
        started = pool._idle[0]
        response = warm.get(f"/v1/files/{upload(warm, RECORDS)}/tokens", params={"model": "tiny"})
        assert response.status_code == 200, response.text
        assert pool._started == 1 and pool._idle == [started], "the request started a worker of its own"
