"""GRPO's loss (``trainer.objectives.grpo_loss``) against TRL 1.15's ``GRPOTrainer._compute_loss``.

Both sides get the same tiny Llama (fp32, LoRA r4 on every linear layer with B drawn non-zero, so
every gradient is non-trivial), the same 6 completions of 3 prompts (2 per group, 3 to 7 tokens
after prompts of 2 to 5), the same advantages (``group_advantages`` of fixed rewards, checked
against TRL's formula below), and the same old and reference log-probabilities: the current ones
plus fixed noise of 0.3, so that ratios leave the clip range on both sides and the KL is not 0.

TRL pads (prompts on the left, completions on the right) and scores the completion tokens with its
Triton chunked head; ftq packs the groups as ``Grpo.pack`` does, in both of its layouts: the six
sequences whole in one row with restarting positions, and with shared prompts (each prompt but its
last token once, its two completions after it seeing it as their prefix, positions continuing); it
runs the packed attention and reads each completion token's log-probability through its fused
chunked head (``packed_token_logprobs``). The comparison runs in a child process (``grpo_trl_reference.py``,
under ``TRITON_INTERPRET=1``: TRL's kernel runs on CPU only in Triton's interpreter). For each
variant (the four aggregations, GSPO's sequence-level ratios, asymmetric clipping, two-sided
clipping with ``delta`` and the KL term with and without its bias correction) the loss agrees within ``LOSS_RTOL`` and every LoRA
gradient within ``GRAD_RTOL`` relative L2 (fp32, the same sums in other orders).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from trainer_helpers import REPO_ROOT

from trainer.objectives.grpo_loss import GrpoLossConfig, group_advantages

HELPER = REPO_ROOT / "tests" / "unit" / "trainer" / "grpo_trl_reference.py"
VARIANTS = ("grpo", "bnpo", "dr_grpo", "dapo-asymmetric", "gspo", "grpo-delta-kl", "dapo-kl", "dapo-kl-uncorrected")
LOSS_RTOL = 1e-5
GRAD_RTOL = 1e-5
REWARDS = torch.tensor([1.0, 0.0, 0.5, 0.25, 2.0, -1.0])


@pytest.fixture(scope="module")
def report(tiny_model_dir, tmp_path_factory) -> dict:
    pytest.importorskip("trl")
    out = tmp_path_factory.mktemp("grpo-trl") / "report.json"
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO_ROOT), "PYTHONWARNINGS": "ignore",
           "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(HELPER), str(tiny_model_dir), str(out)], cwd=out.parent, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.slow  # TRL and its Triton kernel in the interpreter, in a child process
@pytest.mark.parametrize("layout", ["", "shared_"], ids=["whole", "shared_prompts"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_loss_and_lora_gradients_equal_trls(variant, layout, report) -> None:
    got = report[variant]
    assert got[f"{layout}grad_names_match"]
    assert got[f"{layout}ftq_loss"] == pytest.approx(got["trl_loss"], rel=LOSS_RTOL)
    assert abs(got["trl_loss"]) > 1e-3, "a loss near 0 would prove little"
    assert got[f"{layout}max_grad_rel_l2"] < GRAD_RTOL, got[f"{layout}worst_grad"]
    assert got[f"{layout}clipped_tokens"] > 0, "no ratio left the clip range: the clipping was not compared"


def test_group_advantages_follow_trls_formula() -> None:
    advantages, flat = group_advantages(REWARDS, 2)
    grouped = REWARDS.view(-1, 2)
    want = (grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)
    assert torch.allclose(advantages, want.reshape(-1)) and not flat.any()
    same, flat = group_advantages(torch.tensor([1.0, 1.0, 0.0, 1.0]), 2, scale="none")
    assert same.tolist() == [0.0, 0.0, -0.5, 0.5] and flat.tolist() == [True, True, False, False]
    with pytest.raises(ValueError, match="group_size: must be >= 2 and divide the 6 rewards, got 4"):
        group_advantages(REWARDS, 4)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("loss_type", "ppo", "grpo.loss_type: must be one of grpo, bnpo, dr_grpo, dapo, got 'ppo'"),
        ("epsilon_low", 1.5, "grpo.epsilon_low: must be a number in [0, 1), got 1.5"),
        ("delta", 1.1, "grpo.delta: must be null, or above 1 + epsilon_high, got 1.1"),
        ("importance_sampling_level", "sequence", "grpo.importance_sampling_level: sequence (GSPO)"),
        ("scale_rewards", "rank", "grpo.scale_rewards: must be one of group, batch, none, got 'rank'"),
    ],
)
def test_a_bad_setting_is_refused_naming_the_field(field, value, message) -> None:
    with pytest.raises(ValueError) as raised:
        GrpoLossConfig(**{field: value})
    assert str(raised.value).startswith(message)
