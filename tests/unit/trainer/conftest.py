"""Fixtures for trainer tests: tiny models on disk, dataset writers, torch global state restored."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def restore_torch_state() -> Iterator[None]:
    """Undo what a test may change in torch's process-wide state (as litgpt's conftest does)."""
    import torch

    dtype = torch.get_default_dtype()
    deterministic = torch.are_deterministic_algorithms_enabled()
    grad = torch.is_grad_enabled()
    rng = torch.get_rng_state()
    yield
    torch.set_default_dtype(dtype)
    torch.use_deterministic_algorithms(deterministic)
    torch.set_grad_enabled(grad)
    torch.set_rng_state(rng)


@pytest.fixture
def one_thread() -> Iterator[None]:
    """One torch thread: tiny CPU matmuls skip thread hand-offs (slow on CI's 2 busy cores) and
    reductions sum in one order, so "equal" can mean bit for bit. Use with
    ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight Llama + tokenizer saved with save_pretrained (built once per session)."""
    from trainer.model.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama", seed=0)


@pytest.fixture(scope="session")
def tiny_tokenizer():
    from trainer.model.tiny import build_tokenizer

    return build_tokenizer()


class _TinyModels(dict):
    def __init__(self, tmp_path_factory: pytest.TempPathFactory) -> None:
        super().__init__()
        self.tmp_path_factory = tmp_path_factory

    def __missing__(self, arch: str) -> Path:
        from trainer.model.tiny import make_tiny_model

        self[arch] = make_tiny_model(self.tmp_path_factory.mktemp(f"tiny-{arch}"), arch, seed=3)
        return self[arch]


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny random-weight models with tokenizers on disk by architecture (``trainer.model.tiny``, seed
    3), each built on first use, once per session: ``tiny_models["qwen3_moe"]``."""
    return _TinyModels(tmp_path_factory)
