"""bench.qlora on the CPU: the clear error without bitsandbytes, and a tiny model built for real.

bitsandbytes' CPU backend quantizes and multiplies NF4 like its CUDA one, so the builder's
layer-by-layer quantization, preparation and LoRA are checked here on a toy shape; the
Qwen3-14B smoke runs on a GPU (``python -m bench.qlora``).
"""

from __future__ import annotations

import importlib.util
import math
import sys

import pytest
import torch

from bench.qlora import QWEN3_14B, build_qlora_model
from bench.workload import LORA_TARGETS, ModelShape, packed_batch

TINY = ModelShape("tiny", "qwen3", 128, 2, 2, 1, 64, 256, 512)


def test_qwen3_14b_shape_has_the_checkpoint_sizes() -> None:
    # the Qwen3-14B model card: 14.8B parameters, 13.2B without the embeddings (norms left out)
    attn = (
        QWEN3_14B.hidden
        * QWEN3_14B.head_dim
        * (2 * QWEN3_14B.heads + 2 * QWEN3_14B.kv_heads)
    )
    mlp = 3 * QWEN3_14B.hidden * QWEN3_14B.intermediate
    assert 13.15e9 < QWEN3_14B.layers * (attn + mlp) < 13.25e9
    assert (
        14.75e9
        < QWEN3_14B.layers * (attn + mlp) + 2 * QWEN3_14B.hidden * QWEN3_14B.vocab
        < 14.85e9
    )


def test_build_without_bitsandbytes_says_how_to_get_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # a None entry makes `import bitsandbytes` raise ImportError
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)
    with pytest.raises(
        ModuleNotFoundError,
        match="bench.qlora needs bitsandbytes .* pip install bitsandbytes",
    ):
        build_qlora_model(TINY, torch.device("cpu"))


@pytest.mark.skipif(
    importlib.util.find_spec("bitsandbytes") is None,
    reason="needs bitsandbytes (CPU backend)",
)
@pytest.mark.slow  # ~5 s: quantizes and trains a tiny model
def test_tiny_build_quantizes_every_decoder_linear_and_trains_lora_only() -> None:
    import bitsandbytes as bnb

    from trainer.features.loss.fused import causal_lm_loss

    model, optimizer = build_qlora_model(TINY, torch.device("cpu"))
    adapted = {
        n: m for n, m in model.named_modules() if n.split(".")[-1] in LORA_TARGETS
    }
    assert len(adapted) == TINY.layers * len(LORA_TARGETS)
    for name, layer in adapted.items():
        base = layer.get_base_layer()
        assert (
            type(base) is bnb.nn.Linear4bit
            and base.weight.quant_state.quant_type == "nf4"
        ), name
        weight = bnb.functional.dequantize_4bit(
            base.weight.data, base.weight.quant_state
        ).float()
        assert weight.shape == (base.out_features, base.in_features), name
        # the random init, not zeros
        assert weight.std().item() == pytest.approx(0.02, rel=0.1), name
    inner = model.get_base_model()
    assert (
        type(inner.lm_head) is torch.nn.Linear
        and inner.lm_head.weight.dtype == torch.bfloat16
    )
    tensors = [*model.parameters(), *model.buffers()]
    assert all(t.device.type == "cpu" for t in tensors)
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert trainable and {p.dtype for p in trainable} == {torch.float32}
    assert {id(p) for g in optimizer.param_groups for p in g["params"]} == {
        id(p) for p in trainable
    }
    assert all(layer.gradient_checkpointing for layer in inner.model.layers)

    batch = packed_batch([20, 30, 14], TINY.vocab, torch.device("cpu"), seed=0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = causal_lm_loss(
            model,
            batch.input_ids,
            batch.targets,
            num_items=batch.num_label_tokens,
            position_ids=batch.position_ids,
        )
    # random weights of std 0.02: nearly uniform predictions (measured 0.005 from ln V)
    assert loss.item() == pytest.approx(math.log(TINY.vocab), abs=0.3)
    loss.backward()
    optimizer.step()
    assert all(
        p.grad is not None for n, p in model.named_parameters() if ".lora_B." in n
    )
