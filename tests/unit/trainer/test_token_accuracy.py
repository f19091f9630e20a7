"""Token accuracy: counted on the device inside the loss, equal to the argmax of the full logits,
only inside a step's collector, and reported by every SFT step (trainer.objectives.token_accuracy)."""

from __future__ import annotations

import pytest
import torch
from trainer_helpers import Recorder, make_job

from trainer.objectives import token_accuracy
from trainer.config import OptimConfig
from trainer.data.dataset import IGNORE_INDEX
from trainer.features.loss.fused import fused_linear_cross_entropy
from trainer.training.train import run


def _case(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    hidden_NH = torch.randn(37, 16, generator=gen)
    weight_VH = torch.randn(11, 16, generator=gen)
    labels_N = torch.randint(0, 11, (37,), generator=gen)
    labels_N[::4] = IGNORE_INDEX
    return hidden_NH, weight_VH, labels_N


def _reference(hidden_NH, weight_VH, labels_N) -> int:
    valid = labels_N != IGNORE_INDEX
    return int(((hidden_NH @ weight_VH.T).argmax(-1) == labels_N)[valid].sum())


def test_the_fused_loss_counts_what_the_full_logits_rank_first_across_chunks():
    hidden_NH, weight_VH, labels_N = _case()
    count = token_accuracy.new_count(torch.device("cpu"))
    with token_accuracy.counting(count):
        fused_linear_cross_entropy(hidden_NH, weight_VH, labels_N, chunk_size=8)
    expected = _reference(hidden_NH, weight_VH, labels_N)
    assert 0 < expected < int((labels_N != IGNORE_INDEX).sum())  # a case that can tell right from wrong
    assert count.item() == expected


def test_add_over_full_logits_counts_the_argmax_hits_of_valid_targets():
    hidden_NH, weight_VH, labels_N = _case(1)
    count = token_accuracy.new_count(torch.device("cpu"))
    with token_accuracy.counting(count):
        token_accuracy.add(hidden_NH @ weight_VH.T, labels_N, labels_N != IGNORE_INDEX)
    assert count.item() == _reference(hidden_NH, weight_VH, labels_N)


def test_nothing_is_counted_outside_a_collector_or_for_a_stand_in():
    hidden_NH, weight_VH, labels_N = _case(2)
    count = token_accuracy.new_count(torch.device("cpu"))
    fused_linear_cross_entropy(hidden_NH, weight_VH, labels_N)
    with token_accuracy.counting(count), token_accuracy.counting(None):
        fused_linear_cross_entropy(hidden_NH, weight_VH, labels_N)
    assert count.item() == 0


@pytest.mark.slow  # ~5-15 s: 20 steps of a tiny Llama on CPU
def test_every_sft_step_reports_an_accuracy_that_rises_as_it_learns(tmp_path, tiny_model_dir):
    recorder = Recorder()
    config = make_job(tmp_path, tiny_model_dir, optim=OptimConfig(max_steps=20, learning_rate=1e-2))
    assert run(config, recorder).status == "succeeded"
    accuracy = [e["token_accuracy"] for e in recorder.of("step")]
    assert all(a is not None and 0.0 <= a <= 1.0 for a in accuracy), accuracy
    assert sum(accuracy[-3:]) / 3 > sum(accuracy[:3]) / 3 + 0.2, accuracy


@pytest.mark.slow  # ~5-15 s: 6 steps of a tiny Llama on CPU, validated at the end
def test_the_eval_event_reports_the_validation_accuracy(tmp_path, tiny_model_dir):
    import dataclasses

    recorder = Recorder()
    config = make_job(tmp_path, tiny_model_dir, optim=OptimConfig(max_steps=6, learning_rate=1e-2))
    config = dataclasses.replace(config, data=dataclasses.replace(config.data, validation_path=config.data.train_path))
    assert run(config, recorder).status == "succeeded"
    [evaluation] = recorder.of("eval")
    assert evaluation["step"] == 6 and 0.0 < evaluation["accuracy"] <= 1.0
