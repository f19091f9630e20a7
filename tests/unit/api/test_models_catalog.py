"""``GET /v1/models``: model directories under the model root, with type, size and parameters."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from core.jobs.model_catalog import count_params, find_models
from core.migrate import upgrade
from core.settings import Settings
from tests.helpers import create_api_key


def write_safetensors(path: Path, shapes: dict[str, list[int]]) -> None:
    """A valid safetensors file of float32 zeros with the given tensor shapes."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in shapes.items():
        size = 4
        for dim in shape:
            size *= dim
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * offset)


def make_model(directory: Path, config: object, shapes: dict[str, list[int]] | None = None) -> Path:
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(config) if not isinstance(config, str) else config)
    if shapes is not None:
        write_safetensors(directory / "model.safetensors", shapes)
    return directory


class TestFindModels:
    def test_lists_model_dirs_with_type_size_and_exact_params(self, tmp_path: Path) -> None:
        root = tmp_path / "models"
        make_model(root / "tiny", {"model_type": "llama", "architectures": ["LlamaForCausalLM"]},
                   {"embed": [10, 4], "lm_head": [10, 4], "norm": [4]})
        make_model(root / "org" / "qwen", {"model_type": "qwen3"})
        (root / "empty-dir").mkdir()
        (root / ".hidden").mkdir()
        (root / ".hidden" / "config.json").write_text("{}")

        models = find_models(root)

        assert [m.name for m in models] == ["org/qwen", "tiny"]
        tiny = models[1]
        assert tiny.model_type == "llama"
        assert tiny.architectures == ("LlamaForCausalLM",)
        assert tiny.params == 10 * 4 + 10 * 4 + 4
        assert tiny.bytes == sum(p.stat().st_size for p in (root / "tiny").iterdir())
        assert tiny.error is None
        assert models[0].params is None and models[0].error is None

    def test_a_model_dir_is_a_leaf_its_checkpoints_are_not_models(self, tmp_path: Path) -> None:
        root = tmp_path / "models"
        make_model(root / "base", {"model_type": "llama"})
        make_model(root / "base" / "checkpoint-100", {"model_type": "llama"})
        assert [m.name for m in find_models(root)] == ["base"]

    def test_sharded_weights_are_summed(self, tmp_path: Path) -> None:
        directory = make_model(tmp_path / "m", {"model_type": "llama"})
        write_safetensors(directory / "model-00001-of-00002.safetensors", {"a": [3, 5]})
        write_safetensors(directory / "model-00002-of-00002.safetensors", {"b": [7]})
        assert count_params(directory) == (22, None)

    def test_unreadable_files_are_reported_not_raised(self, tmp_path: Path) -> None:
        root = tmp_path / "models"
        directory = make_model(root / "broken", "{not json")
        (directory / "model.safetensors").write_bytes(b"garbage that is not a header")
        [model] = find_models(root)
        assert model.params is None
        assert "config.json unreadable" in (model.error or "")
        assert "model.safetensors" in (model.error or "")

    def test_missing_root_is_an_empty_list(self, tmp_path: Path) -> None:
        assert find_models(tmp_path / "nowhere") == []

    def test_symlink_out_of_the_root_is_not_followed(self, tmp_path: Path) -> None:
        outside = make_model(tmp_path / "outside" / "secret", {"model_type": "llama"})
        root = tmp_path / "models"
        root.mkdir()
        (root / "link").symlink_to(outside.parent, target_is_directory=True)
        assert find_models(root) == []


@pytest.fixture(scope="module")
def store_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The app refuses an unmigrated store at start-up, so migrate one SQLite file per module."""
    url = f"sqlite:///{tmp_path_factory.mktemp('store') / 'ftq.db'}"
    upgrade(url)
    return url


@pytest.fixture(scope="module")
def api_key(store_url: str) -> str:
    return create_api_key(store_url)


@pytest.fixture
def client(tmp_path: Path, store_url: str, api_key: str) -> Iterator[TestClient]:
    root = tmp_path / "models"
    make_model(root / "tiny", {"model_type": "llama", "architectures": ["LlamaForCausalLM"]}, {"w": [2, 3]})
    settings = Settings(data_dir=tmp_path / "data", model_root=root, database_url=store_url)
    with TestClient(create_app(settings), headers={"Authorization": f"Bearer {api_key}"}) as test_client:
        yield test_client


def test_get_models_route(client: TestClient, tmp_path: Path) -> None:
    response = client.get("/v1/models")
    assert response.status_code == 200
    body = response.json()
    assert body["model_root"] == str((tmp_path / "models").resolve())
    [model] = body["data"]
    assert model["id"] == "tiny"
    assert model["object"] == "model"
    assert model["model_type"] == "llama"
    assert model["architectures"] == ["LlamaForCausalLM"]
    assert model["params"] == 6
    assert model["bytes"] > 0
    assert model["error"] is None


def test_a_config_that_does_not_describe_its_weights_is_listed_with_the_submissions_refusal(tmp_path: Path) -> None:
    root = tmp_path / "models"
    make_model(root / "liar", {"model_type": "llama", "vocab_size": 128256, "hidden_size": 8192},
               {"model.embed_tokens.weight": [10, 4]})
    [model] = find_models(root)
    assert model.params == 40
    assert "vocab_size 128256 and hidden_size 8192" in (model.error or "") and "[10, 4]" in model.error


def test_each_model_says_whether_it_fits_the_live_workers_gpus(client: TestClient, store_url: str, tmp_path: Path) -> None:
    from core.db import make_engine, make_sessionmaker
    from core.workers import pool
    from core.workers.models import Worker

    sizes = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 512}
    make_model(tmp_path / "models" / "sized", {"model_type": "llama", **sizes})
    unknown = {m["id"]: m["fit"] for m in client.get("/v1/models").json()["data"]}
    assert unknown["sized"]["lora"]["fits"] is None and unknown["sized"]["lora"]["gpus"] is None
    assert "no live worker has a GPU" in unknown["sized"]["lora"]["reason"]

    engine = make_engine(store_url)
    sessions = make_sessionmaker(engine)
    hardware = {"hardware": {"device": "cuda", "gpu_memory": 80 * 2**30, "bf16": True}, "plan": {}}
    try:
        with sessions() as session:
            session.add(Worker(worker_id="gpu-box", hostname="gpu-box", device="cuda:0,1", hardware=hardware))
            session.flush()
            pool.register_pool(session, "gpu-box", ["0", "1"])
            session.commit()

        fits = {m["id"]: m["fit"] for m in client.get("/v1/models").json()["data"]}
    finally:
        with sessions() as session:
            session.query(Worker).filter_by(worker_id="gpu-box").delete()
            session.commit()
        engine.dispose()
    assert fits["sized"]["lora"]["fits"] is True and fits["sized"]["lora"]["gpus"] == 1
    assert fits["sized"]["full"]["fits"] is True and 0 < fits["sized"]["full"]["peak_bytes"] < 80 * 2**30
    assert "1 GPU of gpu-box" in fits["sized"]["full"]["reason"]
    assert fits["tiny"]["lora"]["fits"] is None and "num_hidden_layers" in fits["tiny"]["lora"]["reason"]
