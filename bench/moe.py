"""One GPT-OSS-20B-shaped MoE layer, forward + backward: ftq's grouped routing vs transformers.

Run on a GPU: ``python -m bench.moe [--tokens 16384] [--lora] [--json PATH]``.

Workload: transformers' own ``GptOssMLP`` (router + experts) at GPT-OSS-20B shape: 32 experts,
top-4, hidden 2,880, intermediate 2,880, bf16, 16,384 tokens, weights N(0, 0.02) (random router,
so tokens spread over the experts), frozen: backward computes the input gradient only (through
the experts and the router). ``--lora`` adds rows with peft LoRA (r=16) on the 3-D expert
weights (``target_parameters``), trainable.

Rows (the same module, its experts' forward switched between rows):
- ``ftq grouped (Triton)``: ``trainer.features.moe.routing`` with its Triton gate and combine kernels (the default on CUDA);
- ``ftq grouped (torch ops)``: the same routing and grouped_mm with torch ops for gate and combine;
- ``transformers grouped_mm``: ``experts_implementation="grouped_mm"``, transformers 5's default;
- ``transformers eager loop``: ``experts_implementation="eager"``, the per-expert loop (the seed's "before").
Columns: median ms of forward, backward and both over ``--iters`` iterations (CUDA events), host
syncs counted in one forward + backward under ``torch.cuda.set_sync_debug_mode("warn")``, peak
memory above the inputs, and the relative error of output and input gradient against the eager loop.
Issue target: at most 22 ms for this layer on an H200 (transformers grouped_mm measured 28.2 ms, eager 42.8 ms).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import types
import warnings

import torch

from trainer.features.moe import routing as moe_routing

HIDDEN = 2880
INTERMEDIATE = 2880
EXPERTS = 32
TOP_K = 4


def build_block(device: torch.device, lora: bool) -> torch.nn.Module:
    """transformers' ``GptOssMLP`` at GPT-OSS-20B shape, bf16, frozen (LoRA adapters trainable with ``lora``)."""
    import transformers
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    config = transformers.GptOssConfig(
        hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_local_experts=EXPERTS, num_experts_per_tok=TOP_K,
        num_hidden_layers=1, num_attention_heads=64, num_key_value_heads=8, head_dim=64, vocab_size=1024,
    )
    gen = torch.Generator().manual_seed(0)
    block = GptOssMLP(config)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    block = block.to(device=device, dtype=torch.bfloat16).requires_grad_(False)
    if lora:
        import peft

        lora_config = peft.LoraConfig(r=16, lora_alpha=16, target_modules=[],
                                      target_parameters=["experts.gate_up_proj", "experts.down_proj"])
        block = peft.inject_adapter_in_model(lora_config, block)
    return block


def implementations(block: torch.nn.Module) -> dict[str, types.FunctionType]:
    """Row name -> a function that switches ``block``'s experts to that implementation."""
    from transformers.integrations.moe import grouped_mm_experts_forward

    def hf_grouped_mm() -> None:
        for _, experts in moe_routing.experts_modules(block):
            experts.forward = types.MethodType(grouped_mm_experts_forward, experts)

    return {
        "ftq grouped (Triton)": lambda: moe_routing.install(block, True, triton=True),
        "ftq grouped (torch ops)": lambda: moe_routing.install(block, True, triton=False),
        "transformers grouped_mm": hf_grouped_mm,
        "transformers eager loop": lambda: moe_routing.install(block, False),
    }


def count_syncs(fn) -> int:
    """Host syncs in one call of ``fn``: every synchronizing CUDA call warns in ``warn`` mode."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def time_row(block, x, grad, iters: int) -> dict[str, float]:
    def forward():
        return block(x[None])[0]

    fwd, bwd = [], []
    for i in range(iters + 3):
        x.grad = None
        start, mid, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        start.record()
        out = forward()
        mid.record()
        out.backward(grad)
        end.record()
        torch.cuda.synchronize()
        if i >= 3:  # the first calls compile Triton kernels and warm the allocator
            fwd.append(start.elapsed_time(mid))
            bwd.append(mid.elapsed_time(end))
    return {"fwd_ms": statistics.median(fwd), "bwd_ms": statistics.median(bwd),
            "total_ms": statistics.median(f + b for f, b in zip(fwd, bwd))}


def run(tokens: int, iters: int, lora: bool, device: torch.device) -> list[dict]:
    block = build_block(device, lora)
    gen = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(tokens, HIDDEN, device=device, dtype=torch.bfloat16, generator=gen).requires_grad_()
    grad = torch.randn(1, tokens, HIDDEN, device=device, dtype=torch.bfloat16, generator=gen)
    rows, outputs = [], {}
    for name, switch in implementations(block).items():
        row = {"method": name + (" + expert LoRA" if lora else "")}
        try:
            switch()
            x.grad = None
            out = block(x[None])[0]
            out.backward(grad)
            outputs[name] = (out.detach().float(), x.grad.detach().float())
            row.update(time_row(block, x, grad, iters))

            def step():
                x.grad = None
                block(x[None])[0].backward(grad)

            row["host_syncs"] = count_syncs(step)
            x.grad = None
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            step()
            torch.cuda.synchronize()
            row["peak_extra_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
        except Exception as exc:  # noqa: BLE001 - report and keep going: one broken row must not hide the others
            row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        rows.append(row)
    ref = outputs.get("transformers eager loop")
    for row in rows:
        got = outputs.get(row["method"].replace(" + expert LoRA", ""))
        if ref is not None and got is not None:
            row["out_rel_err"] = ((got[0] - ref[0]).abs().max() / ref[0].abs().max()).item()
            row["dx_rel_err"] = ((got[1] - ref[1]).abs().max() / ref[1].abs().max()).item()
    return rows


def device_line() -> str:
    import transformers

    props = torch.cuda.get_device_properties(0)
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    return (f"{props.name}, {props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB; "
            f"torch {torch.__version__}, triton {triton_version}, transformers {transformers.__version__}")


def _ratio(base: float | None, ms: float) -> str:
    return f"{base / ms:.2f}x" if base else "-"


def print_table(rows: list[dict]) -> None:
    print("\n| method | fwd ms | bwd ms | total ms | vs grouped_mm | vs eager | host syncs | peak extra GiB "
          "| out rel err | dx rel err |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    by_name = {r["method"].replace(" + expert LoRA", ""): r for r in rows}
    peer = by_name.get("transformers grouped_mm", {}).get("total_ms")
    eager = by_name.get("transformers eager loop", {}).get("total_ms")
    for r in rows:
        if "error" in r:
            print(f"| {r['method']} | error: {r['error']} |||||||||")
            continue
        print(f"| {r['method']} | {r['fwd_ms']:.2f} | {r['bwd_ms']:.2f} | {r['total_ms']:.2f} | "
              f"{_ratio(peer, r['total_ms'])} | {_ratio(eager, r['total_ms'])} | {r['host_syncs']} | {r['peak_extra_gib']:.2f} | {r.get('out_rel_err', float('nan')):.1e} "
              f"| {r.get('dx_rel_err', float('nan')):.1e} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--lora", action="store_true", help="also time with LoRA r=16 on the expert weights")
    parser.add_argument("--json", help="write all numbers to this JSON file")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.moe needs a CUDA device", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    print(f"device: {device_line()}")
    print(f"workload: GptOssMLP, {EXPERTS} experts, top-{TOP_K}, hidden {HIDDEN}, intermediate {INTERMEDIATE}, "
          f"{args.tokens} tokens, bf16, frozen experts, forward + backward (input gradient)")
    rows = run(args.tokens, args.iters, False, device)
    if args.lora:
        torch.cuda.empty_cache()
        rows += run(args.tokens, args.iters, True, device)
    print_table(rows)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": device_line(), "tokens": args.tokens, "rows": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
