"""Fused RMSNorm / SwiGLU installed on models (``trainer.features.fused_ops.patch``), on CPU where the patched
modules take the torch forms.

- ``install`` on tiny random-weight Llama, Qwen3 and Mistral models with peft LoRA: loss and LoRA
  gradients must be EQUAL (tolerance 0) to the unpatched model's, in fp32 and under bf16
  autocast, with gradient checkpointing and the offloading checkpoint too;
- ``uninstall`` restores the classes' forwards; modules whose forward is not a known formula are
  left alone with the reason.

The kernels themselves (torch forms against transformers, Triton in the interpreter, the whole
install through the kernels): ``test_rmsnorm_swiglu_kernels.py``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from trainer_helpers import lora_model, loss_and_grads, random_ids

from trainer.features.fused_ops import patch as fused_ops
from trainer.kernels import rmsnorm
from trainer.kernels.rmsnorm import GPT_OSS
from trainer.model.tiny import build_tiny_model

ARCHS = ("llama", "qwen3", "mistral")


pytestmark = pytest.mark.usefixtures("one_thread")


class TestInstall:
    @pytest.mark.parametrize(
        ("arch", "norms", "mlps"),
        [
            ("llama", {"LlamaRMSNorm": 5}, {"LlamaMLP": 2}),
            ("qwen3", {"Qwen3RMSNorm": 9}, {"Qwen3MLP": 2}),
            ("mistral", {"MistralRMSNorm": 5}, {"MistralMLP": 2}),
            ("gpt_oss", {"GptOssRMSNorm": 5}, {}),
            ("qwen3_moe", {"Qwen3MoeRMSNorm": 9}, {}),
            ("gemma", {"GemmaRMSNorm": 5}, {}),
        ],
    )
    def test_patches_every_recognised_module(self, arch, norms, mlps):
        """2 layers: 2 norms each + the final one; Qwen3 adds q_norm and k_norm per layer."""
        model, _ = build_tiny_model(arch)
        result = fused_ops.install(model)
        assert result.counts() == {**norms, **mlps}
        assert not result.triton and result.why_not_triton
        assert all("forward" in vars(m) for m in (*result.norms, *result.mlps))

    def test_gemma_gelu_mlp_is_left_alone_with_the_reason(self):
        model, _ = build_tiny_model("gemma")
        result = fused_ops.install(model)
        assert result.skipped == {"GemmaMLP": "act_fn is not SiLU"}
        assert "GemmaMLP (act_fn is not SiLU)" in result.describe()

    @pytest.mark.parametrize("arch", ARCHS)
    @pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16_autocast"])
    def test_loss_and_lora_grads_equal_with_and_without_install(self, arch, autocast):
        """Tolerance 0: on CPU the patched forwards are the eager formulas op for op."""
        model = lora_model(arch)
        ids = random_ids()
        loss0, grads0 = loss_and_grads(model, ids, autocast)
        result = fused_ops.install(model)
        assert len(result.norms) >= 5 and len(result.mlps) == 2
        loss1, grads1 = loss_and_grads(model, ids, autocast)
        torch.testing.assert_close(loss1, loss0, rtol=0, atol=0)
        for name in grads0:
            torch.testing.assert_close(
                grads1[name], grads0[name], rtol=0, atol=0, msg=name
            )

    def test_same_under_non_reentrant_gradient_checkpointing(self):
        model = lora_model("qwen3")
        base = model.base_model.model
        kwargs = {"use_reentrant": False}
        if hasattr(
            base, "activation_checkpointing_enable"
        ):  # transformers >= 5.2x, as trainer.model.load does
            base.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        assert any(getattr(m, "gradient_checkpointing", False) for m in base.modules())
        ids = random_ids(1)
        loss0, grads0 = loss_and_grads(model, ids, autocast=True)
        fused_ops.install(model)
        loss1, grads1 = loss_and_grads(model, ids, autocast=True)
        torch.testing.assert_close(loss1, loss0, rtol=0, atol=0)
        for name in grads0:
            torch.testing.assert_close(
                grads1[name], grads0[name], rtol=0, atol=0, msg=name
            )

    def test_same_under_the_offloading_checkpoint(self):
        """``trainer.features.offload`` wraps the decoder layers; the patched norms and MLPs sit inside them."""
        from trainer.features.offload import ActivationOffloader

        model = lora_model("llama")
        offloader = ActivationOffloader("cpu")
        offloader.apply(model)
        ids = random_ids(2)
        loss0, grads0 = loss_and_grads(model, ids, autocast=True)
        result = fused_ops.install(model)
        assert len(result.norms) == 5 and len(result.mlps) == 2
        loss1, grads1 = loss_and_grads(model, ids, autocast=True)
        offloader.remove(model)
        torch.testing.assert_close(loss1, loss0, rtol=0, atol=0)
        for name in grads0:
            torch.testing.assert_close(
                grads1[name], grads0[name], rtol=0, atol=0, msg=name
            )

    def test_uninstall_restores_the_class_forwards(self):
        model = lora_model("qwen3")
        result = fused_ops.install(model)
        patched = [*result.norms, *result.mlps]
        result.uninstall()
        assert all(
            "forward" not in vars(m) and not hasattr(m, "_ftq_fused_ops")
            for m in patched
        )
        assert all(m.forward.__func__ is type(m).forward for m in patched)
        assert result.counts() == {}

    def test_uninstall_finds_every_patched_module_and_is_idempotent(self):
        model = lora_model("llama")
        result = fused_ops.install(model)
        assert _patched(model) == len(result.norms) + len(result.mlps) == 7
        result.uninstall()
        assert _patched(model) == 0
        result.uninstall()  # nothing left to undo
        assert _patched(model) == 0

    def test_install_twice_patches_each_module_once(self):
        model, _ = build_tiny_model("llama")
        first = fused_ops.install(model)
        second = fused_ops.install(model)
        assert second.counts() == first.counts()
        assert _patched(model) == 7
        second.uninstall()
        assert _patched(model) == 0
        first.uninstall()  # the same modules, already restored
        assert _patched(model) == 0

    def test_a_norm_whose_forward_differs_from_its_variant_is_left_alone(
        self, monkeypatch
    ):
        """The install check runs the module's own forward: a wrong table entry cannot slip through."""
        monkeypatch.setitem(fused_ops.NORM_VARIANTS, "LlamaRMSNorm", GPT_OSS)
        model = lora_model("llama")
        result = fused_ops.install(model)
        assert result.norms == []
        assert (
            "differs from the gpt_oss RMSNorm formula" in result.skipped["LlamaRMSNorm"]
        )

    def test_an_unknown_rmsnorm_class_is_left_alone(self):
        class FancyRMSNorm(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.weight = nn.Parameter(torch.ones(8))
                self.eps = 1e-6

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return x * self.weight

        result = fused_ops.install(nn.Sequential(FancyRMSNorm()))
        assert result.skipped == {"FancyRMSNorm": "not a known RMSNorm formula"}

    def test_an_mlp_with_another_forward_is_left_alone(self):
        class GatedMLP(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.gate_proj, self.up_proj = nn.Linear(8, 16), nn.Linear(8, 16)
                self.down_proj, self.act_fn = nn.Linear(16, 8), nn.SiLU()

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return self.down_proj(self.act_fn(self.up_proj(x)) * self.gate_proj(x))

        result = fused_ops.install(nn.Sequential(GatedMLP()))
        assert result.mlps == [] and "forward is not" in result.skipped["GatedMLP"]

    def test_mlp_forward_matched_by_syntax_not_names(self):
        """A differently named argument, annotations and a docstring still match the Llama form."""

        class MyMLP(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.gate_proj, self.up_proj = nn.Linear(8, 16), nn.Linear(8, 16)
                self.down_proj, self.act_fn = nn.Linear(16, 8), nn.SiLU()

            def forward(self, hidden: torch.Tensor) -> torch.Tensor:
                """Docstring."""
                return self.down_proj(
                    self.act_fn(self.gate_proj(hidden)) * self.up_proj(hidden)
                )

        mlp = MyMLP()
        x = torch.randn(3, 8)
        want = mlp(x)
        result = fused_ops.install(mlp)
        assert result.mlps == [mlp]
        torch.testing.assert_close(mlp(x), want, rtol=0, atol=0)

    def test_triton_true_without_triton_is_refused(self, monkeypatch):
        monkeypatch.setattr(rmsnorm, "triton", None)
        model, _ = build_tiny_model("llama")
        with pytest.raises(ValueError, match="Triton is not installed"):
            fused_ops.install(model, triton=True)

    def test_describe_names_counts_and_backend(self):
        model, _ = build_tiny_model("llama")
        line = fused_ops.install(model, triton=False).describe()
        assert line == (
            "5 RMSNorm + 2 SwiGLU MLP modules fused (LlamaMLP 2, LlamaRMSNorm 5), "
            "RoPE kernel in 0 modeling files, torch form (triton=False)"
        )


def _patched(model: nn.Module) -> int:
    """Modules of ``model`` that carry a fused-ops patch."""
    return sum("_ftq_fused_ops" in vars(m) for m in model.modules())
