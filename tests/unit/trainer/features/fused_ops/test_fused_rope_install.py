"""``trainer.features.fused_ops.patch`` RoPE patch: which modeling files it replaces, that a patched model computes
the same bits on CPU (the replacement's torch form is transformers' formula), and that
``uninstall`` puts the original function back."""

from __future__ import annotations

import sys

import torch

from trainer.features.fused_ops import patch as fused_ops
from trainer.kernels import rope
from trainer.model.tiny import build_tiny_model


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_llama_style_rope_is_replaced_and_restored() -> None:
    model, _ = build_tiny_model("qwen3")
    ids = torch.randint(0, 500, (1, 12), generator=torch.Generator().manual_seed(0))
    before = _logits(model, ids)
    modeling = sys.modules[type(model.model.layers[0].self_attn).__module__]
    original = modeling.apply_rotary_pos_emb
    result = fused_ops.InstallResult(triton=True)
    fused_ops._patch_rope(model, result)
    try:
        assert result.rope == [modeling]
        assert modeling.apply_rotary_pos_emb is rope.apply_rotary_pos_emb
        assert torch.equal(_logits(model, ids), before)
        assert "RoPE kernel in 1 modeling files" in result.describe()
        again = fused_ops.InstallResult(triton=True)
        fused_ops._patch_rope(model, again)  # already patched: joins it, the original is kept
        assert again.rope == [modeling]
        again.uninstall()
        assert modeling.apply_rotary_pos_emb is rope.apply_rotary_pos_emb  # the first still holds it
    finally:
        result.uninstall()
    assert modeling.apply_rotary_pos_emb is original


def test_gpt_oss_half_table_rope_is_left_alone() -> None:
    model, _ = build_tiny_model("gpt_oss")
    modeling = sys.modules[type(model.model.layers[0].self_attn).__module__]
    original = modeling.apply_rotary_pos_emb
    result = fused_ops.InstallResult(triton=True)
    fused_ops._patch_rope(model, result)
    assert result.rope == [] and modeling.apply_rotary_pos_emb is original
    assert any("apply_rotary_pos_emb" in k for k in result.skipped)


def test_cpu_install_does_not_patch_rope() -> None:
    model, _ = build_tiny_model("llama")
    result = fused_ops.install(model)
    try:
        assert not result.triton and result.rope == []
    finally:
        result.uninstall()


def test_installs_share_the_rope_patch_and_the_last_uninstall_restores_it() -> None:
    first, _ = build_tiny_model("llama")
    second, _ = build_tiny_model("llama", seed=1)
    modeling = sys.modules[type(first.model.layers[0].self_attn).__module__]
    original = modeling.apply_rotary_pos_emb
    a, b = fused_ops.InstallResult(triton=True), fused_ops.InstallResult(triton=True)
    fused_ops._patch_rope(first, a)
    fused_ops._patch_rope(second, b)
    assert a.rope == b.rope == [modeling]
    try:
        b.uninstall()  # the first install still holds the process-wide patch
        assert modeling.apply_rotary_pos_emb is rope.apply_rotary_pos_emb
        a.uninstall()  # the last holder puts transformers' own function back
        assert modeling.apply_rotary_pos_emb is original
        a.uninstall()  # nothing left to release: still the original
        assert modeling.apply_rotary_pos_emb is original
    finally:
        a.uninstall()
        b.uninstall()
