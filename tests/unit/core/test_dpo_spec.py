"""DPO at the door: the spec's objective and dpo settings, their translation to the trainer's
config, and OpenAI's preference records recognised by the dataset validator."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from core.errors import InvalidDataset
from core.files.validate import validate_dataset
from core.jobs.spec import JobSpec
from core.jobs.translate import to_train_config
from trainer.config import DataConfig, DpoConfig, ModelConfig, OptimConfig, TrainConfig

TRAIN = "file-" + "1" * 24
PAIR = {
    "input": {"messages": [{"role": "system", "content": "be kind"}, {"role": "user", "content": "hi"}]},
    "preferred_output": [{"role": "assistant", "content": "hello!"}],
    "non_preferred_output": [{"role": "assistant", "content": "go away"}],
}


def spec_errors(**body: object) -> list[tuple[str, str]]:
    with pytest.raises(ValidationError) as info:
        JobSpec.model_validate({"model": "org/m", "training_file": TRAIN, **body})
    return [(".".join(str(p) for p in e["loc"]), e["msg"]) for e in info.value.errors()]


def write(tmp_path: Path, *records: object) -> Path:
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def refusal(path: Path) -> tuple[int | None, str]:
    with pytest.raises(InvalidDataset) as info:
        validate_dataset(path)
    return info.value.line, info.value.message


class TestSpec:
    def test_objective_defaults_to_sft_with_dpo_defaults_stored(self) -> None:
        stored = JobSpec(model="org/m", training_file=TRAIN).to_stored()
        assert stored["objective"] == "sft"
        assert stored["dpo"] == {"beta": 0.1, "label_smoothing": 0.0}

    @pytest.mark.parametrize(
        ("dpo", "loc"),
        [({"beta": 0}, "dpo.beta"), ({"beta": -1}, "dpo.beta"), ({"label_smoothing": 0.5}, "dpo.label_smoothing"),
         ({"label_smoothing": -0.1}, "dpo.label_smoothing"), ({"gamma": 1}, "dpo.gamma")],
    )
    def test_dpo_ranges_name_the_field(self, dpo: dict, loc: str) -> None:
        assert [where for where, _ in spec_errors(objective="dpo", dpo=dpo)] == [loc]

    def test_unknown_objective_and_dpo_settings_on_sft_are_refused(self) -> None:
        assert spec_errors(objective="ppo")[0][0] == "objective"
        [(_, message)] = spec_errors(dpo={"beta": 0.2})
        assert "objective" in message and "dpo" in message

    def test_full_dpo_on_several_gpus_is_refused_at_the_door(self) -> None:
        [(_, message)] = spec_errors(objective="dpo", method="full", gpus=2)
        assert "set gpus to 1 or use method lora" in message
        JobSpec(model="m/m", training_file=TRAIN, objective="dpo", method="lora", gpus=2)
        JobSpec(model="m/m", training_file=TRAIN, objective="dpo", method="full", gpus=1)

    def test_dpo_settings_reach_the_trainer(self) -> None:
        spec = JobSpec(model="m/m", training_file=TRAIN, objective="dpo", dpo={"beta": 0.25, "label_smoothing": 0.1})
        config = to_train_config(spec, job_id="j", files={TRAIN: "/t"}, output_dir="/o", model_path="m/m")
        assert (config.objective, config.dpo) == ("dpo", DpoConfig(beta=0.25, label_smoothing=0.1))
        assert TrainConfig.from_dict(config.to_dict()) == config


class TestTrainConfig:
    def base(self, **kwargs: object) -> TrainConfig:
        data = kwargs.pop("data", DataConfig("t.jsonl"))
        return TrainConfig(model=ModelConfig("m"), data=data,
                           optim=OptimConfig(max_steps=1), output_dir="/o", **kwargs)

    def test_a_job_json_without_objective_is_sft(self) -> None:
        raw = self.base().to_dict()
        del raw["objective"], raw["dpo"]
        assert TrainConfig.from_dict(raw).objective == "sft"

    @pytest.mark.parametrize(
        ("kwargs", "field"),
        [({"objective": "rl"}, "objective"), ({"objective": "dpo", "data": DataConfig("t", format="chat")}, "data.format"),
         ({"data": DataConfig("t", format="preference")}, "data.format")],
    )
    def test_mismatches_name_the_field(self, kwargs: dict, field: str) -> None:
        with pytest.raises(ValueError, match=f"^{field}:"):
            self.base(**kwargs)

    def test_dpo_ranges(self) -> None:
        for bad in ({"beta": 0.0}, {"label_smoothing": 0.5}):
            with pytest.raises(ValueError, match=f"^dpo.{next(iter(bad))}:"):
                DpoConfig(**bad)


class TestPreferenceRecords:
    def test_openai_dpo_records_are_format_preference(self, tmp_path: Path) -> None:
        two = {**PAIR, "preferred_output": [{"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}]}
        summary = validate_dataset(write(tmp_path, PAIR, two))
        assert (summary.format, summary.num_records) == ("preference", 2)
        assert summary.stats["chars_per_record"]["max"] == len("be kind") + len("hi") + len("hello!") + len("go away")

    @pytest.mark.parametrize(
        ("change", "words"),
        [
            ({"input": None}, "'input' is missing"),
            ({"input": {"prompt": "x"}}, "'input' must be an object with 'messages'"),
            ({"input": {"messages": []}}, "'input.messages' must be a non-empty list"),
            ({"preferred_output": "yes"}, "'preferred_output' must be a non-empty list"),
            ({"non_preferred_output": [{"role": "user", "content": "x"}]}, "non_preferred_output[0]: role 'user'"),
            ({"preferred_output": [{"role": "assistant", "content": " "}]}, "'preferred_output' has no assistant"),
            ({"non_preferred_output": [{"role": "assistant"}]}, "non_preferred_output[0] needs 'content'"),
        ],
    )
    def test_bad_pairs_name_the_line_and_the_key(self, tmp_path: Path, change: dict, words: str) -> None:
        bad = {k: v for k, v in {**PAIR, **change}.items() if v is not None}
        line, message = refusal(write(tmp_path, PAIR, bad))
        assert line == 2 and message.startswith("line 2: ") and words in message

    def test_a_pair_beside_a_chat_record_is_refused(self, tmp_path: Path) -> None:
        chat = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
        line, message = refusal(write(tmp_path, PAIR, chat))
        assert line == 2 and "chat record, but line 1 is preference" in message
