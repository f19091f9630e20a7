"""Issue 3's optimizations wired into real training runs: all on vs all off give the same training.

Tiny random-weight Llama, Qwen3 and GPT-OSS (``trainer.tiny``; GPT-OSS with attention sinks and a
sliding window of 8 tokens, shorter than the samples) train for a few steps on CPU through
``trainer.train.run`` three ways:

- all on:  ``ftq_packed`` attention with the packed-metadata cache, fused chunked loss;
- all off: ``ftq_packed`` attention rebuilding the metadata in every layer (the switch's
  ``off``), full-logits loss (the plan is handed facts saying the fused loss cannot run);
- stock:   transformers' own attention with the packed block masks (the path kept for models
  packed attention cannot run) and the full-logits loss.

Tolerance: the three paths compute the same fp32 function with different summation orders
(chunked vs whole log-sum-exp, SDPA vs eager, masks built differently). The first step's loss
agrees to ~1e-6; AdamW's normalised updates could amplify such differences each step. Measured
over 6 steps (2 micro-batches each) at lr 1e-2: losses within 1.5e-6, LoRA weights within 3.1e-6
on all three. The test allows atol 2e-5 + rtol 1e-5 on both (a mask leaking across samples moves
the loss by > 1e-4, ``test_trainer_packed_attention``; a miscounted label by far more).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from trainer_helpers import make_job

from trainer import train as train_module
from trainer.config import OptimConfig, Optimizations
from trainer.events import make_event
from trainer.model import model_facts
from trainer.train import run

# peft 0.21 reads the attribute transformers 5.2x deprecated; not ours to fix.
pytestmark = pytest.mark.filterwarnings(
    "ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"
)

ARCHS = ("llama", "qwen3", "gpt_oss")
STEPS = 6


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny models: with several threads on CI's 2 busy cores a step is dominated by thread
    hand-offs (measured 2-3 s vs 0.15 s per step here)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class Recorder:
    def __init__(self) -> None:
        self.events: list[dict] = []

    def __call__(self, type_: str, **payload: object) -> dict:
        event = make_event(type_, **payload)
        self.events.append(event)
        return event

    def of(self, type_: str) -> list[dict]:
        return [e for e in self.events if e["type"] == type_]


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from trainer.tiny import make_tiny_model

    return {
        arch: make_tiny_model(tmp_path_factory.mktemp(f"tiny-{arch}"), arch, seed=3)
        for arch in ARCHS
    }


def _train(
    tmp_path: Path,
    model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    mode: str,
    **overrides: object,
) -> tuple[Recorder, dict[str, torch.Tensor]]:
    """Run ``STEPS`` optimizer steps (2 micro-batches each) in ``mode``; the events and LoRA weights."""
    switch = "on" if mode == "on" else "off"
    (tmp_path / mode).mkdir(parents=True)
    config = make_job(
        tmp_path / mode,
        model_dir,
        optim=OptimConfig(max_steps=STEPS, learning_rate=1e-2, grad_accum=2),
        optimizations=Optimizations(packed_metadata_cache=switch),
        gradient_checkpointing=True,
        **overrides,
    )
    if mode != "on":

        def facts(cfg):
            real = model_facts(cfg)
            return dataclasses.replace(
                real,
                fused_loss="switched off by the test",
                packed_attention="switched off by the test"
                if mode == "stock"
                else None,
            )

        monkeypatch.setattr(train_module, "model_facts", facts)
    recorder = Recorder()
    result = run(config, recorder)
    monkeypatch.undo()
    assert result.status == "succeeded", result.message
    from safetensors.torch import load_file

    weights = load_file(Path(result.adapter_path) / "adapter_model.safetensors")
    return recorder, weights


class TestAllOnEqualsAllOff:
    @pytest.mark.parametrize("arch", ARCHS)
    def test_same_losses_and_final_lora_weights(
        self, arch, tiny_models, tmp_path, monkeypatch
    ):
        runs = {
            mode: _train(tmp_path, tiny_models[arch], monkeypatch, mode)
            for mode in ("on", "off", "stock")
        }
        plans = {mode: rec.of("plan")[0] for mode, (rec, _) in runs.items()}
        cache = {
            mode: next(
                d for d in p["decisions"] if d["name"] == "packed_metadata_cache"
            )
            for mode, p in plans.items()
        }
        # The three runs really took the three paths.
        assert (plans["on"]["attention_backend"], plans["on"]["loss_kernel"]) == (
            "sdpa",
            "fused_chunked_ce",
        )
        assert cache["on"]["enabled"] and not cache["off"]["enabled"]
        assert (plans["off"]["attention_backend"], plans["off"]["loss_kernel"]) == (
            "sdpa",
            "torch_cross_entropy",
        )
        assert plans["stock"]["attention_backend"].startswith("transformers_")
        losses = {
            mode: torch.tensor([s["loss"] for s in rec.of("step")])
            for mode, (rec, _) in runs.items()
        }
        assert len(losses["on"]) == STEPS
        assert losses["on"][-1] < losses["on"][0] - 0.1, "the model must learn"
        for mode in ("off", "stock"):
            torch.testing.assert_close(losses["on"], losses[mode], rtol=1e-5, atol=2e-5)
            on_w, other_w = runs["on"][1], runs[mode][1]
            assert on_w.keys() == other_w.keys() and on_w
            for name in on_w:
                torch.testing.assert_close(
                    on_w[name], other_w[name], rtol=1e-5, atol=2e-5, msg=name
                )


class TestStepUsesTheInstalledAttention:
    def test_metadata_is_built_once_per_micro_batch_when_cached(
        self, tiny_models, tmp_path, monkeypatch
    ):
        """The loop builds one metadata object per micro-batch from the host lengths; with the
        cache on each is built once, with it off it is rebuilt by every layer and recompute."""
        from trainer import attention

        built: dict[bool, list] = {True: [], False: []}
        original = attention.PackedAttention.metadata

        def spy(self, lengths, device):
            assert isinstance(lengths, list) and all(
                isinstance(n, int) for n in lengths
            )
            meta = original(self, lengths, device)
            built[self.cache].append(meta)
            return meta

        monkeypatch.setattr(attention.PackedAttention, "metadata", spy)
        for switch in ("on", "off"):
            (tmp_path / switch).mkdir()
            config = make_job(
                tmp_path / switch,
                tiny_models["llama"],
                optim=OptimConfig(max_steps=2, grad_accum=2),
                optimizations=Optimizations(packed_metadata_cache=switch),
                gradient_checkpointing=True,
            )
            assert run(config, Recorder()).status == "succeeded"
        assert len(built[True]) == len(built[False]) == 4  # 2 steps x 2 micro-batches
        assert all(m.counter.metadata == 1 for m in built[True])
        # 2 layers, forward + checkpoint recompute: rebuilt 4 times per micro-batch
        assert all(m.counter.metadata == 4 for m in built[False])
