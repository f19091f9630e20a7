"""Packed attention, its metadata cache and the fused loss in real training runs: all on vs all off give the same training.

Tiny random-weight Llama, Qwen3 and GPT-OSS (``trainer.model.tiny``; GPT-OSS with attention sinks and a
sliding window of 8 tokens, shorter than the samples) train for a few steps on CPU through
``trainer.training.train.run`` three ways:

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

import pytest
import torch
from trainer_helpers import Recorder, make_job, train_lora

from trainer.config import OptimConfig, Optimizations
from trainer.training.train import run

pytestmark = [
    pytest.mark.slow,  # ~6 s: nine real runs of 6 steps
    # peft 0.21 reads the attribute transformers 5.2x deprecated; not ours to fix.
    pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"),
    # tiny models: with several threads on CI's 2 busy cores a step is dominated by thread
    # hand-offs (measured 2-3 s vs 0.15 s per step here)
    pytest.mark.usefixtures("one_thread"),
]

ARCHS = ("llama", "qwen3", "gpt_oss")
STEPS = 6


def _train(tmp_path, model_dir, monkeypatch, mode: str) -> tuple[Recorder, dict[str, torch.Tensor]]:
    """Run ``STEPS`` optimizer steps (2 micro-batches each) in ``mode``; the events and LoRA weights."""
    facts = None
    if mode != "on":
        facts = {
            "fused_loss": "switched off by the test",
            "packed_attention": "switched off by the test" if mode == "stock" else None,
        }
    switch = "on" if mode == "on" else "off"
    return train_lora(
        tmp_path / mode,
        model_dir,
        monkeypatch,
        steps=STEPS,
        facts=facts,
        optimizations=Optimizations(packed_metadata_cache=switch),
    )


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
        kernels = {
            mode: {d["name"]: d["backend"] for d in p["decisions"] if d["name"] in ("attention", "loss")}
            for mode, p in plans.items()
        }
        # The three runs really took the three paths.
        assert kernels["on"] == {"attention": "sdpa", "loss": "fused_chunked_ce"}
        assert cache["on"]["enabled"] and not cache["off"]["enabled"]
        assert kernels["off"] == {"attention": "sdpa", "loss": "torch_cross_entropy"}
        assert kernels["stock"]["attention"].startswith("transformers_")
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
        from trainer.features.attention import packed as attention

        built: dict[bool, list] = {True: [], False: []}
        original = attention.PackedAttention.metadata

        def spy(self, lengths, device, prefixes=None):
            assert isinstance(lengths, list) and all(
                isinstance(n, int) for n in lengths
            )
            assert prefixes is None  # an SFT batch shares no prefix
            meta = original(self, lengths, device, prefixes)
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
