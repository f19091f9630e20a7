"""The tokenizer cache behind GET /v1/files/{id}/tokens: loaded once per model version, bounded."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from api.files import tokens
from core.jobs.model_source import ModelSource


@pytest.fixture(autouse=True)
def empty_cache():
    tokens._cache.clear()
    yield
    tokens._cache.clear()


@pytest.fixture
def loads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    seen: list[str] = []

    def fake_load(model: str, source: ModelSource) -> object:
        seen.append(source.name_or_path)
        return object()

    monkeypatch.setattr(tokens, "_load_tokenizer", fake_load)
    return seen


def _model_dir(root: Path, name: str) -> ModelSource:
    directory = root / name
    directory.mkdir()
    (directory / "tokenizer.json").write_text("{}")
    return ModelSource("local", str(directory))


def test_second_request_reuses_the_loaded_tokenizer(tmp_path: Path, loads: list[str]) -> None:
    source = _model_dir(tmp_path, "a")
    first = tokens.cached_tokenizer("a", source)
    second = tokens.cached_tokenizer("a", source)
    assert first is second and loads == [source.name_or_path]


def test_changed_tokenizer_files_load_again(tmp_path: Path, loads: list[str]) -> None:
    source = _model_dir(tmp_path, "a")
    first = tokens.cached_tokenizer("a", source)
    path = Path(source.name_or_path) / "tokenizer.json"
    path.write_text('{"changed": true}')
    os.utime(path, ns=(1, 10**18))  # a different mtime even on coarse filesystem clocks
    assert tokens.cached_tokenizer("a", source) is not first
    assert len(loads) == 2


def test_cache_keeps_the_most_recent_few(tmp_path: Path, loads: list[str]) -> None:
    sources = [_model_dir(tmp_path, f"m{i}") for i in range(tokens.TOKENIZER_CACHE_SIZE + 1)]
    for source in sources:
        tokens.cached_tokenizer(source.name_or_path, source)
    assert len(tokens._cache) == tokens.TOKENIZER_CACHE_SIZE
    tokens.cached_tokenizer("m0", sources[0])  # evicted first: loaded again
    assert loads.count(sources[0].name_or_path) == 2


def test_a_failed_load_is_not_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = _model_dir(tmp_path, "a")

    def broken(model: str, source: ModelSource) -> object:
        raise tokens.InvalidInput("no tokenizer")

    monkeypatch.setattr(tokens, "_load_tokenizer", broken)
    with pytest.raises(tokens.InvalidInput):
        tokens.cached_tokenizer("a", source)
    assert not tokens._cache
