"""Time the export path (``python -m trainer export``) on an 8B-shaped model: merged and GGUF.

    python -m bench.export                       # Llama-3.1-8B shape, every variant, work dir /tmp/ftq-bench-export
    python -m bench.export --variants merged-cuda,gguf-q8_0-cuda --work DIR   # a subset, reusing DIR's base
    python -m bench.export --shape tiny --device cpu                            # the logic, on a laptop

Set-up (not timed): a random-weight bf16 base of the shape (Llama 3.1's llama3 RoPE scaling
included, so the GGUF carries ``rope_freqs``) with a small byte-level BPE tokenizer
(``trainer.model.tiny``; the GGUF pads the vocabulary to the embedding's rows), saved once under
``--work`` and reused by later runs; a LoRA r=16 adapter on every linear projection with
random A and B (peft's ``init_lora_weights=False``), and a ``job.json`` naming both.

Each variant is the product path: one ``python -m trainer export`` child process, as the
worker runs it. Its wall time is measured here; its peak host RSS and peak GPU memory come
from its ``done`` event (the child's own ``getrusage`` and ``max_memory_allocated``). Variants: ``merged-<device>`` (load, merge, save
safetensors) and ``gguf-<type>-<device>`` (the same, then the GGUF write). The worker runs
exports with ``--device cpu`` (the GPUs belong to training jobs); ``cuda`` shows what a GPU buys.
Needs torch, transformers, peft and ``gguf``; prints a markdown table and writes
``--json`` if asked.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

GIB = 2**30
REPO = Path(__file__).resolve().parents[1]
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
DEFAULT_VARIANTS = "merged-cpu,merged-cuda,gguf-f16-cuda,gguf-q8_0-cuda"


def build_config(shape: str) -> Any:
    from transformers import LlamaConfig

    if shape == "tiny":
        sizes = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                     intermediate_size=128, vocab_size=512)
    else:
        from bench.workload import LLAMA_3_1_8B as s

        sizes = dict(hidden_size=s.hidden, num_hidden_layers=s.layers, num_attention_heads=s.heads,
                     num_key_value_heads=s.kv_heads, head_dim=s.head_dim, intermediate_size=s.intermediate,
                     vocab_size=s.vocab)
    return LlamaConfig(**sizes, max_position_embeddings=131072, rope_parameters=dict(LLAMA3_ROPE),
                       tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def prepare(work: Path, shape: str, device: str) -> Path:
    """Base + adapter + job.json under ``work`` (kept between runs); returns job.json."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from trainer.config import DataConfig, ModelConfig, OptimConfig, TrainConfig
    from trainer.model.tiny import build_tokenizer

    base, run, job = work / f"base-{shape}", work / f"run-{shape}", work / f"run-{shape}" / "job.json"
    if job.is_file():
        return job
    shutil.rmtree(work / f"base-{shape}", ignore_errors=True)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(build_config(shape), dtype=torch.bfloat16)
    model.save_pretrained(base)
    build_tokenizer(512).save_pretrained(base)
    lora = LoraConfig(r=16, lora_alpha=16, target_modules="all-linear", init_lora_weights=False)
    get_peft_model(model, lora).save_pretrained(run / "adapter")
    del model
    data = run / "train.jsonl"
    data.write_text('{"text": "unused"}\n')
    TrainConfig(model=ModelConfig(str(base)), data=DataConfig(str(data)), optim=OptimConfig(max_steps=1),
                output_dir=str(run)).save(job)
    return job


def run_variant(job: Path, variant: str, out_root: Path) -> dict[str, Any]:
    """One ``python -m trainer export`` child: wall time here, its peaks from its done event."""
    parts = variant.split("-")
    fmt, device = parts[0], parts[-1]
    argv = [sys.executable, "-m", "trainer", "export", str(job), "--format", fmt, "--out", str(out_root / variant),
            "--device", device]
    if fmt == "gguf":
        argv += ["--quantization", parts[1]]
    # the repo first, then whatever the caller had on the path (a --target install of gguf, say)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    started = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, env=env, cwd=REPO, check=False)
    stdout, stderr = proc.stdout, proc.stderr
    seconds = time.perf_counter() - started
    done = _done(stdout)
    if done.get("status") != "succeeded":
        raise RuntimeError(f"{variant}: {done or stderr.decode()[-2000:]}")
    result = {"variant": variant, "seconds": round(seconds, 2), "export_seconds": done.get("seconds"),
              "gpu_mem_peak": done.get("gpu_mem_peak"), "host_rss_peak": done.get("host_rss_peak"),
              "bytes": done.get("bytes")}
    shutil.rmtree(out_root / variant, ignore_errors=True)
    return result


def _done(stdout: bytes) -> dict[str, Any]:
    from trainer.events import parse_line

    events = [e for e in map(parse_line, stdout.splitlines()) if e is not None and e["type"] == "done"]
    return events[-1] if events else {}


def table(rows: list[dict[str, Any]], shape: str) -> str:
    def gib(v: Any) -> str:
        return f"{v / GIB:.1f}" if isinstance(v, (int, float)) else "-"

    lines = [f"Export path, {shape} shape (bf16 base, LoRA r=16 all-linear), one `python -m trainer export` each:", "",
             "| variant | wall s | export s | peak GPU GiB | peak host RSS GiB | output GiB |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['variant']} | {r['seconds']:.1f} | {r['export_seconds'] or 0:.1f} | {gib(r['gpu_mem_peak'])} "
                     f"| {gib(r['host_rss_peak'])} | {gib(r['bytes'])} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.export", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=("llama-8b", "tiny"), default="llama-8b")
    p.add_argument("--variants", default=DEFAULT_VARIANTS, help=f"comma-separated (default {DEFAULT_VARIANTS})")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="where the base is built; cpu also drops the -cuda variants")
    p.add_argument("--work", type=Path, default=Path("/tmp/ftq-bench-export"))
    p.add_argument("--json", type=Path, help="also write the rows here")
    args = p.parse_args(argv)
    import torch

    device = "cuda" if args.device == "auto" and torch.cuda.is_available() else ("cpu" if args.device == "auto" else args.device)
    variants = [v for v in args.variants.split(",") if v and (device == "cuda" or not v.endswith("-cuda"))]
    started = time.perf_counter()
    job = prepare(args.work, args.shape, device)
    print(f"set-up {time.perf_counter() - started:.1f}s (base + adapter under {args.work})", file=sys.stderr)
    rows = []
    for variant in variants:
        rows.append(run_variant(job, variant, args.work / "out"))
        print(f"{variant}: {rows[-1]}", file=sys.stderr)
    print(table(rows, args.shape))
    if args.json:
        args.json.write_text(json.dumps({"shape": args.shape, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
