"""MoE grouped routing on a GPU: no host sync on the grouped_mm path, same results as the eager loop.

Run on the lent GPU: ``python -m pytest -m gpu tests/gpu/test_moe_gpu.py``. Skipped without CUDA.
``torch.cuda.set_sync_debug_mode("error")`` turns every synchronizing CUDA call (``nonzero``,
``.item()``, ``.tolist()``, ``bincount``) into a RuntimeError, so "no sync" is checked, not assumed.

Tolerances (bf16): the grouped path and transformers' eager loop both run in bf16 and round at
different points (the Triton gate computes in fp32 and rounds once; the combine sums in fp32), so
each is compared with an fp32 eager reference: the grouped path's worst element, relative to the
reference's largest magnitude, must be within 2x the eager bf16 loop's own error plus 1e-3.
"""

from __future__ import annotations

import copy
import sys
import warnings
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_helpers import no_host_sync  # noqa: E402

from trainer.features.moe import routing as moe_routing  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def count_syncs(fn) -> int:
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    return sum("synchroniz" in str(w.message) for w in caught)


def _block(arch: str, dtype: torch.dtype, hidden: int = 256, experts: int = 8):
    """One MoE block (router + experts) of ``arch`` on CUDA, random N(0, 0.05) weights, frozen."""
    import transformers

    common = {"hidden_size": hidden, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 64, "vocab_size": 256}
    if arch == "gpt_oss":
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

        block = GptOssMLP(transformers.GptOssConfig(**common, intermediate_size=hidden, num_local_experts=experts,
                                                    num_experts_per_tok=2))
    else:
        from transformers.models.qwen3_moe.modeling_qwen3_moe import (
            Qwen3MoeSparseMoeBlock,
        )

        block = Qwen3MoeSparseMoeBlock(transformers.Qwen3MoeConfig(
            **common, intermediate_size=2 * hidden, moe_intermediate_size=hidden, num_experts=experts,
            num_experts_per_tok=2))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return block.to("cuda", dtype).requires_grad_(False)


def _run(block, x, grad):
    x = x.detach().requires_grad_()
    out = block(x[None])
    out = out[0] if isinstance(out, tuple) else out
    out.backward(grad[None].to(out.dtype))
    return out[0].float(), x.grad.float()


def _rel(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def _inputs(tokens: int, hidden: int, dtype):
    gen = torch.Generator(device="cuda").manual_seed(1)
    return (torch.randn(tokens, hidden, device="cuda", dtype=dtype, generator=gen),
            torch.randn(tokens, hidden, device="cuda", dtype=dtype, generator=gen))


@pytest.mark.parametrize("arch", ["gpt_oss", "qwen3_moe"])
@pytest.mark.parametrize("use_triton", [True, False])
class TestGroupedMM:
    def test_forward_and_backward_have_no_host_sync(self, arch, use_triton):
        block = _block(arch, torch.bfloat16)
        result = moe_routing.install(block, True, triton=use_triton)
        assert result.backend == "grouped_mm" and result.triton == use_triton and result.fused_gate_blocks == int(use_triton)
        x, grad = _inputs(512, 256, torch.bfloat16)
        _run(block, x, grad)  # warm-up: Triton compiles, cuBLAS / CUTLASS pick kernels
        with no_host_sync():
            _run(block, x, grad)

    def test_same_output_and_input_gradient_as_eager_loop(self, arch, use_triton):
        block = _block(arch, torch.bfloat16)
        eager_bf16, eager_fp32 = copy.deepcopy(block), copy.deepcopy(block).float()
        moe_routing.install(block, True, triton=use_triton)
        moe_routing.install(eager_bf16, False)
        moe_routing.install(eager_fp32, False)
        x, grad = _inputs(1024, 256, torch.bfloat16)
        out, dx = _run(block, x, grad)
        out_e, dx_e = _run(eager_bf16, x, grad)
        out_ref, dx_ref = _run(eager_fp32, x.float(), grad.float())
        for got, eager, ref, what in ((out, out_e, out_ref, "output"), (dx, dx_e, dx_ref, "input gradient")):
            bound = 2 * _rel(eager, ref) + 1e-3
            assert _rel(got, ref) <= bound, f"{what}: {_rel(got, ref):.2e} vs eager bf16 {_rel(eager, ref):.2e}"


class TestFallbacks:
    def test_fp32_loop_costs_one_host_sync_per_layer_eager_one_per_expert(self):
        block = _block("qwen3_moe", torch.float32)
        eager = copy.deepcopy(block)
        assert moe_routing.install(block, True).backend == "loop"
        moe_routing.install(eager, False)
        x, grad = _inputs(512, 256, torch.float32)
        _run(block, x, grad)
        assert count_syncs(lambda: _run(block, x, grad)) == 1  # the single offsets.tolist()
        assert count_syncs(lambda: _run(eager, x, grad)) >= 8  # a nonzero per hit expert, and more

    def test_fp32_loop_matches_eager(self):
        block = _block("gpt_oss", torch.float32)
        eager = copy.deepcopy(block)
        moe_routing.install(block, True)
        moe_routing.install(eager, False)
        x, grad = _inputs(512, 256, torch.float32)
        for got, ref in zip(_run(block, x, grad), _run(eager, x, grad)):
            assert _rel(got, ref) < 1e-5


def test_expert_lora_trains_on_grouped_mm():
    import peft

    block = _block("gpt_oss", torch.bfloat16)
    block = peft.inject_adapter_in_model(
        peft.LoraConfig(r=8, lora_alpha=8, target_modules=[], target_parameters=["experts.gate_up_proj",
                                                                                 "experts.down_proj"]),
        block,
    )
    assert moe_routing.install(block, True).backend == "grouped_mm"
    x, _ = _inputs(1024, 256, torch.bfloat16)
    target = torch.randn_like(x)
    params = [p for p in block.parameters() if p.requires_grad]
    lora_b = [p for n, p in block.named_parameters() if "lora_B" in n]
    assert len(params) == 4 and len(lora_b) == 2
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    losses = []
    for _ in range(8):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(block(x[None])[0][0].float(), target.float())
        loss.backward()
        assert all(p.grad is not None and p.grad.abs().max() > 0 for p in lora_b)  # B starts at 0, A's grad too
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0], losses
