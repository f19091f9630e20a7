"""The sampler (``trainer.generate``) beside Hugging Face ``generate``, on issue 26's rows.

Run on a GPU: ``python -m bench.sampler [--shapes llama-8b qwen3-0.6b] [--json PATH]``; a CPU
smoke run: ``python -m bench.sampler --tiny --device cpu``.

One process per call, one random-weight bf16 model per shape (``bench.workload``'s shapes) with a
LoRA adapter of rank 16 on the attention and MLP projections (peft, unmerged, B drawn non-zero so
the adapter changes the logits). Prompts are random token ids (no padding: every prompt has the
same length), completions run to their length (``ignore_eos``; HF: ``min_new_tokens``). Rows:

- ``HF generate, batch B``: ``peft_model.generate`` greedy on a [B, prompt] batch with its default
  (dynamic) cache; generated tokens over the call's wall time.
- ``ftq sampler, batch B``: ``Engine.generate`` on the same model and prompts, greedy, with the
  trainer's kernels installed as a generation job installs them (``trainer.generate.kernels``: the
  fused LoRA layers and the fused RMSNorm/SwiGLU/RoPE); ``slots = B``. ``--lora-only``: the fused
  LoRA layers alone (the sampler before session 17); ``--no-batched-prefill``: each prompt its own
  attention call per layer (before session 17) instead of one varlen batch a step.
  The speed-up is over the HF row of the same batch (when it ran). ``--variants`` times other
  settings of the same sampler right after, in the same process (``VARIANTS``: without steps run
  ahead, ``no-overlap``; q/k/v and gate/up each with its own base matmul, ``unfused``; both,
  ``session-17``).
  ``--backend`` picks its attention (``auto``: the Triton decode kernel on CUDA; ``torch``: the
  reference path, to compare); ``--cuda-graphs`` replays captured graphs for its decode steps.
- ``single stream``: batch 1.
- ``time to first token``: one ``--ttft-prompt``-token prompt, ``max_tokens=1``, on a warm engine
  (median of 5).
- ``agreement``: over the batch-``--agree-batch`` rows, the share of the first ``--agree-tokens``
  positions where the sampler's greedy token equals HF's, and the mean length of the identical
  prefix (bf16: two logits bf16 cannot tell apart may flip a token, after which the sequences
  differ).
- ``cold start`` (``--cold-start``): the shape saved to ``--workdir`` once, then loading it
  (``from_pretrained`` onto the GPU), attaching the adapter and the fused layers, and one
  generated token, timed from nothing loaded: what a chat session's start costs.

Each timed row runs once untimed first (kernels compiled, cache allocated; with ``--cuda-graphs``
on the full prompts, so the graphs of every batch size the timed run decodes in are captured). Nothing here is a test:
no row asserts a speed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from bench.product_path import TINY
from bench.workload import SHAPES, ModelShape


@dataclass
class Row:
    shape: str
    label: str
    batch: int
    tokens: int = 0
    seconds: float = float("nan")
    tokens_per_s: float = float("nan")
    note: str = ""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build(shape: ModelShape, device: torch.device) -> torch.nn.Module:
    """The shape's random-weight model in bf16 (fp32 on the CPU) with a rank-16 LoRA adapter."""
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(shape.config(), dtype=dtype)
    return attach_lora(model, shape)


def attach_lora(model: torch.nn.Module, shape: ModelShape) -> torch.nn.Module:
    import peft

    torch.manual_seed(1)
    config = peft.LoraConfig(r=16, lora_alpha=16, target_modules=list(shape.lora_targets), init_lora_weights=False)
    return peft.get_peft_model(model, config).eval()


def prompts(count: int, length: int, vocab: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (count, length), generator=generator)


def hf_generate(model: torch.nn.Module, ids: torch.Tensor, new: int) -> tuple[torch.Tensor, float]:
    """HF greedy completions [B, new] and the call's seconds."""
    device = next(model.parameters()).device
    ids = ids.to(device)
    _sync(device)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                             min_new_tokens=new, do_sample=False, pad_token_id=0)
    _sync(device)
    return out[:, ids.shape[1]:].cpu(), time.perf_counter() - start


def ftq_generate(engine: Any, ids: torch.Tensor, new: int) -> tuple[list[list[int]], float]:
    """The sampler's greedy completions and the call's seconds."""
    from trainer.generate.params import Request, SamplingParams

    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    requests = [Request(tuple(row), params) for row in ids.tolist()]
    _sync(engine.device)
    start = time.perf_counter()
    results = engine.generate(requests)
    _sync(engine.device)
    return [r.completions[0].token_ids for r in results], time.perf_counter() - start


def agreement(hf: torch.Tensor, ours: list[list[int]], tokens: int) -> tuple[float, float]:
    """Share of identical tokens over the first ``tokens`` positions, and the mean identical prefix."""
    same, prefixes = 0, []
    for want, got in zip(hf[:, :tokens].tolist(), ours):
        got = got[:tokens]
        same += sum(a == b for a, b in zip(want, got))
        prefix = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
        prefixes.append(prefix)
    return same / (len(ours) * tokens), statistics.fmean(prefixes)


def bench_shape(shape: ModelShape, args: argparse.Namespace) -> list[Row]:
    from trainer.features.lora_kernel import fused as lora_fused
    from trainer.generate import kernels

    device = torch.device(args.device)
    model = build(shape, device)
    rows: list[Row] = []
    new, length = args.new_tokens, args.prompt_tokens
    hf_rates: dict[int, float] = {}
    hf_outputs: dict[int, torch.Tensor] = {}
    for batch in args.hf_batches:
        ids = prompts(batch, length, shape.vocab)
        hf_generate(model, ids[:, : min(8, length)], 2)  # warm-up
        out, seconds = hf_generate(model, ids, new)
        hf_outputs[batch], hf_rates[batch] = out, batch * new / seconds
        rows.append(Row(shape.name, "HF generate (peft, dynamic cache)", batch, batch * new, seconds, hf_rates[batch]))
        print(_line(rows[-1]), flush=True)
    installed = lora_fused.install(model) if args.lora_only else kernels.install(model)
    if args.no_siblings:
        from trainer.features.lora_kernel import siblings

        siblings.ungroup(lora_fused.lora_linear_layers(model))
    label = "ftq sampler (" + ("fused LoRA only" if args.lora_only else "trainer kernels") + (
        ", a prompt a call" if args.no_batched_prefill else "") + (", no sibling groups" if args.no_siblings else "") + ")"
    try:
        max_len = max(length + new, args.ttft_prompt + 1) + 1
        for batch in args.batches:
            ids = prompts(batch, length, shape.vocab)
            for variant in args.variants:
                out = _ftq_row(model, shape, args, batch, ids, max_len, variant, label, hf_rates, rows)
            if batch in hf_outputs and batch == args.agree_batch:
                share, prefix = agreement(hf_outputs[batch], out, min(args.agree_tokens, new))
                rows.append(Row(shape.name, "greedy agreement with HF", batch,
                                note=f"{share:.1%} of the first {min(args.agree_tokens, new)} tokens identical; "
                                     f"mean identical prefix {prefix:.1f}"))
                print(_line(rows[-1]), flush=True)
        for variant in args.variants:
            rows.append(_ttft(model, shape, args, max_len, variant))
            print(_line(rows[-1]), flush=True)
    finally:
        installed.uninstall()
    del model
    if args.cold_start:
        rows.append(_cold_start(shape, args))
        print(_line(rows[-1]), flush=True)
    return rows


VARIANTS = {"ftq": ("auto", True), "no-overlap": (False, True), "unfused": ("auto", False),
            "session-17": (False, False)}
"""``--variants``: the sampler's ``(Engine overlap, groups' base weights as one matrix)``;
``session-17`` is the sampler as session 17 left it (steps one at a time, q/k/v and gate/up sharing
only their ``x @ A^T``)."""


def _group(model: torch.nn.Module, fuse: bool) -> None:
    """Regroup the model's served LoRA siblings with or without their base weights as one matrix."""
    from trainer.features.lora_kernel import fused as lora_fused
    from trainer.features.lora_kernel import siblings

    layers = lora_fused.lora_linear_layers(model)
    if any(getattr(vars(layer).get("_ftq_siblings"), "weight", None) is not None for layer in layers) != fuse:
        siblings.ungroup(layers)
        siblings.group_siblings(model, layers, fuse=fuse)


def _ftq_row(model: torch.nn.Module, shape: ModelShape, args: argparse.Namespace, batch: int, ids: torch.Tensor,
             max_len: int, variant: str, label: str, hf_rates: dict[int, float], rows: list[Row]) -> list[list[int]]:
    """One timed sampler call of ``variant`` at ``batch`` (after its warm-up), appended to ``rows``."""
    from trainer.generate.engine import Engine

    overlap, fuse = VARIANTS[variant]
    if not args.no_siblings and not args.lora_only:
        _group(model, fuse)
    try:
        engine = Engine(model, None, slots=batch, max_len=max_len, max_batch_tokens=args.max_batch_tokens,
                        attention_backend=args.backend, cuda_graphs=args.cuda_graphs, overlap=overlap)
        # warm-up: the cache, the kernels; with graphs the whole run's shape, so every bucket the
        # timed run decodes in (prompts admitted in waves finish in waves) is captured before it
        warm = (ids, min(args.new_tokens, 16)) if args.cuda_graphs else (ids[:, : min(8, ids.shape[1])], 2)
        ftq_generate(engine, *warm)
        out, seconds = ftq_generate(engine, ids, args.new_tokens)
    finally:
        if not args.no_siblings and not args.lora_only:
            _group(model, VARIANTS["ftq"][1])
    rate = batch * args.new_tokens / seconds
    note = f"{rate / hf_rates[batch]:.2f}x HF" if batch in hf_rates else ""
    name = label if variant == "ftq" else f"{label[:-1]}, {variant})"
    rows.append(Row(shape.name, name, batch, batch * args.new_tokens, seconds, rate, note))
    print(_line(rows[-1]), flush=True)
    engine.release()
    return out


def _ttft(model: torch.nn.Module, shape: ModelShape, args: argparse.Namespace, max_len: int,
          variant: str = "ftq") -> Row:
    """Time to first token of one ``--ttft-prompt``-token prompt on a warm engine of ``variant``."""
    from trainer.generate.engine import Engine

    _, fuse = VARIANTS[variant]
    if not args.no_siblings and not args.lora_only:
        _group(model, fuse)
    try:
        engine = Engine(model, None, slots=1, max_len=max_len, max_batch_tokens=max(args.ttft_prompt, 1),
                        attention_backend=args.backend, cuda_graphs=args.cuda_graphs)
        ids = prompts(1, args.ttft_prompt, shape.vocab, seed=1)
        ftq_generate(engine, ids, 1)
        times = [ftq_generate(engine, ids, 1)[1] for _ in range(5)]
    finally:
        if not args.no_siblings and not args.lora_only:
            _group(model, VARIANTS["ftq"][1])
    ms = statistics.median(times) * 1000
    label = f"time to first token, {args.ttft_prompt}-token prompt" + ("" if variant == "ftq" else f" ({variant})")
    return Row(shape.name, label, 1, 1, ms / 1000, float("nan"), f"{ms:.1f} ms (median of 5)")


def _cold_start(shape: ModelShape, args: argparse.Namespace) -> Row:
    from transformers import AutoModelForCausalLM

    from bench.product_path import save_model
    from trainer.generate import kernels
    from trainer.generate.engine import Engine

    directory = save_model(shape, Path(args.workdir) / shape.name / "model", args.device)
    device = torch.device(args.device)
    _sync(device)
    start = time.perf_counter()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, device_map=str(device))
    model = attach_lora(model, shape)
    installed = kernels.install(model)
    try:
        engine = Engine(model, None, slots=1, max_len=64, attention_backend=args.backend,
                        cuda_graphs=args.cuda_graphs)
        ftq_generate(engine, prompts(1, 16, shape.vocab), 1)
        seconds = time.perf_counter() - start
    finally:
        installed.uninstall()
    return Row(shape.name, "cold start (load from local disk, adapter, first token)", 1, 1, seconds,
               note=f"{seconds:.1f} s")


def _line(row: Row) -> str:
    rate = f"{row.tokens_per_s:,.0f}" if row.tokens_per_s == row.tokens_per_s else "-"
    return f"| {row.shape} | {row.label} | {row.batch} | {rate} | {row.note} |"


def table(rows: list[Row]) -> str:
    return "\n".join(["| shape | run | batch | generated tokens/s | note |", "|---|---|---:|---:|---|",
                      *map(_line, rows)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["llama-8b"], choices=list(SHAPES))
    parser.add_argument("--tiny", action="store_true", help="a tiny Llama instead of --shapes (CPU smoke run)")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 64, 256], help="the sampler's batches")
    parser.add_argument("--hf-batches", nargs="*", type=int, default=[1, 64], help="HF generate's batches")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--max-batch-tokens", type=int, default=8192, help="the sampler's tokens per forward")
    parser.add_argument("--ttft-prompt", type=int, default=1000)
    parser.add_argument("--agree-batch", type=int, default=64)
    parser.add_argument("--agree-tokens", type=int, default=128)
    parser.add_argument("--cold-start", action="store_true")
    parser.add_argument("--cuda-graphs", action="store_true", help="replay CUDA graphs for decode steps")
    parser.add_argument("--backend", default="auto", choices=("auto", "torch", "triton"),
                        help="the sampler's attention backend (auto: triton on CUDA, torch on the CPU)")
    parser.add_argument("--lora-only", action="store_true", help="only the fused LoRA layers (no fused ops)")
    parser.add_argument("--no-batched-prefill", action="store_true", help="one attention call per prompt")
    parser.add_argument("--no-siblings", action="store_true", help="each LoRA layer its own x @ A^T (no q/k/v, gate/up grouping)")
    parser.add_argument("--variants", nargs="+", default=["ftq"], choices=list(VARIANTS),
                        help="sampler settings timed one after the other at each batch (see VARIANTS)")
    parser.add_argument("--workdir", default="/tmp/ftq-sampler-bench")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --device cpu (and --tiny)", file=sys.stderr)
        return 2
    if args.no_batched_prefill:
        from trainer.generate import attention

        attention.plan_prefill = lambda *_: None
    shapes = [TINY] if args.tiny else [SHAPES[s] for s in args.shapes]
    rows = [row for shape in shapes for row in bench_shape(shape, args)]
    print("\n" + table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in rows], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
