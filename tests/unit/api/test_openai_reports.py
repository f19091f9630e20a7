"""api.openai.reports: ftq's stored events in OpenAI's event terms (level, message, type, data)."""

from __future__ import annotations

from api.openai.reports import _describe


def test_a_step_is_a_metrics_event_with_openai_names_and_dpo_fields_when_present():
    level, message, data, kind = _describe("step", {"step": 3, "total_steps": 10, "loss": 1.23456,
                                                    "token_accuracy": 0.5, "reward_margin": 0.2,
                                                    "reward_accuracy": None})
    assert (level, kind, message) == ("info", "metrics", "Step 3/10: training loss=1.2346")
    assert data == {"step": 3, "train_loss": 1.23456, "total_steps": 10, "train_mean_token_accuracy": 0.5,
                    "reward_margin": 0.2}


def test_an_eval_is_a_metrics_event_with_the_validation_columns():
    _, message, data, kind = _describe("eval", {"step": 5, "loss": 0.5, "tokens": 40, "accuracy": 0.75})
    assert kind == "metrics" and message == "Step 5: validation loss=0.5000"
    assert data["valid_loss"] == data["full_valid_loss"] == 0.5
    assert data["valid_mean_token_accuracy"] == data["full_valid_mean_token_accuracy"] == 0.75


def test_states_read_as_openai_messages():
    assert _describe("state", {"status": "succeeded"})[1] == "The job has successfully completed"
    level, message, _, _ = _describe("state", {"status": "failed", "message": "out of memory"})
    assert (level, message) == ("error", "The job failed: out of memory")
    assert "paused" in _describe("state", {"status": "cancelled", "paused": True})[1]
    assert _describe("state", {"status": "queued", "resumed": True})[1] == "Fine-tuning job resumed and queued"


def test_log_levels_map_to_openais():
    assert _describe("log", {"level": "warning", "message": "slow"})[:2] == ("warn", "slow")
    assert _describe("log", {"level": "debug", "message": "x"})[0] == "info"


def test_a_grpo_steps_rollouts_are_a_message_with_them_in_its_data():
    rollouts = [{"prompt": "2 + 2 =", "completion": " 4", "reward": 1.0, "scores": {"exact": 1.0}}]
    level, message, data, kind = _describe("rollouts", {"step": 4, "rollouts": rollouts})
    assert (level, kind, message) == ("info", "message", "Step 4: 1 rollouts shown")
    assert data == {"step": 4, "rollouts": rollouts}
