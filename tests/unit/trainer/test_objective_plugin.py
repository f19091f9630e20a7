"""A new objective from outside the packages: token-weighted SFT, declared and implemented here alone.

This module is the whole of it (one file: the seam's proof). Its records are ``{"text": ...,
"weight": w}`` (format ``weighted_text``); each token's cross-entropy is multiplied by its record's
weight, packed beside the targets as a per-position tensor (``PackedBatch.extras``); the step event
gains ``mean_token_weight`` (the step's weighted target count over its target count), summed on the
device and read one step late like every objective's fields. A fixture registers it for a test and
removes it after; ``trainer.run`` then trains a tiny job with it, end to end.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from trainer_helpers import Recorder, make_job, write_jsonl

from trainer import objectives
from trainer.config import DataConfig, OptimConfig, TrainConfig
from trainer.data.dataset import IGNORE_INDEX, Sample, read_records
from trainer.errors import DatasetError
from trainer.training.flops import FlopCounter
from trainer.features.loss.packed_forward import packed_forward
from trainer.data.packing import PackedBatch, pack_batch
from trainer.training.train import run

NAME, FORMAT, FIELD = "weighted_sft", "weighted_text", "mean_token_weight"
WEIGHTS = (0.5, 2.0)


@dataclasses.dataclass(frozen=True)
class WeightedSample(Sample):
    weight: float = 1.0


class WeightedSft:
    """The toy objective's torch side (``trainer.objectives.base.Objective``)."""

    def __init__(self) -> None:
        self.last: torch.Tensor | None = None

    def load_data(self, config: TrainConfig, tokenizer: Any) -> tuple[list[WeightedSample], None]:
        eos = [tokenizer.eos_token_id]
        items = []
        for number, record in read_records(config.data.train_path):
            if not isinstance(record.get("text"), str) or not isinstance(record.get("weight"), (int, float)):
                raise DatasetError(f"{config.data.train_path}, line {number}: expected {{'text': ..., 'weight': ...}}")
            ids = (tokenizer(record["text"])["input_ids"] + eos)[: config.data.max_seq_len]
            items.append(WeightedSample(ids, list(ids), float(record["weight"])))
        return items, None

    def pack(self, items: Sequence[WeightedSample]) -> PackedBatch:
        weights = [item.weight for item in items for _ in range(len(item))]
        return dataclasses.replace(pack_batch(items), extras={"weights": torch.tensor([weights])})

    def build_loss(self, config: TrainConfig, model: torch.nn.Module, installed: Any, strategy: str | None) -> Any:
        return self.loss

    def loss(self, model: torch.nn.Module, batch: PackedBatch, meta: Any, num_items: int) -> torch.Tensor:
        logits = packed_forward(model, batch, meta)
        targets_T = batch.targets.reshape(-1)
        ce_T = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets_T, ignore_index=IGNORE_INDEX,
                               reduction="none")
        weights_T = batch.extras["weights"].reshape(-1) * (targets_T != IGNORE_INDEX)
        self.last = weights_T.sum().detach().reshape(1)
        return (ce_T * weights_T).sum() / max(int(num_items), 1)

    def new_stats(self, device: torch.device) -> torch.Tensor:
        return torch.zeros(1, dtype=torch.float32, device=device)

    @contextmanager
    def collecting(self, stats: torch.Tensor | None) -> Iterator[None]:
        yield
        if stats is not None:
            stats += self.last

    def step_fields(self, sums: Sequence[float], targets: int) -> dict[str, float | None]:
        return {FIELD: sums[0] / max(targets, 1)}

    def eval_accuracy(self, sums: Sequence[float], targets: int) -> float | None:
        return None

    def step_flops(self, counter: FlopCounter, items: Sequence[Any]) -> float:
        return counter.step_flops([len(item) for item in items])


@pytest.fixture
def weighted_sft() -> Iterator[objectives.Declaration]:
    declared = objectives.register(objectives.Declaration(
        name=NAME, title="Weighted SFT", formats=(FORMAT,), implementation=WeightedSft,
        metrics=(objectives.MetricField(FIELD, "weight", "weight", "Mean weight of the step's target tokens."),),
        charts=(objectives.Chart("token-weight", "Mean token weight", (FIELD,)),),
    ))
    yield declared
    objectives.unregister(NAME)


def test_a_registered_objective_trains_a_tiny_job_end_to_end(tmp_path, tiny_model_dir, weighted_sft) -> None:
    records = [{"text": f"The answer is {i % 5 + 1}. The model trains.", "weight": WEIGHTS[i % 2]} for i in range(24)]
    train = write_jsonl(tmp_path / "weighted.jsonl", records)
    config = make_job(tmp_path, tiny_model_dir, objective=NAME,
                      data=DataConfig(str(train), format=FORMAT, max_seq_len=64, batch_tokens=256),
                      optim=OptimConfig(max_steps=6, learning_rate=1e-2, warmup_steps=1))
    recorder = Recorder()  # checks every event as the worker would (make_event)
    result = run(config, recorder)
    assert result.status == "succeeded", result.message
    steps = recorder.of("step")
    assert [s["step"] for s in steps] == list(range(1, 7))
    for step in steps:
        assert min(WEIGHTS) <= step[FIELD] <= max(WEIGHTS), step
        assert all(step[name] is None for name in objectives.metric_names() if name != FIELD)
        assert step["loss"] is not None and step["loss"] > 0
    assert steps[-1]["loss"] < steps[0]["loss"]
    assert recorder.of("checkpoint")[-1]["final"] is True


def test_the_objectives_weights_reach_its_loss(tiny_model_dir, weighted_sft) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    objective = objectives.load(NAME)
    ids = list(range(5, 17))
    half, double = (objective.pack([WeightedSample(ids, ids, w)]) for w in (0.5, 2.0))
    with torch.no_grad():
        assert objective.loss(model, double, None, 1).item() == pytest.approx(4 * objective.loss(model, half, None, 1).item())
    stats = objective.new_stats(torch.device("cpu"))
    with torch.no_grad(), objective.collecting(stats):
        objective.loss(model, double, None, 1)
    assert objective.step_fields(stats.tolist(), double.num_targets) == {FIELD: 2.0}


def test_it_leaves_the_registry_as_it_was(weighted_sft) -> None:
    assert NAME in objectives.names() and FIELD in objectives.metric_names()
    objectives.unregister(NAME)
    assert NAME not in objectives.names() and FIELD not in objectives.metric_names()
    with pytest.raises(ValueError, match="objective: 'weighted_sft' is not one of sft, dpo"):
        objectives.declaration(NAME)
    objectives.register(weighted_sft)  # the fixture removes it again
