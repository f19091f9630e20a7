"""GRPO on CUDA: a LoRA job samples on its live weights through the Triton decode path, that path
samples what the plain-torch reference samples, a QLoRA job samples its 4-bit base with its live
adapter, and two ranks on NCCL train as one GPU (DDP over
LoRA adapters; FSDP2 for full fine-tuning, the rollouts in lock-step).

Run on the lent GPU: ``python -m pytest -m gpu tests/gpu/test_grpo_gpu.py`` (the last class needs
two GPUs: ``-m gpu_multi``). The one-GPU runs go in this process (``trainer.training.train.run``),
with ``Engine.generate`` spied on, so the test sees each rollout's engine (its attention backend,
CUDA graph replays, slots) and its completions.

Tolerances. The sampler's draws are seeded per prompt, so two runs whose logits agree sample the
same tokens; a token differs only where a draw falls between the two runs' cumulative
probabilities. In float32 (``model.dtype``) the Triton decode kernel and the torch reference agree
to ~1e-6, so every completion must be the same, and then the training step is the same code on the
same tokens: reward fields equal, loss and grad norm within 1e-5 relative. In bf16 (the product's
dtype) the two attention paths round differently (bf16 keeps 8 bits), the tiny random model's
flat distributions turn that into a different token now and then, and everything after it in that
completion differs: at least 90% of the completions must be the same token for token (a kernel that
read the wrong slot, position or mask would leave almost none the same after the first token), and
the reward mean may move by at most the share that differ (each is one reward of the step's).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit" / "trainer"))
from distributed_helpers import launch  # noqa: E402
from trainer_helpers import Recorder, make_job, tiny_model_for_gpu, write_jsonl  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.timeout(600),
]

PROMPTS = ("Once upon", "The old house", "Hello there", "In the morning", "The big dog", "My friend",
           "The small house", "A long road", "The blue sky", "Good morning", "The last day", "Her brother",
           "One night", "A bright star")
GROUP, NEW = 4, 6
GRADER = {"type": "string_check", "name": "has an e", "input": "{{sample.output_text}}", "reference": "e",
          "operation": "ilike"}
"""``tests/unit/trainer/test_grpo_ranks.py``'s prompts, group and grader (its CPU twin of the two-rank test)."""
BF16_SAME_SHARE = 0.9
LOSS_RTOL = 2e-3
"""Two ranks against one GPU (bf16): as ``test_multi_gpu``'s (measured there 7.6e-8 for DDP LoRA)."""
REPORT = Path(os.environ["FTQ_GPU_REPORT"]) if os.environ.get("FTQ_GPU_REPORT") else None
"""Where to append what each comparison measured (the committed evidence)."""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_for_gpu(tmp_path_factory.mktemp("tiny-gpu"), "llama")


def _config(directory: Path, model_dir: Path, *, steps: int, dtype: str = "auto", gpus: int = 1,
            method: str = "lora", batch_tokens: int = GROUP * 24) -> Any:
    """A GRPO job on CUDA (LoRA unless ``method``): two prompts' groups (4 x up to 6 new tokens, the
    prompt shared: ``test_grpo_ranks``'s arithmetic) a micro-batch,
    ``gpus`` x 1 micro-batches a step; ``scale_rewards: batch`` and ``dapo`` so the step's spread and
    token count are gathered over the ranks (``test_grpo_ranks``'s job)."""
    from trainer.config import DataConfig, ModelConfig, OptimConfig
    from trainer.objectives.grpo_config import GrpoConfig

    directory.mkdir(parents=True, exist_ok=True)
    prompts = write_jsonl(directory / "prompts.jsonl", [{"prompt": p} for p in PROMPTS])
    return make_job(
        directory, model_dir, device="cuda", gpus=gpus, objective="grpo", gradient_checkpointing="auto", method=method,
        model=ModelConfig(str(model_dir), dtype=dtype),
        data=DataConfig(str(prompts), max_seq_len=64, batch_tokens=batch_tokens),
        optim=OptimConfig(max_steps=steps, grad_accum=1, warmup_steps=1, learning_rate=1e-2 if method == "lora" else 1e-3),
        grpo=GrpoConfig(graders=GRADER, group_size=GROUP, max_new_tokens=NEW, loss_type="dapo", scale_rewards="batch"),
    )


class _Rollouts:
    """``Engine.generate`` spied on: each call's engine facts and completions (token ids)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from trainer.generate.engine import Engine

        self.calls: list[dict[str, Any]] = []
        generate = Engine.generate

        def spy(engine: Engine, requests: Any, lockstep: Any = None) -> Any:
            results = generate(engine, requests, lockstep)
            self.calls.append({
                "backend": engine.backend, "replays": engine.stats.graph_replays, "slots": engine.slots,
                "sequences": sum(r.params.n for r in requests),
                "linear4bit": sum(type(m).__name__ == "Linear4bit" for m in engine.model.modules()),
                "graphs_disabled": engine.graphs.disabled if engine.graphs is not None else "no graphs",
                "completions": [tuple(c.token_ids) for r in results for c in r.completions],
            })
            return results

        monkeypatch.setattr(Engine, "generate", spy)


def _run(config: Any, monkeypatch: pytest.MonkeyPatch, backend: str | None = None) -> tuple[Recorder, _Rollouts]:
    from trainer.generate.engine import BACKEND_ENV
    from trainer.training.train import run

    if backend is None:
        monkeypatch.delenv(BACKEND_ENV, raising=False)
    else:
        monkeypatch.setenv(BACKEND_ENV, backend)
    rollouts, recorder = _Rollouts(monkeypatch), Recorder()
    result = run(config, recorder)
    assert result.status == "succeeded", recorder.of("done")
    return recorder, rollouts


def _report(entry: dict[str, Any]) -> None:
    if REPORT is not None:
        with REPORT.open("a") as f:
            f.write(json.dumps(entry) + "\n")


class TestOneGpu:
    def test_a_lora_job_samples_its_live_weights_on_the_triton_decode_path(self, tmp_path, model_dir, monkeypatch):
        recorder, rollouts = _run(_config(tmp_path, model_dir, steps=3), monkeypatch)
        steps = recorder.of("step")
        assert len(steps) == 3 and len(rollouts.calls) == 3
        for call in rollouts.calls:
            assert call["backend"] == "triton", call["backend"]
            assert call["replays"] > 0, "decode steps should replay CUDA graphs"
            assert call["slots"] == call["sequences"] == 2 * GROUP, "the step's sequences decode in one batch"
        for step in steps:
            assert 0.0 <= step["reward_mean"] <= 1.0 and step["grade_error_fraction"] == 0
            assert 0 < step["completion_length"] <= NEW
            assert step["generation_ms"] > 0 and step["grading_ms"] >= 0 and step["gpu_mem_peak"] > 0
            assert torch.isfinite(torch.tensor(step["loss"]))
        spread = [s for s in steps if s["zero_std_fraction"] < 1]
        assert spread and all(s["grad_norm"] > 0 for s in spread), steps

    @pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
    def test_the_triton_sampler_samples_what_the_torch_reference_samples(self, tmp_path, model_dir, monkeypatch,
                                                                          dtype):
        from trainer.objectives.declarations import GRPO

        runs = {}
        for backend in ("triton", "torch"):
            recorder, rollouts = _run(_config(tmp_path / backend, model_dir, steps=1, dtype=dtype), monkeypatch,
                                      backend)
            assert [c["backend"] for c in rollouts.calls] == [backend]
            runs[backend] = (recorder.of("step")[0], rollouts.calls[0]["completions"])
        (fast, fast_completions), (reference, reference_completions) = runs["triton"], runs["torch"]
        same = sum(a == b for a, b in zip(fast_completions, reference_completions)) / len(reference_completions)
        fields = [m.name for m in GRPO.metrics if not m.name.endswith("_ms")]
        _report({"test": f"sampler-triton-vs-torch-{dtype}", "same_completions": same,
                 **{f"{k}_{name}": step.get(k) for name, step in (("triton", fast), ("torch", reference))
                    for k in ("loss", "grad_norm", "reward_mean")}})
        if dtype == "float32":
            assert same == 1.0, same
            assert {f: fast[f] for f in fields} == {f: reference[f] for f in fields}
            for field in ("loss", "grad_norm"):
                assert fast[field] == pytest.approx(reference[field], rel=1e-5, abs=1e-7), field
        else:
            assert same >= BF16_SAME_SHARE, same
            assert abs(fast["reward_mean"] - reference["reward_mean"]) <= 1.0 - same + 1e-6

    @pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
    def test_training_each_prompt_once_per_group_follows_whole_sequences(self, tmp_path, model_dir, monkeypatch,
                                                                         dtype):
        """``Grpo.share_prefixes`` on and off on CUDA (the packed attention on its Triton kernel with
        the prompts as shared prefixes): one step on the same rollouts gives the same rewards and the
        loss and grad norm within 1e-3 relative (the kernel's tiles differ between the layouts: fp32
        runs tf32 dots; bf16 keeps 8 bits)."""
        from trainer.objectives import grpo as grpo_objective

        pack, runs = grpo_objective.Grpo.pack, {}
        for shared in (False, True):
            packed: list[bool] = []
            monkeypatch.setattr(grpo_objective.Grpo, "share_prefixes", shared)
            monkeypatch.setattr(grpo_objective.Grpo, "pack", lambda self, items: (
                batch := pack(self, items), packed.append(batch.prefixes is not None))[0])
            # every prompt in the one micro-batch, in both layouts (whole groups are longer)
            recorder, rollouts = _run(_config(tmp_path / str(shared), model_dir, steps=1, dtype=dtype,
                                              batch_tokens=1024), monkeypatch)
            runs[shared] = (recorder.of("step")[0], rollouts.calls[0]["completions"], packed)
        (whole, whole_completions, whole_packed), (shared, shared_completions, shared_packed) = runs[False], runs[True]
        _report({"test": f"grpo-shared-prefixes-vs-whole-{dtype}",
                 **{f"{k}_{name}": step.get(k) for name, step in (("whole", whole), ("shared", shared))
                    for k in ("loss", "grad_norm", "reward_mean", "tokens")}})
        assert not any(whole_packed) and shared_packed and all(shared_packed)
        assert shared_completions == whole_completions
        assert shared["reward_mean"] == whole["reward_mean"] and shared["tokens"] == whole["tokens"]
        assert whole["grad_norm"] > 0
        for field in ("loss", "grad_norm"):
            assert shared[field] == pytest.approx(whole[field], rel=1e-3, abs=1e-6), field

    @pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="needs bitsandbytes")
    @pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
    def test_a_qlora_job_samples_its_4bit_base_and_live_adapter_on_the_triton_path(self, tmp_path, model_dir,
                                                                                     monkeypatch):
        """QLoRA: the rollouts run on the NF4 base (bitsandbytes' ``Linear4bit`` in the sampled model)
        with the adapter being trained, on the Triton decode path with CUDA graph replays, and train;
        the plain-torch attention samples the same completions as bf16 runs do (the base's 4-bit
        matmuls are the same bitsandbytes kernels on both paths: only attention differs)."""
        runs = {}
        for backend in ("triton", "torch"):
            recorder, rollouts = _run(_config(tmp_path / backend, model_dir, steps=2, method="qlora"), monkeypatch,
                                      backend)
            steps = recorder.of("step")
            assert len(steps) == 2 and [c["backend"] for c in rollouts.calls] == [backend] * 2
            assert all(c["linear4bit"] > 0 for c in rollouts.calls), "the rollouts did not run on the 4-bit base"
            assert all(torch.isfinite(torch.tensor(s["loss"])) and 0.0 <= s["reward_mean"] <= 1.0 for s in steps)
            runs[backend] = (steps, list(rollouts.calls))  # a copy: the next run's spy calls through this one
        (fast_steps, fast_calls), (_, reference_calls) = runs["triton"], runs["torch"]
        assert all(c["replays"] > 0 for c in fast_calls), [c["graphs_disabled"] for c in fast_calls]
        spread = [s for s in fast_steps if s["zero_std_fraction"] < 1]
        assert spread and all(s["grad_norm"] > 0 for s in spread), fast_steps
        fast, reference = fast_calls[0]["completions"], reference_calls[0]["completions"]
        same = sum(a == b for a, b in zip(fast, reference)) / len(reference)
        _report({"test": "grpo-qlora-triton-vs-torch-bf16", "same_completions": same,
                 "graph_replays": [c["replays"] for c in fast_calls], "graphs_disabled": fast_calls[0]["graphs_disabled"],
                 "steps": [{k: s.get(k) for k in ("loss", "grad_norm", "reward_mean")} for s in fast_steps]})
        assert same >= BF16_SAME_SHARE, same

@pytest.mark.gpu_multi
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
class TestTwoGpus:
    def test_grpo_on_two_ranks_over_nccl_follows_one_gpu(self, tmp_path, model_dir):
        """DDP over the adapters, each rank sampling its own micro-batch's prompts (seeds of the
        prompt, not the rank), against one process with the same global batch (two micro-batches a
        step): the same completions, so equal reward fields; loss and grad norm in bf16 within
        ``LOSS_RTOL`` (an on-policy step's loss is near 0: 1e-6 absolute too)."""
        from trainer.objectives.declarations import GRPO

        def job(name: str) -> Path:
            path = tmp_path / name / "job.json"
            _config(tmp_path / name, model_dir, steps=4, gpus=2).save(path)
            return path

        one, two = launch(job("one"), 1, timeout=300), launch(job("two"), 2, timeout=300)
        for run in (one, two):
            assert run.returncode == 0 and run.done["status"] == "succeeded", (run.done, run.stderr[-4000:])
        [plan] = two.of("plan")
        assert {d["name"]: d["backend"] for d in plan["decisions"]}["parallelism"] == "ddp"
        got, want = two.steps(), one.steps()
        assert sorted(got) == sorted(want) == [1, 2, 3, 4]
        fields = [m.name for m in GRPO.metrics if not m.name.endswith("_ms")]
        gaps = {s: {f: abs(got[s][f] - want[s][f]) / max(abs(want[s][f]), 1e-12) for f in ("loss", "grad_norm")}
                for s in want}
        _report({"test": "grpo-ddp-2-vs-1", "by_step": gaps})
        for step in want:
            assert {f: got[step][f] for f in fields} == {f: want[step][f] for f in fields}, step
            for field in ("loss", "grad_norm"):
                assert got[step][field] == pytest.approx(want[step][field], rel=LOSS_RTOL, abs=1e-6), (step, gaps)
        assert any(want[s]["zero_std_fraction"] < 1 and want[s]["grad_norm"] > 0 for s in want), want

    def test_full_grpo_on_two_fsdp2_ranks_over_nccl_follows_one_gpu(self, tmp_path, model_dir):
        """Method full on two GPUs is sharded with FSDP2: every forward gathers the layers with both
        ranks, so each step's rollouts decode in lock-step (a rank done first runs idle forwards,
        no CUDA graphs: they would not capture the gathers) through the FSDP2 root. Against one GPU
        with the same global batch, both in float32 (FSDP2 keeps fp32 master shards; the one GPU
        then trains in fp32 too, so the two sample from the same weights): equal reward fields and
        tokens, loss and grad norm within ``LOSS_RTOL`` (1e-6 absolute for an on-policy loss near 0);
        ``tests/unit/trainer/test_grpo_ranks.py`` is the CPU (gloo) twin."""
        from trainer.objectives.declarations import GRPO

        def job(name: str) -> Path:
            path = tmp_path / name / "job.json"
            _config(tmp_path / name, model_dir, steps=4, gpus=2, dtype="float32", method="full").save(path)
            return path

        one, two = launch(job("one"), 1, timeout=300), launch(job("two"), 2, timeout=300)
        for run in (one, two):
            assert run.returncode == 0 and run.done["status"] == "succeeded", (run.done, run.stderr[-4000:])
        [plan] = two.of("plan")
        assert {d["name"]: d["backend"] for d in plan["decisions"]}["parallelism"] == "fsdp2"
        got, want = two.steps(), one.steps()
        assert sorted(got) == sorted(want) == [1, 2, 3, 4]
        fields = [m.name for m in GRPO.metrics if not m.name.endswith("_ms")]
        gaps = {s: {f: abs(got[s][f] - want[s][f]) / max(abs(want[s][f]), 1e-12) for f in ("loss", "grad_norm")}
                for s in want}
        _report({"test": "grpo-fsdp2-full-2-vs-1", "by_step": gaps})
        for step in want:
            assert {f: got[step][f] for f in fields} == {f: want[step][f] for f in fields}, step
            assert got[step]["tokens"] == want[step]["tokens"], step
            for field in ("loss", "grad_norm"):
                assert got[step][field] == pytest.approx(want[step][field], rel=LOSS_RTOL, abs=1e-6), (step, gaps)
        assert any(want[s]["zero_std_fraction"] < 1 and want[s]["grad_norm"] > 0 for s in want), want

    def test_full_grpo_on_two_fsdp2_ranks_in_bf16_samples_from_the_gathered_weights(self, tmp_path, model_dir):
        """The product's dtype: fp32 master shards gathered in bf16 for every forward, the sampler's
        own included, so its KV cache is bf16 (``Parallel.gathered_dtype``) though the shards are
        fp32. One GPU trains bf16 weights instead, so the runs part after the first update: the run
        must finish with finite losses, real rewards and rollouts at every step."""
        path = tmp_path / "two" / "job.json"
        _config(tmp_path / "two", model_dir, steps=3, gpus=2, method="full").save(path)
        two = launch(path, 2, timeout=300)
        assert two.returncode == 0 and two.done["status"] == "succeeded", (two.done, two.stderr[-4000:])
        assert {d["name"]: d["backend"] for d in two.of("plan")[0]["decisions"]}["parallelism"] == "fsdp2"
        steps = two.steps()
        assert sorted(steps) == [1, 2, 3]
        for step in steps.values():
            assert torch.isfinite(torch.tensor([step["loss"], step["grad_norm"]])).all(), step
            assert 0.0 <= step["reward_mean"] <= 1.0 and 0 < step["completion_length"] <= NEW
            assert step["generation_ms"] > 0 and step["grade_error_fraction"] == 0
        assert [e["step"] for e in two.of("rollouts")] == [1, 2, 3]
