"""Every feature's ``apply(model, decision, target).remove()`` puts the model back exactly.

For each feature of ``trainer.features``, and for a whole plan through ``trainer.training.install``: a tiny
model that had the feature applied, trained a micro-batch through it and had it removed computes
the same logits, loss and gradients, bit for bit (``torch.equal``), as a copy of the same model
(same weights, same seed) that never had it. A module-level function a feature patched
(transformers' ``apply_rotary_pos_emb``) is the very same object again afterwards.

CPU, fp32, one thread. Where the CPU plan would not enable a feature (offload, the fused
elementwise ops), the decision is written by hand; offload then runs through ``SyncStreams``.
"""

from __future__ import annotations

import copy
import dataclasses
import sys
from typing import Any

import pytest
import torch
from plan_fakes import CPU, plan_config
from trainer_helpers import lora_model

from trainer.features.fused_ops import patch as fused_ops_module
from trainer.features.attention.packed import ATTN_IMPLEMENTATION, unwrap_model
from trainer.data.dataset import Sample
from trainer.features.attention import feature as attention
from trainer.features.fused_ops import feature as fused_ops
from trainer.features.lora_kernel import feature as lora_kernel
from trainer.features.loss import feature as loss
from trainer.features.moe import feature as moe
from trainer.features.offload import feature as offload
from trainer.training.install import install
from trainer.kernels import rmsnorm, rope, swiglu
from trainer.model.load import LOSS_FUSED, LOSS_PLAIN, enable_gradient_checkpointing, packed_loss
from trainer.data.packing import PackedBatch, pack_batch
from trainer.plan.feature import Target
from trainer.plan.types import Decision, ModelFacts, Plan
from trainer.plan.planner import plan
from trainer.model.tiny import build_tiny_model

pytestmark = [
    pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"),
    pytest.mark.usefixtures("one_thread"),
]

CPU_DEVICE = torch.device("cpu")
LENGTHS = (9, 5, 12)


def _ids() -> torch.Tensor:
    return torch.randint(6, 500, (2, 16), generator=torch.Generator().manual_seed(0))


def _batch() -> PackedBatch:
    gen = torch.Generator().manual_seed(1)
    samples = []
    for n in LENGTHS:
        ids = torch.randint(6, 500, (n,), generator=gen).tolist()
        samples.append(Sample(input_ids=ids, labels=ids))
    return pack_batch(samples)


def _forward_backward(
    model: torch.nn.Module,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """The model's own call on a plain batch: logits, loss and every trainable parameter's gradient."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    ids = _ids()
    out = model(input_ids=ids, labels=ids, use_cache=False)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    assert grads, "no parameter got a gradient"
    return out.logits.detach(), out.loss.detach(), grads


def _assert_restored(model: torch.nn.Module, reference: torch.nn.Module) -> None:
    """``model`` computes what ``reference`` does, bit for bit, and carries the same instance
    attributes on every module (no forward override or patch record left behind)."""
    _assert_bitwise(_forward_backward(model), _forward_backward(reference))
    assert _instance_attributes(model) == _instance_attributes(reference)
    implementation = unwrap_model(model).config._attn_implementation
    assert implementation == unwrap_model(reference).config._attn_implementation


def _instance_attributes(model: torch.nn.Module) -> dict[str, set[str]]:
    return {name: set(vars(m)) for name, m in model.named_modules()}


def _assert_bitwise(got: tuple, expected: tuple) -> None:
    (logits, loss_, grads), (ref_logits, ref_loss, ref_grads) = got, expected
    assert torch.equal(logits, ref_logits), "logits differ"
    assert torch.equal(loss_, ref_loss), f"loss {loss_.item()} != {ref_loss.item()}"
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        assert torch.equal(grad, ref_grads[name]), name


def _train_packed(model: torch.nn.Module, meta: Any = None, kernel: str = LOSS_PLAIN) -> None:
    """One packed micro-batch forward and backward, as the train step runs it (the feature in use)."""
    batch = _batch()
    packed_loss(model, batch, meta, kernel, batch.num_targets).backward()
    model.zero_grad(set_to_none=True)


def _rope_module(model: torch.nn.Module) -> Any:
    """The modeling module whose ``apply_rotary_pos_emb`` the model's attention calls."""
    attn = next(m for m in model.modules() if type(m).__name__.endswith("Attention"))
    return sys.modules[type(attn).__module__]


def _train_mode(model: torch.nn.Module, checkpointing: bool = False) -> torch.nn.Module:
    if checkpointing:
        enable_gradient_checkpointing(model)
    model.config.use_cache = False
    model.train()
    return model


class TestPackedAttention:
    @pytest.mark.parametrize("cache", [True, False], ids=["cache-on", "cache-off"])
    def test_remove_restores_the_models_own_attention(self, cache: bool) -> None:
        model = _train_mode(lora_model("llama"), checkpointing=True)
        reference = copy.deepcopy(model)
        decision = Decision(attention.NAME, "on" if cache else "off", cache, "sdpa", "test")
        handle = attention.CACHE.apply(model, decision, Target())
        assert unwrap_model(model).config._attn_implementation == ATTN_IMPLEMENTATION
        _train_packed(model, handle.metadata(list(LENGTHS), CPU_DEVICE))
        handle.remove()
        assert unwrap_model(model).config._attn_implementation == "sdpa"
        _assert_restored(model, reference)

    def test_a_model_keeping_its_own_attention_gets_the_no_op_twin(self) -> None:
        model = _train_mode(lora_model("llama"))
        reference = copy.deepcopy(model)
        handle = attention.CACHE.apply(model, Decision(attention.NAME, "auto", False, None, "test"), Target())
        assert handle.metadata(list(LENGTHS), CPU_DEVICE) is None and handle.describe() is None
        handle.remove()
        _assert_restored(model, reference)


class TestMoeRouting:
    @pytest.mark.parametrize(
        "decision",
        [
            Decision(moe.NAME, "on", True, "loop", "test"),
            Decision(moe.NAME, "off", False, "eager", "test"),
        ],
        ids=["grouped", "eager-twin"],
    )
    def test_remove_restores_transformers_experts(self, decision: Decision) -> None:
        model = _train_mode(build_tiny_model("gpt_oss", seed=3)[0])
        reference = copy.deepcopy(model)
        experts = [m for m in model.modules() if type(m).__name__.endswith("Experts")]
        assert experts
        handle = moe.FEATURE.apply(model, decision, Target())
        assert all("forward" in vars(m) for m in experts)
        _forward_backward(model)
        handle.remove()
        assert not any("forward" in vars(m) for m in experts)
        _assert_restored(model, reference)


class TestActivationOffload:
    @pytest.mark.parametrize("reload", ["double", "sync"])
    def test_remove_restores_plain_checkpointing(self, reload: str) -> None:
        model = _train_mode(lora_model("llama"), checkpointing=True)
        reference = copy.deepcopy(model)
        decision = Decision(offload.NAME, "on", True, reload, "test")
        handle = offload.FEATURE.apply(model, decision, Target(device=str(CPU_DEVICE)))
        assert handle.offloader.enabled and handle.offloader.double_buffer == (reload == "double")
        layers = model.get_base_model().model.layers
        assert all("forward" in vars(layer) for layer in layers)
        _forward_backward(model)
        handle.remove()
        assert not any("forward" in vars(layer) for layer in layers)
        _assert_restored(model, reference)


class TestFusedLora:
    def test_remove_restores_pefts_forward(self) -> None:
        model = _train_mode(lora_model("llama"))
        reference = copy.deepcopy(model)
        handle = lora_kernel.FEATURE.apply(
            model, Decision(lora_kernel.NAME, "auto", True, lora_kernel.FUSED, "test"), Target()
        )
        assert handle.describe() is not None
        _forward_backward(model)
        handle.remove()
        _assert_restored(model, reference)


def _patched_ops(model: torch.nn.Module) -> int:
    return sum("_ftq_fused_ops" in vars(m) for m in model.modules())


@pytest.fixture
def kernels_decline_cpu_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Triton install on a CPU box: each call's kernel check says no, so the patched modules
    run their torch forms (RoPE's check already declines CPU tensors)."""
    if rmsnorm.triton is None:
        pytest.skip("needs triton installed (the kernels are chosen at install)")
    monkeypatch.setattr(rmsnorm, "can_use_kernel", lambda *args: False)
    monkeypatch.setattr(swiglu, "can_use_kernel", lambda *args: False)


class TestFusedOps:
    def test_torch_forms_remove_restores_the_class_forwards(self) -> None:
        model = _train_mode(lora_model("llama"))
        reference = copy.deepcopy(model)
        handle = fused_ops.FEATURE.apply(model, Decision(fused_ops.NAME, "on", True, "torch", "test"), Target())
        assert _patched_ops(model) == 7  # 5 RMSNorm + 2 MLP
        _forward_backward(model)
        handle.remove()
        assert _patched_ops(model) == 0
        _assert_restored(model, reference)

    def test_rope_patch_removed_restores_transformers_function(self) -> None:
        model = _train_mode(lora_model("qwen3"))
        reference = copy.deepcopy(model)
        modeling = _rope_module(model)
        original = modeling.apply_rotary_pos_emb
        result = fused_ops_module.InstallResult(triton=True)
        fused_ops_module._patch_rope(model, result)
        assert modeling.apply_rotary_pos_emb is rope.apply_rotary_pos_emb
        _forward_backward(model)
        result.uninstall()
        assert modeling.apply_rotary_pos_emb is original
        _assert_restored(model, reference)

    @pytest.mark.usefixtures("kernels_decline_cpu_tensors")
    def test_triton_install_removed_restores_modules_and_rope(self) -> None:
        model = _train_mode(lora_model("llama"))
        reference = copy.deepcopy(model)
        modeling = _rope_module(model)
        original = modeling.apply_rotary_pos_emb
        handle = fused_ops.FEATURE.apply(model, Decision(fused_ops.NAME, "auto", True, "triton", "test"), Target())
        assert _patched_ops(model) == 7
        assert modeling.apply_rotary_pos_emb is rope.apply_rotary_pos_emb
        _forward_backward(model)
        handle.remove()
        assert _patched_ops(model) == 0 and modeling.apply_rotary_pos_emb is original
        _assert_restored(model, reference)

    def test_disabled_installs_nothing(self) -> None:
        model = lora_model("llama")
        handle = fused_ops.FEATURE.apply(model, Decision(fused_ops.NAME, "auto", False, None, "test"), Target())
        assert _patched_ops(model) == 0 and handle.describe() is None
        handle.remove()


class TestFusedLoss:
    @pytest.mark.parametrize("kernel", [LOSS_FUSED, LOSS_PLAIN])
    def test_the_loss_leaves_the_model_untouched(self, kernel: str) -> None:
        model = _train_mode(lora_model("llama"))
        reference = copy.deepcopy(model)
        handle = loss.FEATURE.apply(model, Decision(loss.NAME, "auto", kernel == LOSS_FUSED, kernel, "test"), Target())
        assert handle.describe() == f"loss: {kernel}"
        batch = _batch()
        handle(model, batch, None, batch.num_targets).backward()
        handle.remove()
        _assert_restored(model, reference)


def _everything_on(p: Plan) -> Plan:
    """``p`` with the decisions the CPU plan leaves off written on by hand (offload, fused ops)."""
    by_hand = {
        fused_ops.NAME: Decision(fused_ops.NAME, "auto", True, "triton", "test: fused ops on the CPU"),
        offload.NAME: Decision(offload.NAME, "on", True, "double", "test: offload through SyncStreams"),
    }
    return dataclasses.replace(p, decisions=tuple(by_hand.get(d.name, d) for d in p.decisions))


@pytest.mark.usefixtures("kernels_decline_cpu_tensors")
class TestWholePlan:
    @pytest.mark.parametrize(
        ("arch", "facts"),
        [
            ("llama", ModelFacts("llama", head_dim=16, grouped_query=True)),
            (
                "qwen3_moe",
                ModelFacts("qwen3_moe", is_moe=True, head_dim=16, moe_blocks=2, moe_family="qwen3_moe"),
            ),
        ],
        ids=["llama", "qwen3_moe"],
    )
    def test_install_then_remove_leaves_the_model_as_it_was(self, arch: str, facts: ModelFacts) -> None:
        the_plan = _everything_on(plan(CPU, plan_config(), facts))
        enabled = {d.name for d in the_plan.decisions if d.enabled}
        assert enabled >= {
            "attention", "packed_metadata_cache", "loss", "lora_kernel", "fused_ops", "offload_activations"
        }
        assert ("moe_grouped_routing" in enabled) == facts.is_moe
        model = _train_mode(lora_model(arch), checkpointing=True)
        reference = copy.deepcopy(model)
        modeling = _rope_module(model)
        original = modeling.apply_rotary_pos_emb

        installed = install(model, the_plan)
        assert modeling.apply_rotary_pos_emb is rope.apply_rotary_pos_emb
        # attention, activation policy, offload, LoRA, fused ops, loss (+ MoE routing)
        assert len(installed.describe()) == 6 + facts.is_moe
        batch, meta = installed.micro_batch(_batch(), CPU_DEVICE)
        installed.loss(model, batch, meta, batch.num_targets).backward()
        installed.remove()

        assert modeling.apply_rotary_pos_emb is original
        assert unwrap_model(model).config._attn_implementation == "sdpa"
        _assert_restored(model, reference)
