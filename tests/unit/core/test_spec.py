"""core.jobs.spec: defaults, ranges, cross-field checks, messages that say what to fix."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from core.jobs.spec import JobSpec

FILE = "file-" + "a" * 24


def errors(**body) -> list[tuple[str, str]]:
    with pytest.raises(ValidationError) as info:
        JobSpec.model_validate({"model": "org/m", "training_file": FILE, **body})
    return [(".".join(str(p) for p in e["loc"]), e["msg"]) for e in info.value.errors()]


class TestJobSpec:
    def test_defaults_fill_every_section(self) -> None:
        spec = JobSpec(model="org/m", training_file=FILE)
        stored = spec.to_stored()
        assert stored["method"] == "lora"
        assert stored["lora"] == {"r": 16, "alpha": 16, "dropout": 0.0, "target_modules": ["all-linear"]}
        assert stored["hyperparameters"]["max_steps"] is None and stored["hyperparameters"]["epochs"] == 1.0
        assert spec.hyperparameters.epochs == 1.0
        assert JobSpec(model="org/m", training_file=FILE, hyperparameters={"epochs": None}).hyperparameters.epochs == 1
        assert stored["optimizations"] == {
            "packed_metadata_cache": "auto", "double_buffered_reload": "auto", "moe_grouped_routing": "auto",
            "offload_activations": "auto",
        }

    def test_unknown_fields_are_refused_at_every_level(self) -> None:
        assert errors(extra=1) == [("extra", "Extra inputs are not permitted")]
        assert errors(lora={"rank": 8})[0][0] == "lora.rank"
        assert errors(hyperparameters={"lr": 0.1})[0][0] == "hyperparameters.lr"
        assert errors(optimizations={"fused_ce": "on"})[0][0] == "optimizations.fused_ce"

    def test_length_is_max_steps_or_epochs_not_both(self) -> None:
        [(loc, msg)] = errors(hyperparameters={"max_steps": 10, "epochs": 2})
        assert loc == "hyperparameters.epochs" and "set max_steps or epochs, not both" in msg
        spec = JobSpec(model="org/m", training_file=FILE, hyperparameters={"epochs": 0.5})
        assert spec.hyperparameters.epochs == 0.5
        spec = JobSpec(model="org/m", training_file=FILE, hyperparameters={"max_steps": 7})
        assert spec.hyperparameters.epochs is None

    @pytest.mark.parametrize(
        ("hp", "loc"),
        [
            ({"learning_rate": 0}, "hyperparameters.learning_rate"),
            ({"learning_rate": 2}, "hyperparameters.learning_rate"),
            ({"warmup_steps": -1}, "hyperparameters.warmup_steps"),
            ({"grad_accum": 0}, "hyperparameters.grad_accum"),
            ({"max_seq_len": 4}, "hyperparameters.max_seq_len"),
            ({"seed": -1}, "hyperparameters.seed"),
            ({"lr_scheduler": "step"}, "hyperparameters.lr_scheduler"),
            ({"max_grad_norm": -0.5}, "hyperparameters.max_grad_norm"),
            ({"weight_decay": 1.5}, "hyperparameters.weight_decay"),
        ],
    )
    def test_ranges_name_the_field(self, hp: dict, loc: str) -> None:
        assert errors(hyperparameters=hp)[0][0] == loc

    def test_cross_field_messages_say_what_to_change(self) -> None:
        [(_, msg)] = errors(hyperparameters={"batch_tokens": 512, "max_seq_len": 1024})
        assert "raise batch_tokens or lower max_seq_len" in msg
        [(_, msg)] = errors(hyperparameters={"max_steps": 10, "warmup_steps": 10})
        assert "warmup_steps (10) must be < max_steps (10)" in msg

    def test_lora_targets(self) -> None:
        JobSpec(model="org/m", training_file=FILE, lora={"target_modules": ["q_proj", "self_attn.o_proj"]})
        assert "alone" in errors(lora={"target_modules": ["all-linear", "q_proj"]})[0][1]
        assert "not a module name" in errors(lora={"target_modules": ["q proj"]})[0][1]
        assert "duplicate" in errors(lora={"target_modules": ["q_proj", "q_proj"]})[0][1]
        assert errors(lora={"target_modules": []})[0][0] == "lora.target_modules"

    def test_file_ids_and_method_rules(self) -> None:
        assert "POST /v1/files" in errors(training_file="train.jsonl")[0][1]
        assert "must differ" in errors(validation_file=FILE)[0][1]
        assert "remove 'lora'" in errors(method="full", lora={"r": 4})[0][1]
        full = JobSpec(model="org/m", training_file=FILE, method="full")
        assert JobSpec.model_validate(full.to_stored()) == full, "a stored full job's spec (the worker re-reads it)"

    def test_spec_round_trips_through_its_stored_form(self) -> None:
        spec = JobSpec(model="org/m", training_file=FILE, name="x", hyperparameters={"max_steps": 3},
                       lora={"r": 8, "target_modules": ["q_proj"]}, optimizations={"moe_grouped_routing": "off"})
        assert JobSpec.model_validate(spec.to_stored()) == spec


class TestLinkedFields:
    """Cross-field rules name the exact field; a lone budget or length moves the other's default."""

    def test_warmup_and_budget_errors_name_their_field(self) -> None:
        assert errors(hyperparameters={"max_steps": 5, "warmup_steps": 9}) == [
            ("hyperparameters.warmup_steps", "Value error, warmup_steps (9) must be < max_steps (5)")]
        [(loc, msg)] = errors(hyperparameters={"batch_tokens": 1024, "max_seq_len": 2048})
        assert loc == "hyperparameters.batch_tokens" and "raise batch_tokens or lower max_seq_len" in msg

    def test_max_seq_len_follows_a_small_batch_tokens_and_batch_tokens_a_long_max_seq_len(self) -> None:
        small = JobSpec(model="org/m", training_file=FILE, hyperparameters={"batch_tokens": 2048}).hyperparameters
        assert (small.batch_tokens, small.max_seq_len) == (2048, 2048)
        long = JobSpec(model="org/m", training_file=FILE, hyperparameters={"max_seq_len": 32768}).hyperparameters
        assert (long.batch_tokens, long.max_seq_len) == (32768, 32768)
        default = JobSpec(model="org/m", training_file=FILE).hyperparameters
        assert (default.batch_tokens, default.max_seq_len) == (16384, 4096)

    def test_the_defaults_are_served_in_the_schema_the_form_reads(self) -> None:
        from api.app import create_app
        from core.settings import Settings

        schemas = create_app(Settings()).openapi()["components"]["schemas"]
        hp, lora = schemas["Hyperparameters"]["properties"], schemas["LoraSpec"]["properties"]
        assert (hp["warmup_steps"]["default"], hp["learning_rate"]["default"], lora["alpha"]["default"]) == (0, 2e-4, 16)
        assert schemas["JobSpec"]["properties"]["checkpoint_every"]["default"] == 0
