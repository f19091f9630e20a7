"""An eval run with model graders on CUDA (``trainer.evals.judges``): the evaluated tiny model judges
itself (reused, not loaded again) and a second tiny model judges through a ``label_model`` inside a
``multi``; both judges' engines run on the GPU (the Triton decode backend) and every item is graded,
an unreadable answer (random weights: most are) failing only that item's criterion.

Run on the lent GPU: ``python -m pytest -m gpu tests/gpu/test_eval_judges_gpu.py``; the CPU twin is
``tests/unit/trainer/evals/test_eval_judges.py``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit" / "trainer"))
from trainer_helpers import tiny_model_for_gpu  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.timeout(600),
]

ITEMS = [{"q": f"What is {i} plus {i}?", "answer": str(2 * i)} for i in range(8)]


def test_an_eval_run_judges_with_two_models_on_the_gpu(tmp_path, monkeypatch) -> None:
    from trainer.evals import judges as eval_judges
    from trainer.evals import run as eval_run
    from trainer.evals.config import EvalConfig
    from trainer.graders import validate
    from trainer.parallel.distributed import World

    model_dir = tiny_model_for_gpu(tmp_path / "evaluated")
    other_dir = tiny_model_for_gpu(tmp_path / "other")
    quality = validate({"type": "score_model", "name": "quality", "model": "self", "range": [0, 1],
                        "sampling_params": {"max_completions_tokens": 4},
                        "input": [{"role": "user", "content": "Rate: {{sample.output_text}}"}]}, "testing_criteria[0]")
    tone = validate({"type": "multi", "name": "tone", "calculate_output": "label", "graders": {
        "label": {"type": "label_model", "name": "label", "model": "other", "labels": ["good", "bad"],
                  "passing_labels": ["good"], "sampling_params": {"max_completions_tokens": 4},
                  "input": [{"role": "user", "content": "{{sample.output_text}}"}]}}}, "testing_criteria[1]")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"messages": [{"role": "user", "content": i["q"]}], "item": i}) + "\n"
                               for i in ITEMS))
    config = EvalConfig(model=str(model_dir), prompts_file=str(prompts), output_dir=str(tmp_path / "out"),
                        sampling={"max_tokens": 4, "temperature": 0.0}, slots=4, chunk_prompts=4, device="cuda",
                        testing_criteria=[quality, tone],
                        judges={"self": {"model": str(model_dir), "adapter": None, "tokenizer": None},
                                "other": {"model": str(other_dir), "adapter": None, "tokenizer": None}})
    engines: list[tuple[str, str]] = []
    real_engine_judge = eval_judges.engine_judge

    def spy(engine, tokenizer):
        engines.append((engine.device.type, engine.backend))
        return real_engine_judge(engine, tokenizer)

    monkeypatch.setattr(eval_judges, "engine_judge", spy)
    assert eval_run.run_eval(config, lambda *_a, **_k: None, World(rank=0, world_size=1, local_rank=0)) == "succeeded"
    assert engines and set(engines) == {("cuda", "triton")}, engines  # a judge engine is rebuilt as its cache grows
    lines = [json.loads(x) for x in config.completions_path.read_text().splitlines()]
    assert [line["item"] for line in lines] == ITEMS
    for line in lines:
        assert [r["name"] for r in line["results"]] == ["quality", "tone"]
        for result in line["results"]:
            assert result["error"] or 0.0 <= result["score"] <= 1.0, result
