"""``ftq models pull``: a model from a hub on localhost (``FakeHub``, ``HF_ENDPOINT``) into the model root.

The hub holds the suite's tiny random-weight Llama (``trainer.model.tiny``: a transformers config class,
the locally trained tokenizer) beside files a pull must leave (a ``.bin`` copy, ``onnx/``, a README).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from cli.main import main
from core.jobs.model_catalog import find_models
from core.jobs.model_source import resolve_model
from tests.integration.fake_hub import FakeHub

pytestmark = pytest.mark.integration

REPO = "org/tiny"
DECOYS = {"pytorch_model.bin": b"a pickle", "onnx/model.onnx": b"onnx", "README.md": b"# tiny\n",
          "consolidated.safetensors": b"never fetched"}


@pytest.fixture
def model_files(_tiny_model_template: Path) -> dict[str, bytes]:
    files = {p.name: p.read_bytes() for p in _tiny_model_template.iterdir() if p.is_file()}
    assert "model.safetensors" in files and "config.json" in files
    return files


@pytest.fixture
def hub(model_files: dict[str, bytes], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    with FakeHub() as hub:
        hub.add(REPO, {**model_files, **DECOYS})
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
        monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        monkeypatch.delenv("HF_TOKEN", raising=False)
        yield hub


@pytest.fixture
def root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("FTQ_CONFIG", str(tmp_path / "client.toml"))  # no key, no hf_token from the user's file
    root = tmp_path / "models"
    root.mkdir()
    return root


def pull(root: Path, *args: str) -> int:
    return main(["models", "pull", *args, "--model-root", str(root)])


def staged(root: Path) -> list[str]:
    """What a pull left in its staging area (its lock files stay)."""
    return sorted(str(p.relative_to(root)) for p in (root / ".pull").rglob("*") if not p.name.endswith(".lock"))


class TestPull:
    def test_lands_a_loadable_model_with_only_the_files_a_model_needs(
        self, hub: FakeHub, root: Path, model_files: dict[str, bytes]
    ) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        assert pull(root, REPO) == 0

        target = root / REPO
        assert sorted(p.name for p in target.iterdir()) == sorted(model_files)
        assert all((target / name).read_bytes() == content for name, content in model_files.items())
        assert staged(root) == []
        AutoModelForCausalLM.from_pretrained(target)
        assert AutoTokenizer.from_pretrained(target)("hello").input_ids
        assert resolve_model(REPO, model_root=root).kind == "local"
        [listed] = find_models(root)
        assert (listed.name, listed.architectures, listed.error) == (REPO, ("LlamaForCausalLM",), None)

    def test_an_interrupted_pull_continues_where_it_stopped(
        self, hub: FakeHub, root: Path, model_files: dict[str, bytes], capsys: pytest.CaptureFixture[str]
    ) -> None:
        hub.cut("model.safetensors", after=100_000)

        assert pull(root, REPO) == 2
        assert "stopped" in capsys.readouterr().err
        assert not (root / REPO).exists()
        part = root / ".pull" / REPO / "model.safetensors.part"
        assert part.stat().st_size == 100_000

        assert pull(root, REPO) == 0
        assert hub.downloads("model.safetensors") == [None, "bytes=100000-"]
        assert hub.downloads("config.json") == [None]  # files finished before the cut are kept
        assert (root / REPO / "model.safetensors").read_bytes() == model_files["model.safetensors"]
        assert staged(root) == []

    def test_a_truncated_safetensors_is_refused_naming_the_file(
        self, hub: FakeHub, root: Path, model_files: dict[str, bytes], capsys: pytest.CaptureFixture[str]
    ) -> None:
        hub.add("org/cut", {**model_files, "model.safetensors": model_files["model.safetensors"][:-4096]})

        assert pull(root, "org/cut") == 2

        err = capsys.readouterr().err
        assert "model.safetensors" in err and "re-download it" in err and "Nothing was installed" in err
        assert not (root / "org" / "cut").exists() and find_models(root) == []
        assert not (root / ".pull" / "org" / "cut" / "model.safetensors").exists()  # the next pull fetches it again

    def test_the_revision_passes_through(self, hub: FakeHub, root: Path, model_files: dict[str, bytes]) -> None:
        config = {**json.loads(model_files["config.json"]), "ftq_test_revision": "v1"}
        commit = hub.add(REPO, {**model_files, "config.json": json.dumps(config).encode()}, revision="v1")

        assert pull(root, REPO, "--revision", "v1") == 0

        assert json.loads((root / REPO / "config.json").read_text())["ftq_test_revision"] == "v1"
        paths = [path for _, path, _ in hub.requests]
        assert f"/api/models/{REPO}/revision/v1" in paths
        assert f"/{REPO}/resolve/{commit}/model.safetensors" in paths

    def test_a_pull_of_another_revision_discards_the_staged_files(
        self, hub: FakeHub, root: Path, model_files: dict[str, bytes]
    ) -> None:
        hub.cut("model.safetensors", after=100_000)
        assert pull(root, REPO) == 2
        hub.add(REPO, model_files, revision="v2")

        assert pull(root, REPO, "--revision", "v2") == 0
        assert hub.downloads("model.safetensors") == [None, None]
        assert (root / REPO / "model.safetensors").read_bytes() == model_files["model.safetensors"]

    @pytest.mark.parametrize(("repo", "args", "said"), [
        ("org/nope", (), "has no model org/nope"),
        (REPO, ("--revision", "nope"), "has no revision 'nope'"),
        ("not-a-hub-id", (), "is not a hub id"),
    ])
    def test_an_unknown_model_or_revision_is_refused_and_leaves_nothing(
        self, hub: FakeHub, root: Path, capsys: pytest.CaptureFixture[str], repo: str, args: tuple[str, ...], said: str
    ) -> None:
        assert pull(root, repo, *args) == 2
        assert said in capsys.readouterr().err
        assert find_models(root) == [] and staged(root) == []

    def test_a_repository_without_safetensors_is_refused(
        self, hub: FakeHub, root: Path, model_files: dict[str, bytes], capsys: pytest.CaptureFixture[str]
    ) -> None:
        hub.add("org/pickled", {"config.json": model_files["config.json"], "pytorch_model.bin": b"pickle"})
        assert pull(root, "org/pickled") == 2
        err = capsys.readouterr().err
        assert "no safetensors weights" in err and "pytorch_model.bin" in err

    def test_an_installed_model_is_not_overwritten(
        self, hub: FakeHub, root: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        (root / REPO).mkdir(parents=True)
        assert pull(root, REPO) == 2
        assert "already exists" in capsys.readouterr().err
        assert hub.requests == []
