"""End-to-end trainer runs on CPU: the CLI, resume, SIGTERM, and failures that end as `done`."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from trainer_helpers import REPO_ROOT, events_of, make_job, run_cli, write_jsonl

from trainer.config import OptimConfig, Optimizations
from trainer.events import STEP_FIELDS, make_event
from trainer.training.train import StopFlag, run


class Recorder:
    """An ``emit`` that keeps events in memory (what the Emitter would write)."""

    def __init__(
        self, stop_after_step: int | None = None, stop: StopFlag | None = None
    ) -> None:
        self.events: list[dict] = []
        self.stop_after_step, self.stop = stop_after_step, stop

    def __call__(self, type_: str, **payload: object) -> dict:
        event = make_event(type_, **payload)
        self.events.append(event)
        if (
            type_ == "step"
            and self.stop is not None
            and payload["step"] == self.stop_after_step
        ):
            self.stop.set("test stop")
        return event

    def of(self, type_: str) -> list[dict]:
        return [e for e in self.events if e["type"] == type_]


def _adapter_weights(directory: str | Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(Path(directory) / "adapter_model.safetensors")


@pytest.mark.slow  # ~32 s: `python -m trainer run` subprocesses training tiny Llama
class TestCliRun:
    def test_loss_falls_and_every_event_is_complete(self, tmp_path, tiny_model_dir):
        validation = write_jsonl(
            tmp_path / "val.jsonl",
            [
                {
                    "messages": [
                        {"role": "user", "content": "What is 2 plus one?"},
                        {"role": "assistant", "content": "The answer is 3."},
                    ]
                }
            ],
        )
        config = make_job(tmp_path, tiny_model_dir, checkpoint_every=15)
        config = dataclasses.replace(
            config,
            data=dataclasses.replace(config.data, validation_path=str(validation)),
        )
        config.save(tmp_path / "job.json")
        result = run_cli("run", str(tmp_path / "job.json"))
        assert result.returncode == 0, result.stderr[-2000:]
        events = events_of(result.stdout)
        assert len(events) == len(result.stdout.splitlines()), (
            "stdout must hold only events"
        )
        plan = next(e for e in events if e["type"] == "plan")
        assert plan["total_steps"] == 30 and plan["resumed_from_step"] is None
        assert plan["model"]["trainable_params"] < plan["model"]["params"]
        steps = [e for e in events if e["type"] == "step"]
        assert [s["step"] for s in steps] == list(range(1, 31))
        for s in steps:
            assert set(STEP_FIELDS) <= set(s)
            assert s["mfu"] is None and s["gpu_mem_peak"] is None and s["host_rss"] > 0
            assert s["gpu_alloc_retries"] is None
            assert s["tokens"] <= 256 and s["sequences"] >= 1 and s["step_ms"] > 0
        first, last = (
            sum(s["loss"] for s in steps[:3]) / 3,
            sum(s["loss"] for s in steps[-3:]) / 3,
        )
        assert last < first - 1.0, (first, last)
        assert [c["step"] for c in events if c["type"] == "checkpoint"] == [15, 30]
        assert [e["step"] for e in events if e["type"] == "eval"] == [15, 30]
        done = events[-1]
        assert (
            done["type"] == "done"
            and done["status"] == "succeeded"
            and done["steps"] == 30
        )

        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        with (
            warnings.catch_warnings()
        ):  # peft 0.21 reads transformers' deprecated is_gradient_checkpointing
            warnings.simplefilter("ignore", FutureWarning)
            tuned = PeftModel.from_pretrained(
                AutoModelForCausalLM.from_pretrained(tiny_model_dir),
                done["adapter_path"],
            )
        assert any("lora_" in name for name, _ in tuned.named_parameters())

    def test_sigterm_finishes_the_step_checkpoints_and_exits_cancelled(
        self, tmp_path, tiny_model_dir
    ):
        config = make_job(tmp_path, tiny_model_dir, optim=OptimConfig(max_steps=10_000))
        config.save(tmp_path / "job.json")
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "PYTHONWARNINGS": "ignore"}
        lines = []
        with subprocess.Popen(
            [sys.executable, "-m", "trainer", "run", str(tmp_path / "job.json")],
            cwd=REPO_ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        ) as proc:
            assert proc.stdout is not None
            for line in proc.stdout:
                lines.append(line)
                if '"type":"step"' in line:
                    proc.send_signal(signal.SIGTERM)
                    break
            lines.extend(proc.stdout)
            assert proc.wait(timeout=60) == 0
        events = events_of("".join(lines))
        done = events[-1]
        assert done["type"] == "done" and done["status"] == "cancelled"
        checkpoint = [e for e in events if e["type"] == "checkpoint"][-1]
        assert checkpoint["step"] == done["steps"] < 10_000
        assert (Path(checkpoint["path"]) / "adapter_model.safetensors").is_file()


class TestFailures:
    @pytest.mark.slow  # ~7 s: a `python -m trainer run` subprocess imports torch and transformers
    def test_missing_model_ends_failed_with_model_not_found(
        self, tmp_path, tiny_model_dir
    ):
        config = make_job(tmp_path, tiny_model_dir)
        config = dataclasses.replace(
            config,
            model=dataclasses.replace(
                config.model, name_or_path=str(tmp_path / "nope")
            ),
        )
        config.save(tmp_path / "job.json")
        result = run_cli("run", str(tmp_path / "job.json"))
        assert result.returncode == 1
        done = events_of(result.stdout)[-1]
        assert (done["status"], done["error_code"]) == ("failed", "model_not_found")
        assert "no such directory" in done["message"]

    def test_unreadable_job_is_a_config_error(self, tmp_path):
        (tmp_path / "job.json").write_text(
            json.dumps({"model": {"name_or_path": "m"}, "surprise": 1})
        )
        result = run_cli("run", str(tmp_path / "job.json"))
        assert result.returncode == 1
        done = events_of(result.stdout)[-1]
        assert (
            done["error_code"] == "config_error"
            and "surprise: unknown field" in done["message"]
        )

    def test_bad_dataset_line_is_a_dataset_error(self, tmp_path, tiny_model_dir):
        config = make_job(tmp_path, tiny_model_dir)
        Path(config.data.train_path).write_text('{"text": "fine"}\nnot json\n')
        recorder = Recorder()
        result = run(config, recorder)
        assert (result.status, result.error_code) == ("failed", "dataset_error")
        assert "line 2: not valid JSON" in recorder.of("done")[0]["message"]

    def test_impossible_on_switch_fails_before_training(self, tmp_path, tiny_model_dir):
        config = make_job(
            tmp_path,
            tiny_model_dir,
            optimizations=Optimizations(double_buffered_reload="on"),
        )
        recorder = Recorder()
        result = run(config, recorder)
        assert result.error_code == "config_error" and "needs a CUDA GPU" in (
            result.message or ""
        )
        assert recorder.of("step") == []


class TestResume:
    def test_three_steps_then_resume_equals_six_straight(
        self, tmp_path, tiny_model_dir
    ):
        (tmp_path / "a").mkdir()
        (tmp_path / "b").mkdir()
        six = make_job(
            tmp_path / "a",
            tiny_model_dir,
            optim=OptimConfig(max_steps=6, learning_rate=1e-2),
            checkpoint_every=3,
        )
        straight = Recorder()
        assert run(six, straight).status == "succeeded"

        split = make_job(
            tmp_path / "b",
            tiny_model_dir,
            optim=OptimConfig(max_steps=6, learning_rate=1e-2),
            checkpoint_every=3,
        )
        stop = StopFlag()
        first = Recorder(stop_after_step=3, stop=stop)
        assert run(split, first, stop).status == "cancelled"
        assert [e["step"] for e in first.of("step")] == [1, 2, 3]
        second = Recorder()
        assert run(split, second).status == "succeeded"
        assert second.of("plan")[0]["resumed_from_step"] == 3
        assert [e["step"] for e in second.of("step")] == [4, 5, 6]

        losses = [e["loss"] for e in straight.of("step")]
        resumed = [e["loss"] for e in first.of("step") + second.of("step")]
        assert resumed == pytest.approx(losses, rel=1e-5)
        a, b = (
            _adapter_weights(tmp_path / "a" / "out" / "adapter"),
            _adapter_weights(tmp_path / "b" / "out" / "adapter"),
        )
        for name in a:
            torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6)


class TestFullFineTuning:
    def test_full_method_trains_every_weight_for_one_epoch_and_saves_a_loadable_model(
        self, tmp_path, tiny_model_dir
    ):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        config = make_job(
            tmp_path,
            tiny_model_dir,
            method="full",
            optim=OptimConfig(epochs=1.0, learning_rate=1e-3),
        )
        recorder = Recorder()
        result = run(config, recorder)
        assert result.status == "succeeded", result.message
        plan = recorder.of("plan")[0]
        assert plan["model"]["trainable_params"] == plan["model"]["params"]
        assert result.steps == plan["total_steps"] == len(recorder.of("step"))
        assert recorder.of("step")[-1]["epoch"] == pytest.approx(1.0)
        tuned = AutoModelForCausalLM.from_pretrained(result.adapter_path)
        base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
        assert not torch.equal(
            tuned.model.layers[0].mlp.up_proj.weight,
            base.model.layers[0].mlp.up_proj.weight,
        )
        # model/ is a whole model on its own (a generation job on job:<id> loads it): the tokenizer too.
        tokenizer = AutoTokenizer.from_pretrained(result.adapter_path)
        assert tokenizer.get_vocab() == AutoTokenizer.from_pretrained(tiny_model_dir).get_vocab()
        assert tokenizer.chat_template == AutoTokenizer.from_pretrained(tiny_model_dir).chat_template
