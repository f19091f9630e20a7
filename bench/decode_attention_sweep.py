"""The sampler's decode attention kernel (``trainer.kernels.decode_attention``) over its tile settings.

Run on a GPU: ``python -m bench.decode_attention_sweep [--json PATH]``. For each case (decoding
sequences x context length, Llama-3.1-8B's 32 query / 8 kv heads of 128, bf16, each sequence in
its own shuffled slot) and each setting of ``BLOCK_N`` x ``NUM_WARPS`` x ``NUM_STAGES`` x
``PROGRAMS_PER_SM`` (the split planner's target), the kernel's median time (``triton.testing.do_bench``)
and the keys and values it reads per second. The current settings are marked; nothing is changed.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

import torch

from trainer.kernels import decode_attention as da

CASES = ((1, 1000), (64, 384), (64, 512), (256, 384), (256, 512))
HEADS_Q, HEADS_KV, HEAD_DIM = 32, 8, 128


def _case(seqs: int, context: int, device: torch.device) -> tuple:
    g = torch.Generator(device=device).manual_seed(seqs * 10_000 + context)
    keys, values = (torch.randn(seqs, HEADS_KV, context, HEAD_DIM, generator=g, device=device).to(torch.bfloat16)
                    for _ in range(2))
    query = torch.randn(seqs, HEADS_Q, HEAD_DIM, generator=g, device=device).to(torch.bfloat16)
    out = torch.empty_like(query)
    rows = torch.arange(seqs, device=device)
    slots = torch.randperm(seqs, generator=g, device=device)
    lengths = torch.full((seqs,), context, dtype=torch.int32, device=device)
    return query, keys, values, rows, slots, lengths, out


def run(device: torch.device) -> list[dict]:
    import triton.testing

    current = (da.BLOCK_N, da.NUM_WARPS, da.NUM_STAGES, da.PROGRAMS_PER_SM)
    settings = list(itertools.product((32, 64, 128), (4, 8), (2, 3), (2, 4, 8)))
    results = []
    try:
        for seqs, context in CASES:
            query, keys, values, rows, slots, lengths, out = _case(seqs, context, device)
            read = 2 * keys.numel() * keys.element_size()
            for block_n, warps, stages, per_sm in settings:
                da.BLOCK_N, da.NUM_WARPS, da.NUM_STAGES, da.PROGRAMS_PER_SM = block_n, warps, stages, per_sm
                splits = da.plan_splits(seqs, HEADS_KV, context, da._sm_count(device))

                def call() -> None:
                    da.decode_attention(query, keys, values, rows, slots, lengths, out, HEAD_DIM**-0.5, context)

                ms = triton.testing.do_bench(call, warmup=25, rep=100, return_mode="median")
                results.append({"seqs": seqs, "context": context, "block_n": block_n, "warps": warps,
                                "stages": stages, "programs_per_sm": per_sm, "splits": splits, "us": ms * 1000,
                                "tb_per_s": read / ms / 1e9,
                                "current": (block_n, warps, stages, per_sm) == current})
    finally:
        da.BLOCK_N, da.NUM_WARPS, da.NUM_STAGES, da.PROGRAMS_PER_SM = current
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    results = run(torch.device("cuda"))
    for seqs, context in CASES:
        case = sorted((r for r in results if (r["seqs"], r["context"]) == (seqs, context)), key=lambda r: r["us"])
        now = next(r for r in case if r["current"])
        print(f"{seqs} x {context}: current {now['us']:.1f} us ({now['tb_per_s']:.2f} TB/s, {now['splits']} splits)")
        for r in case[:4]:
            print(f"    BLOCK_N {r['block_n']:3d} warps {r['warps']} stages {r['stages']} per-SM {r['programs_per_sm']}"
                  f" ({r['splits']} splits): {r['us']:.1f} us, {r['tb_per_s']:.2f} TB/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
