"""MoE grouped routing and activation offload in real training runs on CPU: nothing changes but speed.

1. Tiny GPT-OSS and Qwen3-MoE (``trainer.model.tiny``), LoRA ``all-linear`` (attention, router and, via
   peft ``target_parameters``, the expert weights), 4 optimizer steps of 2 micro-batches through
   ``trainer.training.train.run``:

   - all on:  grouped MoE routing (the per-expert-slice loop: the CPU has no grouped_mm), the
     packed-metadata cache, the fused loss, and offloaded checkpointing with the double-buffered
     reload (the CPU twin: ``SyncStreams``, the very code path the GPU runs, copies done at once;
     the plan, which keeps offload to CUDA, is overridden for this);
   - all off: transformers' eager per-expert loop, metadata rebuilt per layer, full-logits loss,
     plain gradient checkpointing.

   Tolerance: the same fp32 function with different summation orders (grouped vs per-expert
   accumulation order in the combine, chunked vs whole log-sum-exp). Measured over 4 steps at lr
   1e-2: per-step losses within 9.6e-7 on both models; final LoRA weights within 1.1e-5
   (GPT-OSS) and 4.3e-5 (Qwen3-MoE: 2 of 2,048 elements of one expert lora_A). The weights
   differ more than the losses because AdamW normalises each update: an element whose gradient
   is near zero (an expert that got few tokens) gets a rounding-sized gradient difference turned
   into a visible fraction of an lr-sized step. Allowed: losses atol 2e-5 + rtol 1e-5 (the
   bound of ``test_optimizations_run``), weights atol 1e-4 (1% of one lr step) + rtol 1e-5. A
   mis-routed token or a stale reload moves the loss by > 1e-3.

2. Offload forced on with and without the double buffer vs plain checkpointing, on tiny Llama:
   the recompute runs the same kernels on the same bytes, so losses and weights are bit-identical.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from trainer_helpers import Recorder, train_lora

from trainer.plan import planner as planning
from trainer.config import LoraConfig, Optimizations

pytestmark = [
    pytest.mark.slow,  # ~3.5 s: seven real runs of 4 steps
    pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"),
    pytest.mark.usefixtures("one_thread"),
]

STEPS = 4


def _force_offload(monkeypatch: pytest.MonkeyPatch, double: bool) -> None:
    """Make the plan offload on this CPU (its rule keeps offload to CUDA): the CPU twin runs."""
    real = planning.plan
    reload = "double" if double else "sync"

    def forced(*args, **kwargs):
        p = real(*args, **kwargs)
        names = {"offload_activations"} | (
            {"double_buffered_reload"} if double else set()
        )
        decisions = tuple(
            dataclasses.replace(
                d, enabled=True, backend=reload, reason="forced by the test (CPU twin)"
            )
            if d.name in names
            else d
            for d in p.decisions
        )
        return dataclasses.replace(p, decisions=decisions)

    monkeypatch.setattr(planning, "plan", forced)


def _train(
    tmp_path,
    model_dir,
    monkeypatch: pytest.MonkeyPatch,
    name: str,
    *,
    optimizations: Optimizations,
    offload: str | None = None,
    plain_loss: bool = False,
) -> tuple[Recorder, dict[str, torch.Tensor]]:
    """``STEPS`` optimizer steps of 2 micro-batches; the events and the saved LoRA weights.

    ``offload``: None (plain checkpointing), ``single`` or ``double`` (forced, CPU twin).
    """
    if offload is not None:
        _force_offload(monkeypatch, double=offload == "double")
    return train_lora(
        tmp_path / name,
        model_dir,
        monkeypatch,
        steps=STEPS,
        facts={"fused_loss": "switched off by the test"} if plain_loss else None,
        optimizations=optimizations,
        lora=LoraConfig(r=4, alpha=8),
    )


def _losses(recorder: Recorder) -> torch.Tensor:
    return torch.tensor([s["loss"] for s in recorder.of("step")], dtype=torch.float64)


ALL_ON = Optimizations(
    packed_metadata_cache="on", double_buffered_reload="auto", moe_grouped_routing="on"
)
"""The reload switches stay ``auto`` (an ``on`` is refused on a CPU); ``_force_offload`` turns them on."""
ALL_OFF = Optimizations("off", "off", "off")
WEIGHT_ATOL = 1e-4
"""See the module docstring: 1% of one AdamW step at lr 1e-2."""


class TestMoeAllOnEqualsAllOff:
    @pytest.mark.parametrize(
        ("arch", "family"), [("gpt_oss", "gpt_oss"), ("qwen3_moe", "qwen3_moe")]
    )
    def test_same_losses_and_final_lora_weights(
        self, arch, family, tiny_models, tmp_path, monkeypatch
    ):
        on, on_w = _train(
            tmp_path,
            tiny_models[arch],
            monkeypatch,
            "on",
            optimizations=ALL_ON,
            offload="double",
        )
        off, off_w = _train(
            tmp_path,
            tiny_models[arch],
            monkeypatch,
            "off",
            optimizations=ALL_OFF,
            plain_loss=True,
        )
        decisions = {
            mode: {d["name"]: d for d in rec.of("plan")[0]["decisions"]}
            for mode, rec in (("on", on), ("off", off))
        }
        moe_on, moe_off = (
            decisions["on"]["moe_grouped_routing"],
            decisions["off"]["moe_grouped_routing"],
        )
        assert (moe_on["enabled"], moe_on["backend"]) == (True, "loop")
        assert moe_on["reason"].startswith(
            f"on in the job: grouped routing on 2 MoE blocks ({family})"
        )
        assert (moe_off["enabled"], moe_off["backend"]) == (False, "eager")
        # the runs really took the two paths
        assert (
            f"MoE routing: grouped routing on 2 MoE blocks ({family}), per-expert slices, one host sync per layer"
            in on.logs()
        )
        assert (
            "activation offload: 2 decoder layers, double-buffered reload" in on.logs()
        )
        assert (
            f"MoE routing: transformers' eager per-expert loop on 2 MoE blocks ({family})"
            in off.logs()
        )
        assert not any(m.startswith("activation offload") for m in off.logs())

        losses_on, losses_off = _losses(on), _losses(off)
        assert len(losses_on) == STEPS
        assert losses_on[-1] < losses_on[0] - 0.1, "the model must learn"
        torch.testing.assert_close(losses_on, losses_off, rtol=1e-5, atol=2e-5)
        assert on_w.keys() == off_w.keys()
        experts = [n for n in on_w if "experts" in n]
        assert experts, f"the expert weights must be adapted: {sorted(on_w)}"
        worst = max((on_w[n] - off_w[n]).abs().max().item() for n in on_w)
        print(
            f"{arch}: losses max diff {(losses_on - losses_off).abs().max().item():.2e}, weights {worst:.2e}"
        )
        for name in on_w:
            torch.testing.assert_close(
                on_w[name],
                off_w[name],
                rtol=1e-5,
                atol=WEIGHT_ATOL,
                msg=lambda m, n=name: f"{n}: {m}",
            )
        # the expert adapters trained (lora_B starts at zero)
        assert any(n for n in experts if "lora_B" in n and on_w[n].abs().max() > 0)


class TestOffloadRunEqualsPlainCheckpointing:
    def test_single_and_double_buffered_reload_are_bit_identical(
        self, tiny_models, tmp_path, monkeypatch
    ):
        opts = Optimizations()
        plain, plain_w = _train(
            tmp_path, tiny_models["llama"], monkeypatch, "plain", optimizations=opts
        )
        assert not any(m.startswith("activation offload") for m in plain.logs())
        for mode in ("single", "double"):
            rec, weights = _train(
                tmp_path,
                tiny_models["llama"],
                monkeypatch,
                mode,
                optimizations=opts,
                offload=mode,
            )
            how = "double-buffered" if mode == "double" else "synchronous"
            assert f"activation offload: 2 decoder layers, {how} reload" in rec.logs()
            assert torch.equal(_losses(rec), _losses(plain)), mode
            assert weights.keys() == plain_w.keys()
            for name in weights:
                assert torch.equal(weights[name], plain_w[name]), (mode, name)
