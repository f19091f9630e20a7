"""api.openai.auto: docs/openai.md's rule for OpenAI's ``"auto"`` hyperparameters, hand-checked."""

from __future__ import annotations

import pytest

from api.openai import auto


@pytest.mark.parametrize(("n", "epochs"), [(1, 10), (40, 8), (100, 3), (1000, 3), (10_000, 3), (20_000, 1),
                                           (100_000, 1)])
def test_epochs_keep_the_examples_seen_between_300_and_30000(n, epochs):
    assert auto.auto_epochs(n) == epochs


@pytest.mark.parametrize(("n", "batch"), [(1, 1), (63, 1), (64, 2), (1000, 16), (4096, 64), (10**6, 64)])
def test_batch_size_is_n_over_32_as_a_power_of_two(n, batch):
    assert auto.auto_batch_size(n) == batch


@pytest.mark.parametrize(("batch", "multiplier"), [(1, 0.5), (8, 1.0), (16, 1.4142), (64, 2.0)])
def test_lr_multiplier_grows_with_the_square_root_of_the_batch(batch, multiplier):
    assert auto.auto_lr_multiplier(batch) == multiplier


def test_given_values_win_and_beta_is_only_for_dpo():
    sft = auto.resolve({"n_epochs": 2, "batch_size": "auto"}, num_records=1000, dpo=False)
    assert (sft.n_epochs, sft.batch_size, sft.learning_rate_multiplier, sft.beta) == (2, 16, 1.4142, None)
    dpo = auto.resolve({"beta": "auto", "learning_rate_multiplier": 0.3}, num_records=1000, dpo=True)
    assert (dpo.beta, dpo.learning_rate_multiplier) == (0.1, 0.3)
    assert dpo.as_openai() == {"batch_size": 16, "learning_rate_multiplier": 0.3, "n_epochs": 3, "beta": 0.1}


def test_batch_size_becomes_a_token_budget_never_below_the_longest_sample():
    stats = {"chars_per_record": {"mean": 300.0, "max": 1000}}
    hp = auto.ftq_hyperparameters(auto.Resolved(3, 16, 1.0, None), stats, seed=5, dpo=False)
    # max_seq_len: next power of two above 1000 + 64; budget: 16 x (300 / 3 + 32) rounded up to 64.
    assert hp == {"epochs": 3.0, "learning_rate": 2e-4, "max_seq_len": 2048, "batch_tokens": 2112, "seed": 5}
    small = auto.ftq_hyperparameters(auto.Resolved(3, 1, 1.0, None), stats, seed=5, dpo=False)
    assert small["batch_tokens"] == small["max_seq_len"] == 2048
    pairs = auto.ftq_hyperparameters(auto.Resolved(3, 1, 1.0, 0.1), stats, seed=5, dpo=True)
    assert pairs["batch_tokens"] == 2 * pairs["max_seq_len"], "a pair's two sequences fit one packed batch"
