"""Fused LoRA linear (``trainer.features.lora_kernel.fused``) on CUDA under bf16 autocast, against peft's forward.

Tolerances: relative L2 against the float32 (no autocast) result at most 2x peft's own bf16
error (floor 5e-3); against peft within 5e-2 relative L2. No host sync in forward + backward.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from trainer.features.lora_kernel import fused as lora_fused

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def _model() -> nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig

    from trainer.config import LoraConfig
    from trainer.model.load import apply_lora

    config = LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=8,
                         num_key_value_heads=2, head_dim=128, vocab_size=4096, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model = apply_lora(model, LoraConfig(r=16, alpha=16))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data = torch.randn_like(p) * 0.02
    return model


def _run(model: nn.Module, ids: torch.Tensor, autocast: bool) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_bf16_autocast_matches_peft_and_is_as_accurate() -> None:
    model = _model()
    ids = torch.randint(0, 4096, (2, 512), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    # float32 reference: the same model upcast (bf16 weights are exact in fp32), no autocast.
    model.float()
    exact_loss, exact = _run(model, ids, autocast=False)
    model.to(torch.bfloat16)
    for name, p in model.named_parameters():
        if p.requires_grad:
            p.data = p.data.float()  # peft's default: fp32 adapters over a bf16 base
    peft_loss, peft_grads = _run(model, ids, autocast=True)
    result = lora_fused.install(model)
    assert result.fused_base == 4 * 7
    loss, grads = _run(model, ids, autocast=True)
    assert abs(loss - exact_loss) <= max(2 * abs(peft_loss - exact_loss), 5e-3 * exact_loss)
    for name, grad in grads.items():
        assert grad.dtype == torch.float32, name
        assert _rel_l2(grad, exact[name]) <= max(2 * _rel_l2(peft_grads[name], exact[name]), 5e-3), name
        assert _rel_l2(grad, peft_grads[name]) < 5e-2, name


def test_no_host_sync_in_forward_and_backward() -> None:
    model = _model()
    lora_fused.install(model)
    x = torch.randn(1, 256, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    layer = model.base_model.model.model.layers[0].mlp
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = layer(x)
        out.float().square().mean().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert x.grad is not None and torch.isfinite(x.grad).all()
