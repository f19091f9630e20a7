"""``python -m trainer generate``: a prompts file to completions.jsonl, in order, resumable.

A run cancelled after its first chunk (SIGTERM from inside, as the worker sends it) and then
resumed writes byte for byte the file of a run that went through, with seeded sampling, and no
prompt's line twice; two gloo ranks split the prompts and write the one-process file's tokens (logprobs within 1e-5:
each rank's forwards batch other prompts, which moves the last float bits).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from trainer.generate import outputs
from trainer.generate.job import run_generation
from trainer.generate.job_config import GenerateConfig
from trainer.parallel.distributed import World

pytestmark = pytest.mark.usefixtures("one_thread")
REPO_ROOT = Path(__file__).resolve().parents[4]
ONE = World(rank=0, world_size=1, local_rank=0)
SAMPLING = {"max_tokens": 5, "temperature": 1.0, "top_k": 20, "seed": 7, "n": 2, "logprobs": True,
            "top_logprobs": 2}


def _prompts(path: Path) -> Path:
    lines = [{"prompt": f"Count to {i}:"} if i % 2 else
             {"messages": [{"role": "user", "content": f"What is {i} plus {i}?"}], "id": i} for i in range(7)]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def _config(tmp_path: Path, model_dir: Path, name: str, **overrides: object) -> GenerateConfig:
    fields = {"sampling": SAMPLING, "slots": 3, "chunk_prompts": 3, **overrides}
    return GenerateConfig(model=str(model_dir), prompts_file=str(_prompts(tmp_path / "prompts.jsonl")),
                          output_dir=str(tmp_path / name), **fields)


def _events(config: GenerateConfig, on_progress=None, after: int = 0) -> tuple[str, list[tuple[str, dict]]]:
    """Run ``config`` in this process; ``on_progress`` is called at each progress event past the first ``after``."""
    events: list[tuple[str, dict]] = []

    def emit(type_: str, **payload: object) -> None:
        events.append((type_, payload))
        if type_ == "progress" and on_progress is not None and sum(t == "progress" for t, _ in events) > after:
            on_progress()

    return run_generation(config, emit, ONE), events


class TestGenerateJob:
    def test_writes_one_line_per_prompt_in_order_with_choices_and_logprobs(self, tmp_path, tiny_model_dir):
        config = _config(tmp_path, tiny_model_dir, "out")
        status, events = _events(config)
        assert status == "succeeded"
        lines = [json.loads(x) for x in config.completions_path.read_text().splitlines()]
        assert [line["index"] for line in lines] == list(range(7))
        assert "messages" in lines[0] and lines[1]["prompt"] == "Count to 1:"
        for line in lines:
            assert [c["index"] for c in line["choices"]] == [0, 1]
            for choice in line["choices"]:
                assert choice["finish_reason"] in ("stop", "length") and 0 <= choice["tokens"] <= 5
                assert len(choice["logprobs"]) == choice["tokens"]
                assert all(len(lp["top"]) == 2 and lp["logprob"] <= 0 for lp in choice["logprobs"])
            assert line["usage"]["completion_tokens"] == sum(c["tokens"] for c in line["choices"])
        assert not config.parts_dir.exists()
        progress = [p for t, p in events if t == "progress"]
        assert [p["prompts_done"] for p in progress] == [0, 3, 6, 7] and progress[-1]["prompts_total"] == 7
        assert progress[-1]["tokens"] == sum(x["usage"]["completion_tokens"] for x in lines)
        assert progress[0]["tokens_per_s"] is None and progress[-1]["tokens_per_s"] > 0

    def test_cancel_then_resume_writes_the_uninterrupted_file_and_nothing_twice(self, tmp_path, tiny_model_dir):
        whole = _config(tmp_path, tiny_model_dir, "whole")
        assert _events(whole)[0] == "succeeded"
        stopped = _config(tmp_path, tiny_model_dir, "stopped")
        status, _ = _events(stopped, on_progress=lambda: os.kill(os.getpid(), signal.SIGTERM), after=1)
        assert status == "cancelled" and not stopped.completions_path.exists()
        assert sorted(outputs.read_lines(stopped.completions_path, stopped.parts_dir)) == [0, 1, 2]
        with open(outputs.part_path(stopped.parts_dir, 0), "a") as part:
            part.write('{"index": 3, "choi')  # a write cut short by a crash: dropped, prompt 3 redone
        status, events = _events(stopped)
        assert status == "succeeded"
        assert [p["prompts_done"] for t, p in events if t == "progress"] == [3, 6, 7]  # resumes at 3, 3 a chunk
        assert stopped.completions_path.read_bytes() == whole.completions_path.read_bytes()

    def test_a_finished_job_run_again_generates_nothing(self, tmp_path, tiny_model_dir):
        config = _config(tmp_path, tiny_model_dir, "out")
        _events(config)
        before = config.completions_path.read_bytes()
        status, events = _events(config)
        assert status == "succeeded"
        assert [p["prompts_done"] for t, p in events if t == "progress"] == [7]  # the resume point only
        assert config.completions_path.read_bytes() == before

    def test_a_bad_line_fails_with_config_naming_the_line(self, tmp_path, tiny_model_dir):
        config = _config(tmp_path, tiny_model_dir, "out")
        Path(config.prompts_file).write_text('{"prompt": "a"}\n{"messages": []}\n')
        job = tmp_path / "job.json"
        config.save(job)
        done = _cli(job, 1)[-1]
        assert done["type"] == "done" and done["status"] == "failed" and done["error_code"] == "invalid_input"
        assert "line 2" in done["message"] and "messages" in done["message"]


def _cli(job: Path, ranks: int) -> list[dict]:
    launch = [] if ranks == 1 else ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
    result = subprocess.run([sys.executable, *launch, "-m", "trainer", "generate", str(job)], cwd=REPO_ROOT,
                            env={**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1",
                                 "PYTHONWARNINGS": "ignore"},
                            capture_output=True, text=True, timeout=240, check=False)
    events = [json.loads(x) for x in result.stdout.splitlines() if x.startswith("{")]
    assert events, result.stderr[-3000:]
    return events


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_gloo_ranks_split_the_prompts_and_write_the_one_process_file(tmp_path, tiny_model_dir):
    one = _config(tmp_path, tiny_model_dir, "one", device="cpu")
    assert _events(one)[0] == "succeeded"
    two = _config(tmp_path, tiny_model_dir, "two", device="cpu")
    two.save(tmp_path / "job.json")
    events = _cli(tmp_path / "job.json", 2)
    assert "on 2 rank(s)" in events[0]["message"]
    assert events[-1]["status"] == "succeeded", events[-1]
    assert events[-1]["path"] == str(two.completions_path)
    # the same tokens and text; logprobs to float rounding (each rank's steps batch other prompts)
    ones, twos = (_lines(c.completions_path) for c in (one, two))
    assert [_without_logprobs(x) for x in twos] == [_without_logprobs(x) for x in ones]
    for a, b in zip(ones, twos):
        for ca, cb in zip(a["choices"], b["choices"]):
            assert [lp["logprob"] for lp in cb["logprobs"]] == pytest.approx([lp["logprob"] for lp in ca["logprobs"]],
                                                                            abs=1e-5)


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def _without_logprobs(line: dict) -> dict:
    return {**line, "choices": [{k: v for k, v in c.items() if k != "logprobs"} for c in line["choices"]]}


def test_an_adapter_is_applied_unmerged_as_the_engine_applies_it(tmp_path, tiny_model_dir):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer.generate.engine import Engine
    from trainer.generate.params import Request, SamplingParams

    torch.manual_seed(0)
    with warnings.catch_warnings():  # peft <= 0.21 reads transformers' deprecated is_gradient_checkpointing
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32),
                               LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    model.save_pretrained(tmp_path / "adapter")
    config = _config(tmp_path, tiny_model_dir, "out", adapter=str(tmp_path / "adapter"),
                     sampling={"max_tokens": 6, "temperature": 0.0})
    assert _events(config)[0] == "succeeded"
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompt = tokenizer("Count to 1:")["input_ids"]
    params = SamplingParams(max_tokens=6, temperature=0.0)
    with_adapter = Engine(model.eval(), tokenizer, slots=1, max_len=64).generate([Request(tuple(prompt), params)])
    with model.disable_adapter():
        base = Engine(model, tokenizer, slots=1, max_len=64).generate([Request(tuple(prompt), params)])
    line = _lines(config.completions_path)[1]
    assert line["choices"][0]["text"] == with_adapter[0].completions[0].text
    assert with_adapter[0].completions[0].token_ids != base[0].completions[0].token_ids  # the adapter matters
