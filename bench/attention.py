"""Attention alone, forward + backward: our varlen kernel vs what stock HF packing runs.

Run on a GPU: ``python -m bench.attention [--sweep] [--json PATH]``.

Workload: 16,384 packed tokens, lognormal lengths (bench/workload.py, step 0), bf16, causal.
Compared, per model shape (Llama-3.1-8B: 32 q / 8 kv heads; Qwen3-0.6B: 16 q / 8 kv; D=128):
- ``varlen (ours)``: trainer.kernels.attention.flash_varlen_attention over ``cu_seqlens``;
- ``sdpa dense mask``: one SDPA call with a [T, T] block-diagonal causal bool mask and repeated
  k/v heads: what transformers builds for packed ``position_ids`` with ``sdpa``;
- ``sdpa per sample``: one causal SDPA call per sample (flash backend), in a Python loop.
TFLOP/s counts only the causal FLOPs inside samples: forward ``4 * Hq * D * sum L(L+1)/2``,
backward 2.5x forward (FlashAttention's convention: 5 matmuls of the forward's 2 sizes).
``--sweep`` also times the kernel's tile configurations (one kernel varied at a time).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F

from bench.workload import LLAMA_3_1_8B, QWEN3_0_6B, TOKENS_PER_STEP, packed_steps
from trainer.kernels import attention as fv
from trainer.kernels.attention import flash_varlen_attention

SHAPES = [(LLAMA_3_1_8B.name, 32, 8, 128), (QWEN3_0_6B.name, 16, 8, 128)]


def _bench(fn, *, grad_to_none=None, warmup_ms: float = 50, rep_ms: float = 300) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, grad_to_none=grad_to_none,
                                   return_mode="median")


def _inputs(T, hq, hkv, d, device, seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    q, k, v = (torch.randn(T, h, d, device=device, dtype=torch.bfloat16, generator=gen).requires_grad_()
               for h in (hq, hkv, hkv))
    return q, k, v, torch.randn(T, hq, d, device=device, dtype=torch.bfloat16, generator=gen)


def _dense_mask(lengths, device):
    seg = torch.repeat_interleave(torch.arange(len(lengths), device=device), torch.tensor(lengths, device=device))
    pos = torch.arange(seg.numel(), device=device)
    return ((seg[:, None] == seg[None, :]) & (pos[None, :] <= pos[:, None]))[None, None]


def methods(lengths, q, k, v, cu, group):
    mask = _dense_mask(lengths, q.device)
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)

    def ours():
        return flash_varlen_attention(q, k, v, cu, max(lengths))

    def dense():
        qb = q.transpose(0, 1)[None]
        kb = k.transpose(0, 1)[None].repeat_interleave(group, 1)
        vb = v.transpose(0, 1)[None].repeat_interleave(group, 1)
        return F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask)[0].transpose(0, 1)

    def per_sample():
        outs = []
        for a, b in zip(offsets, offsets[1:]):
            qs, ks, vs = (x[a:b].transpose(0, 1)[None] for x in (q, k, v))
            outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)[0].transpose(0, 1))
        return torch.cat(outs)

    return {"varlen (ours)": ours, "sdpa dense mask": dense, "sdpa per sample": per_sample}


def run_shapes(lengths, device):
    T = sum(lengths)
    cu = torch.tensor([0, *lengths], device=device).cumsum(0).to(torch.int32)
    pairs = sum(n * (n + 1) / 2 for n in lengths)
    rows = []
    for name, hq, hkv, d in SHAPES:
        q, k, v, grad = _inputs(T, hq, hkv, d, device)
        fwd_flops = 4.0 * hq * d * pairs
        fns = methods(lengths, q, k, v, cu, hq // hkv)
        with torch.no_grad():
            ref = fns["sdpa per sample"]().float()
        for method, fn in fns.items():
            with torch.no_grad():
                err = ((fn().float() - ref).norm() / ref.norm()).item()
                fwd_ms = _bench(fn)

            def fwd_bwd(fn=fn):
                fn().backward(grad)

            total_ms = _bench(fwd_bwd, grad_to_none=[q, k, v])
            rows.append(dict(shape=name, method=method, fwd_ms=fwd_ms, fwd_bwd_ms=total_ms,
                             fwd_tflops=fwd_flops / fwd_ms / 1e9, fwd_bwd_tflops=3.5 * fwd_flops / total_ms / 1e9,
                             rel_err_vs_per_sample=err))
        del q, k, v, grad, fns
        torch.cuda.empty_cache()
    return rows


SWEEP = {
    "_FWD_CONFIG": [(128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 3), (128, 32, 4, 3), (64, 128, 4, 3),
                    (128, 64, 4, 4)],
    "_BWD_DKDV_CONFIG": [(64, 64, 8, 2), (64, 128, 8, 2), (32, 64, 4, 2), (64, 64, 4, 3), (32, 128, 8, 2),
                         (128, 64, 8, 2)],
    "_BWD_DQ_CONFIG": [(64, 64, 8, 2), (128, 64, 8, 2), (64, 32, 4, 2), (64, 64, 4, 3), (128, 32, 8, 2),
                       (64, 128, 8, 2)],
}


def run_sweep(lengths, device):
    """Time each tile configuration of one kernel with the others at their defaults (Llama shape)."""
    T = sum(lengths)
    cu = torch.tensor([0, *lengths], device=device).cumsum(0).to(torch.int32)
    _, hq, hkv, d = SHAPES[0]
    q, k, v, grad = _inputs(T, hq, hkv, d, device)
    out, lse = fv._forward(q, k, v, cu, max(lengths), -1, 0, None, d ** -0.5)
    rows = []
    for table, configs in SWEEP.items():
        default = getattr(fv, table)[d]
        for config in configs:
            getattr(fv, table)[d] = config
            try:
                if table == "_FWD_CONFIG":
                    ms = _bench(lambda: fv._forward(q, k, v, cu, max(lengths), -1, 0, None, d ** -0.5))
                else:
                    ms = _bench(lambda: fv._backward(grad, q, k, v, out, lse, cu, max(lengths), -1, 0, None,
                                                     d ** -0.5))
                rows.append(dict(kernel=table, config=config, ms=ms, default=config == default))
            except Exception as exc:  # a tile that does not fit shared memory: report, keep sweeping
                rows.append(dict(kernel=table, config=config, ms=float("nan"), error=type(exc).__name__))
            finally:
                getattr(fv, table)[d] = default
    return rows


def device_line() -> str:
    import transformers
    import triton

    props = torch.cuda.get_device_properties(0)
    return (f"{props.name}, {props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB; "
            f"torch {torch.__version__}, triton {triton.__version__}, transformers {transformers.__version__}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="also time the kernel's tile configurations")
    parser.add_argument("--json", help="write all numbers to this JSON file")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.attention needs a CUDA device", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    lengths = packed_steps(1)[0]
    print(f"device: {device_line()}")
    print(f"workload: {TOKENS_PER_STEP} tokens, {len(lengths)} samples, max {max(lengths)}, "
          f"mean {sum(lengths) / len(lengths):.0f}; bf16, causal")
    rows = run_shapes(lengths, device)
    print("\n| shape | method | fwd ms | fwd+bwd ms | fwd TFLOP/s | fwd+bwd TFLOP/s | fwd+bwd speedup vs dense | "
          "rel. err vs per-sample |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        dense = next(r for r in rows if r["shape"] == row["shape"] and r["method"] == "sdpa dense mask")
        print(f"| {row['shape']} | {row['method']} | {row['fwd_ms']:.3f} | {row['fwd_bwd_ms']:.3f} | "
              f"{row['fwd_tflops']:.1f} | {row['fwd_bwd_tflops']:.1f} | {dense['fwd_bwd_ms'] / row['fwd_bwd_ms']:.1f}x "
              f"| {row['rel_err_vs_per_sample']:.1e} |")
    sweep = run_sweep(lengths, device) if args.sweep else []
    if sweep:
        print("\n| kernel | (BLOCK_M, BLOCK_N, warps, stages) | ms |\n|---|---|---:|")
        for row in sweep:
            mark = " (default)" if row.get("default") else ""
            print(f"| {row['kernel']} | {row['config']}{mark} | {row['ms']:.3f} {row.get('error', '')} |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(dict(device=device_line(), lengths=lengths, rows=rows, sweep=sweep), fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
