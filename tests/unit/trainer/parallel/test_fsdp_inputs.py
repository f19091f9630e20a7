"""FSDP2 hands every decoder layer the very packed-metadata object the batch built.

On 4 H100s, 8B full fine-tuning under FSDP2 failed at step 1 on every rank with
``KeyError: ('varlen', None, device(...))``. FSDP2's per-unit pre-forward casts floating inputs to
``MixedPrecisionPolicy.param_dtype`` with ``torch.distributed.utils._apply_to_tensors``, which
rebuilds every dataclass it meets (``dataclasses.replace``) and turns dicts into plain dicts: each
layer got a copy of ``PackedMetadata`` whose build counter was a plain dict (the KeyError) and
whose cache was its own (so the "built once per batch" optimization would have been per layer).
The CPU proofs gathered in float32 (no ``param_dtype``, no cast), so they never took that path.

Here: one process, a gloo group of one, a tiny Llama sharded with ``apply_fsdp`` as the trainer
does, gathered in bfloat16 (what a GPU run uses). Tolerance: none needed, the assertions are on
build counts and object identity.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from trainer.data.packed_metadata import build_packed_metadata
from trainer.features.attention.packed import PackedAttention
from trainer.features.loss.fused import causal_lm_loss
from trainer.parallel.distributed import Comm, World
from trainer.parallel.strategy import LossModule, apply_fsdp

LENGTHS = (5, 3, 8, 4)


@pytest.fixture
def gloo_world_of_one() -> Iterator[Comm]:
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield Comm(World(0, 1, 0), torch.device("cpu"))
    finally:
        dist.destroy_process_group()


def _tiny_llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=256,
    )
    model = LlamaForCausalLM(config)
    model.config._attn_implementation_internal = "eager"
    return model


def _loss(model, batch, meta, num_items):
    ids, targets = batch
    return causal_lm_loss(model, ids, targets, num_items=num_items, **meta.model_kwargs())


@pytest.mark.parametrize("compute_dtype", ["bfloat16", "float32"])
def test_every_layer_reads_the_batch_s_metadata_and_its_cache(gloo_world_of_one, compute_dtype):
    model = _tiny_llama()
    attention = PackedAttention("sdpa", cache=True)
    attention.install(model)
    seen: list[int] = []
    original = type(model.model.layers[0]).forward

    def spy(layer, *args, **kwargs):
        seen.append(id(kwargs["packed_metadata"]))
        return original(layer, *args, **kwargs)

    for layer in model.model.layers:
        layer.forward = spy.__get__(layer)
    module = apply_fsdp(LossModule(model, _loss), gloo_world_of_one, compute_dtype)

    ids = torch.randint(6, 256, (1, sum(LENGTHS)))
    meta = attention.metadata(LENGTHS, "cpu")
    module((ids, torch.roll(ids, -1, 1)), meta, sum(LENGTHS)).backward()

    assert seen == [id(meta)] * len(model.model.layers)
    assert meta.counter.metadata == 1
    assert set(meta.counter.structures.values()) == {1}
    assert all(p.grad is not None for p in module.parameters())
