"""A batch generation job on CUDA (``trainer.generate.job``): its engine runs the ``triton``
attention backend with CUDA graphs for the decode-only steps (``Engine(cuda_graphs="auto")``), and
writes, greedy in fp32, the tokens of a run forced onto the ``torch`` backend without graphs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from trainer.generate import job as generate_job
from trainer.generate.engine import BACKEND_ENV, Engine
from trainer.generate.job_config import GenerateConfig
from trainer.parallel.distributed import World

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"),
]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from trainer.model.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", "llama")


def _run(tmp_path: Path, model: Path, name: str, monkeypatch: pytest.MonkeyPatch) -> tuple[list[dict], list[Engine]]:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Count to {i}:"}) + "\n" for i in range(11)))
    engines: list[Engine] = []

    class Recording(Engine):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            engines.append(self)

    monkeypatch.setattr(generate_job, "Engine", Recording)
    config = GenerateConfig(model=str(model), prompts_file=str(prompts), output_dir=str(tmp_path / name),
                            sampling={"max_tokens": 24, "temperature": 0.0, "ignore_eos": True}, slots=4,
                            chunk_prompts=11, device="cuda", dtype="float32")
    status = generate_job.run_generation(config, lambda *a, **k: None, World(rank=0, world_size=1, local_rank=0))
    assert status == "succeeded"
    lines = [json.loads(x) for x in config.completions_path.read_text().splitlines()]
    return lines, engines


def test_a_generation_job_on_cuda_replays_graphs_and_writes_the_eager_torch_tokens(tmp_path, tiny_llama, monkeypatch):
    graphed, engines = _run(tmp_path, tiny_llama, "graphed", monkeypatch)
    (engine,) = engines
    assert engine.backend == "triton" and engine.graphs is not None and engine.graphs.disabled is None
    assert engine.stats.graph_replays > 0
    monkeypatch.setenv(BACKEND_ENV, "torch")
    eager, engines = _run(tmp_path, tiny_llama, "eager", monkeypatch)
    assert engines[0].backend == "torch" and engines[0].graphs is None
    assert [[c["text"] for c in line["choices"]] for line in graphed] == \
        [[c["text"] for c in line["choices"]] for line in eager]
    assert all(c["tokens"] == 24 for line in graphed for c in line["choices"])
