"""QLoRA benchmark models: a random-weight model for a ``ModelShape`` on an NF4 4-bit base.

``build_qlora_model(shape, device)`` is ``bench.workload.build_lora_model`` for ``method: qlora``:
the model is built on the meta device (no memory), then each decoder layer's linear layers are
given random bf16 weights on ``device`` one at a time and quantized there to bitsandbytes NF4
(blocks of 64, double-quantized scales: what ``trainer.model.load.nf4_config`` loads), so the full
bf16 model never exists: peak memory while building is the 4-bit model plus one bf16 matrix
(178 MB for Qwen3-14B's largest). Nothing is downloaded or saved. Embeddings, head and norms
stay bf16 (the head is never quantized, as transformers does not quantize it either). Then the
trainer's own preparation (``trainer.model.load.freeze_quantized_base``, non-reentrant gradient
checkpointing, ``trainer.model.load.apply_lora`` with LoRA r=16 alpha=16 on q,k,v,o,gate,up,down)
and AdamW on the LoRA weights.

Run on a GPU (smoke: build time and memory, then the ``bench.train_step`` variants on the standard
16,384-token workload): ``python -m bench.qlora [--shape qwen3-14b] [--warmup 1] [--steps 1]``.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import torch
from torch import nn

from bench.workload import LORA_TARGETS, QWEN3_0_6B, ModelShape

QWEN3_14B = ModelShape("Qwen3-14B", "qwen3", 5120, 40, 40, 8, 128, 17_408, 151_936)
"""Qwen3-14B's sizes (its config.json): 40 layers, GQA 40/8 heads of 128, MLP 17,408, vocab 151,936."""
SHAPES = {"qwen3-14b": QWEN3_14B, "qwen3-0.6b": QWEN3_0_6B}
INIT_STD = 0.02
"""Normal init of weight matrices (transformers' ``initializer_range`` default)."""


def bitsandbytes_module() -> Any:
    """``import bitsandbytes``, or an error that says how to get it.

    Raises:
        ModuleNotFoundError: bitsandbytes is not installed.
    """
    try:
        import bitsandbytes
    except ImportError as exc:
        raise ModuleNotFoundError(
            "bench.qlora needs bitsandbytes (the NF4 4-bit layers of method: qlora): "
            "pip install bitsandbytes (a wheel with the CUDA binaries of this torch)"
        ) from exc
    return bitsandbytes


def build_qlora_model(
    shape: ModelShape, device: torch.device, attn_implementation: str = "sdpa"
) -> tuple[Any, Any]:
    """Random-weight model with NF4 4-bit linear layers and LoRA adapters, gradient checkpointing
    on; returns ``(model, optimizer)`` like ``bench.workload.build_lora_model``.

    Raises:
        ModuleNotFoundError: bitsandbytes is not installed.
    """
    from transformers import AutoModelForCausalLM

    from trainer.config import LoraConfig
    from trainer.model.load import (
        apply_lora,
        enable_gradient_checkpointing,
        freeze_quantized_base,
    )

    bnb = bitsandbytes_module()
    config = shape.config(attn_implementation)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    gen = torch.Generator(device).manual_seed(0)
    for layer in model.model.layers:
        for parent in list(layer.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is nn.Linear:
                    setattr(parent, name, nf4_linear(child, device, gen, bnb))
        materialize(layer, device, gen)
    materialize(model, device, gen)
    # RoPE frequencies are computed in __init__: rebuilt off the meta device
    with torch.device(device):
        model.model.rotary_emb = type(model.model.rotary_emb)(config)
    left = [
        n
        for n, t in [*model.named_parameters(), *model.named_buffers()]
        if t.device.type == "meta"
    ]
    if left:
        raise RuntimeError(f"bench.qlora: tensors left on the meta device: {left[:5]}")
    model.is_loaded_in_4bit = True  # what transformers' quantizer sets; peft then wraps Linear4bit with its bnb LoRA
    model.config.use_cache = False
    freeze_quantized_base(model)
    enable_gradient_checkpointing(model)
    model = apply_lora(
        model, LoraConfig(r=16, alpha=16, dropout=0.0, target_modules=LORA_TARGETS)
    )
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4, fused=device.type == "cuda")
    return model, optimizer


def nf4_linear(
    linear: nn.Linear, device: torch.device, gen: torch.Generator, bnb: Any
) -> nn.Module:
    """A bitsandbytes NF4 ``Linear4bit`` with ``linear``'s shape and fresh random weights, on ``device``.

    The bf16 weight is drawn on ``device`` and quantized there (``Params4bit.to`` quantizes a
    not-yet-quantized weight); only the packed 4-bit copy stays.
    """
    quantized = bnb.nn.Linear4bit(
        linear.in_features,
        linear.out_features,
        bias=linear.bias is not None,
        compute_dtype=torch.bfloat16,
        compress_statistics=True,
        quant_type="nf4",
        device="meta",
    )
    weight = torch.empty(
        linear.out_features, linear.in_features, device=device, dtype=torch.bfloat16
    )
    weight.normal_(0.0, INIT_STD, generator=gen)
    quantized.weight = bnb.nn.Params4bit(
        weight,
        requires_grad=False,
        compress_statistics=True,
        quant_type="nf4",
        module=quantized,
    ).to(device)
    if linear.bias is not None:
        quantized.bias = nn.Parameter(
            torch.zeros(linear.out_features, device=device, dtype=torch.bfloat16),
            requires_grad=False,
        )
    return quantized


def materialize(module: nn.Module, device: torch.device, gen: torch.Generator) -> None:
    """Give ``module``'s parameters still on the meta device bf16 values on ``device``: 1-D weights
    (norms) ones, biases zeros, matrices (embeddings, head) normal(0, ``INIT_STD``)."""
    for owner in module.modules():
        for name, p in list(owner.named_parameters(recurse=False)):
            if p.device.type != "meta":
                continue
            value = torch.empty(p.shape, device=device, dtype=p.dtype)
            if p.dim() > 1:
                value.normal_(0.0, INIT_STD, generator=gen)
            else:
                value.fill_(0.0 if name == "bias" else 1.0)
            setattr(owner, name, nn.Parameter(value, requires_grad=False))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3-14b", choices=list(SHAPES))
    parser.add_argument(
        "--variants",
        nargs="+",
        default=["ftq"],
        help="bench.train_step variants (ftq, 'ftq + offload', 'ftq, peft LoRA', ...)",
    )
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=1)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.qlora needs a CUDA device", file=sys.stderr)
        return 2
    from bench.attention import device_line
    from bench.train_step import matmul_peak_tflops, run_variants, table

    device = torch.device("cuda")
    shape = SHAPES[args.shape]
    peak = matmul_peak_tflops(device)
    print(
        f"device: {device_line()}\nbf16 matmul peak (8192^3, measured): {peak:.0f} TFLOP/s",
        flush=True,
    )
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    model, optimizer = build_qlora_model(shape, device)
    torch.cuda.synchronize()
    built = time.perf_counter() - start
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    print(
        f"{shape.name} QLoRA built in {built:.1f} s: parameters {weights / 2**30:.2f} GiB on the GPU, "
        f"allocated {torch.cuda.memory_allocated() / 2**30:.2f} GiB, peak while building "
        f"{torch.cuda.max_memory_allocated() / 2**30:.2f} GiB",
        flush=True,
    )
    results, _ = run_variants(
        model, optimizer, shape, list(args.variants), device, args.warmup, args.steps, peak, method="qlora"
    )
    print()
    print(table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
