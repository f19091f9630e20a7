"""``method: qlora`` on the CPU: the plan's refusal, and the 4-bit loader and preparation for real.

bitsandbytes >= 0.48 has a CPU backend for NF4, so ``trainer.model.load.load_model`` and
``prepare_for_training`` run here exactly as on a GPU (only the plan keeps qlora to CUDA: the CPU
4-bit matmuls are far too slow to train on). The loader tests skip where bitsandbytes is missing.
The whole run on a GPU: tests/gpu/test_qlora_gpu.py.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import pytest
import torch
from plan_fakes import CPU, H100
from trainer_helpers import make_job

from trainer.plan import hardware, planner as planning
from trainer.features.lora_kernel import fused as lora_fused
from trainer.config import TrainConfig
from trainer.errors import PlanError
from trainer.model.load import (
    LOSS_PLAIN,
    freeze_quantized_base,
    load_model,
    packed_loss,
    prepare_for_training,
)
from trainer.data.packing import PackedBatch, pack_batch

CPU_WITH_BNB = dataclasses.replace(CPU, bitsandbytes=True)
H100_WITH_BNB = dataclasses.replace(H100, bitsandbytes=True, cuda_version="13.0")
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
needs_bnb = pytest.mark.skipif(
    importlib.util.find_spec("bitsandbytes") is None,
    reason="needs bitsandbytes (CPU backend)",
)


class TestQloraPlan:
    def test_cpu_is_refused_even_with_bitsandbytes(
        self, tmp_path: Path, tiny_model_dir: Path
    ) -> None:
        config = make_job(tmp_path, tiny_model_dir, method="qlora")
        with pytest.raises(
            PlanError,
            match=r"method=qlora needs a CUDA GPU .* x86_64 \(cpu, 2 cores\)\. Use",
        ):
            planning.plan(CPU_WITH_BNB, config)

    def test_cuda_with_bitsandbytes_plans_bf16_and_the_fused_lora_update(
        self, tmp_path: Path, tiny_model_dir: Path
    ) -> None:
        plan = planning.plan(
            H100_WITH_BNB, make_job(tmp_path, tiny_model_dir, method="qlora")
        )
        assert plan.dtype == "bfloat16"
        lora = plan.decision("lora_kernel")
        assert (lora.enabled, lora.backend) == (True, "ftq_fused_lora")


def _qlora(
    tmp_path: Path, model_dir: Path, **overrides: object
) -> tuple[TrainConfig, planning.Plan]:
    """A qlora job and the plan a bf16 machine would make for it (the CPU plan, in bf16)."""
    config = make_job(tmp_path, model_dir, method="qlora", **overrides)
    as_lora = dataclasses.replace(config, method="lora")
    plan = dataclasses.replace(
        planning.plan(hardware.detect("cpu"), as_lora),
        dtype="bfloat16",
    )
    return config, plan


def _batch(tokens: int = 48) -> PackedBatch:
    from trainer.data.dataset import Sample

    gen = torch.Generator().manual_seed(0)
    samples = []
    for n in (tokens // 2, tokens - tokens // 2):
        ids = torch.randint(6, 500, (n,), generator=gen).tolist()
        samples.append(Sample(input_ids=ids, labels=ids))
    return pack_batch(samples)


@needs_bnb
class TestQloraLoad:
    def test_every_decoder_linear_is_nf4_and_the_rest_stays_in_the_plan_dtype(
        self, tmp_path: Path, tiny_model_dir: Path
    ) -> None:
        import bitsandbytes as bnb

        config, plan = _qlora(tmp_path, tiny_model_dir)
        model = load_model(config, plan, torch.device("cpu"))
        linears = {
            n: m for n, m in model.named_modules() if n.split(".")[-1] in LINEARS
        }
        assert len(linears) == 2 * len(LINEARS)
        for name, m in linears.items():
            assert type(m) is bnb.nn.Linear4bit, name
            assert m.weight.quant_state.quant_type == "nf4", name
            assert m.compute_dtype == torch.bfloat16, name
        assert (
            type(model.lm_head) is torch.nn.Linear
            and model.lm_head.weight.dtype == torch.bfloat16
        )
        others = {
            p.dtype
            for n, p in model.named_parameters()
            if type(p).__name__ != "Params4bit"
        }
        assert others == {torch.bfloat16}

    def test_prepare_trains_fp32_lora_only_and_leaves_the_base_dtypes_alone(
        self, tmp_path: Path, tiny_model_dir: Path
    ) -> None:
        config, plan = _qlora(tmp_path, tiny_model_dir, gradient_checkpointing=True)
        model = prepare_for_training(
            load_model(config, plan, torch.device("cpu")), config
        )
        trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
        # lora_A and lora_B per adapted linear
        assert len(trainable) == 2 * 2 * len(LINEARS)
        assert all(".lora_A." in n or ".lora_B." in n for n in trainable)
        assert {p.dtype for p in trainable.values()} == {torch.float32}
        frozen = {p.dtype for p in model.parameters() if not p.requires_grad}
        # no fp32 upcast of norms, embeddings or head
        assert frozen == {torch.bfloat16, torch.uint8}

    def test_checkpointing_stays_non_reentrant_and_every_lora_weight_gets_a_gradient(
        self, tmp_path: Path, tiny_model_dir: Path
    ) -> None:
        """peft's ``prepare_model_for_kbit_training`` would re-enable checkpointing without
        ``use_reentrant`` (torch then runs the reentrant variant and warns on every call) and hook
        the embeddings so that the frozen inputs still carry gradients into the layers."""
        config, plan = _qlora(tmp_path, tiny_model_dir, gradient_checkpointing=True)
        model = prepare_for_training(
            load_model(config, plan, torch.device("cpu")), config
        )
        layers = model.get_base_model().model.layers
        assert all(
            layer._gradient_checkpointing_func.keywords == {"use_reentrant": False}
            for layer in layers
        )
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                torch.nn.init.normal_(p, std=0.02)
        packed_loss(model, _batch(), None, LOSS_PLAIN, 1).backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
        assert all(g is not None and g.abs().sum() > 0 for g in grads.values())

    def test_fused_lora_update_matches_peft_on_the_4bit_base(
        self, tmp_path: Path, tiny_model_dir: Path
    ) -> None:
        """The trainer's update-only path (``lora_fused._LoraUpdate``, bf16) against peft's bnb
        LoRA layer (fp32 adapters outside autocast): same loss and gradients to bf16 rounding.

        Tolerances: loss 1e-3 relative (measured 3e-5), each LoRA gradient 5% in relative norm
        (measured at most 1.8%: the fused path multiplies in bf16, peft in fp32)."""
        config, plan = _qlora(tmp_path, tiny_model_dir)
        model = prepare_for_training(
            load_model(config, plan, torch.device("cpu")), config
        )
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                torch.nn.init.normal_(p, std=0.05)
        batch = _batch()

        def loss_and_grads() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            model.zero_grad(set_to_none=True)
            loss = packed_loss(
                model, batch, None, LOSS_PLAIN, batch.num_targets
            )
            loss.backward()
            return loss.detach(), {
                n: p.grad for n, p in model.named_parameters() if p.requires_grad
            }

        peft_loss, peft_grads = loss_and_grads()
        installed = lora_fused.install(model)
        assert (len(installed.layers), installed.fused_base) == (2 * len(LINEARS), 0)
        fused_loss, fused_grads = loss_and_grads()
        assert fused_loss == pytest.approx(peft_loss.item(), rel=1e-3)
        for name, grad in fused_grads.items():
            ref = peft_grads[name]
            err = (grad - ref).norm() / ref.norm()
            assert err < 0.05, f"{name}: relative gradient error {err:.3g}"


class TestFreezeQuantizedBase:
    def test_freeze_refuses_a_model_without_4bit_weights(
        self, tiny_model_dir: Path
    ) -> None:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
        with pytest.raises(ValueError, match="no bitsandbytes 4-bit weights"):
            freeze_quantized_base(model)
