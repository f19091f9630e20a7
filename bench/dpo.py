"""DPO throughput: ftq's product path beside TRL's DPOTrainer with its defaults, in one call.

The workload (issue 16): the Llama-3.1-8B shape with random weights (``bench.product_path``'s
saved model and tiny tokenizer), LoRA r=16 alpha=16 on every linear projection, preference pairs
in OpenAI's format whose prompts are ~100 tokens and answers ~150 each (word counts drawn
uniformly in [80, 120] and [120, 180], fixed seed; each word one token, plus the chat template's),
32 pairs per optimizer step.

- ftq: a job.json with ``objective: dpo`` through ``python -m trainer run`` (every switch
  ``auto``), ``batch_tokens`` 16,384 (about 32 pairs; the trainer packs whole pairs greedily).
  TRL runs first; ftq's ``max_gpu_memory_gb`` is then TRL's measured peak, so its activation
  policy (``gradient_checkpointing: auto``) plans within it: "no more memory than TRL" is what the
  run is asked for, not luck (a large card would otherwise keep every activation, ~85 GiB on the
  8B shape). ``--uncapped`` adds the plain ``auto`` run; ``--set max_gpu_memory_gb=X`` overrides.
  Figures from its own step events: real tokens (each pair's prompt counted with each answer, no
  padding) over the summed step times after ``--skip`` warm-up steps; peak = largest
  ``gpu_mem_peak``; reward metrics from the same events.
- TRL: ``DPOTrainer`` on the same pairs (conversational records, the same model directory in
  bf16), ``DPOConfig`` defaults but ``per_device_train_batch_size`` 32 (32 pairs per step),
  ``max_steps`` and no reporting; ``peft_config`` the same LoRA. Run in a child process
  (``python -m bench.dpo trl ...``; on the CPU under ``TRITON_INTERPRET=1``, as TRL's DPO forward
  takes a Triton kernel). Step time: CUDA-synchronised wall time from ``on_step_begin`` to
  ``on_step_end``; real tokens: the attention-mask sum of each collated batch (what TRL counts as
  ``num_tokens``); peak: ``max_memory_allocated`` over the timed steps.

Run on a GPU::

    python -m bench.dpo [--steps 12] [--skip 3] [--json PATH] [--set FIELD=VALUE] [--no-trl] [--uncapped]

``--device cpu --tiny`` runs the same machinery on a tiny Llama (the unit test's smoke run).
Target (DESIGN.md): ftq at least 7,500 real tokens/s (5x TRL's 1,463) at no more peak memory.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.product_path import TINY, ProductResult, _single_token_words, job_for, run_job, save_model, set_field
from bench.workload import LORA_TARGETS, SHAPES, TOKENS_PER_STEP

PAIRS_PER_STEP = 32
TARGET_TOKENS_PER_S = 7_500
PROMPT_WORDS, ANSWER_WORDS = (80, 120), (120, 180)


def write_pairs(path: Path, model_dir: Path, count: int, seed: int = 0, scale: float = 1.0) -> list[dict[str, Any]]:
    """``count`` pairs in OpenAI's DPO format (``scale`` shrinks the lengths for the tiny run)."""
    from transformers import AutoTokenizer

    words = _single_token_words(AutoTokenizer.from_pretrained(model_dir))
    rng = random.Random(seed)

    def text(bounds: tuple[int, int]) -> str:
        n = max(2, int(rng.randint(*bounds) * scale))
        return "".join(rng.choice(words) for _ in range(n)).strip()

    records = [
        {"input": {"messages": [{"role": "user", "content": text(PROMPT_WORDS)}]},
         "preferred_output": [{"role": "assistant", "content": text(ANSWER_WORDS)}],
         "non_preferred_output": [{"role": "assistant", "content": text(ANSWER_WORDS)}]}
        for _ in range(count)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return records


def ftq_job(model_dir: Path, data: Path, out: Path, steps: int, device: str, tokens: int) -> dict[str, Any]:
    """``bench.product_path``'s job with ``objective: dpo`` on the preference file."""
    job = job_for(model_dir, data, out, steps, device, 1, tokens)
    job["data"]["format"] = "preference"
    job["objective"] = "dpo"
    job["dpo"] = {"beta": 0.1, "label_smoothing": 0.0}
    return job


def rewards_line(events: list[dict[str, Any]]) -> str:
    """The last step's DPO metrics, so a run that trained nothing shows."""
    steps = [e for e in events if e["type"] == "step"]
    if not steps:
        return "no step events"
    last = steps[-1]
    return "last step: " + ", ".join(
        f"{k} {last[k]:.4g}" for k in ("loss", "reward_margin", "reward_accuracy", "chosen_logp", "rejected_logp")
        if last.get(k) is not None
    )


def run_trl(model_dir: Path, data: Path, out: Path, steps: int, skip: int, device: str, batch: int) -> dict[str, Any]:
    """TRL's DPOTrainer on ``data`` (call in a child process: see the module docstring)."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    cuda = device == "cuda"
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    rows = [{"prompt": r["input"]["messages"], "chosen": r["preferred_output"], "rejected": r["non_preferred_output"]}
            for r in rows]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16 if cuda else torch.float32)
    args = DPOConfig(output_dir=str(out), per_device_train_batch_size=batch, max_steps=steps, report_to=[],
                     save_strategy="no", logging_steps=1, use_cpu=not cuda, bf16=cuda)
    trainer = DPOTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows),
                         processing_class=AutoTokenizer.from_pretrained(model_dir),
                         peft_config=LoraConfig(r=16, lora_alpha=16, target_modules=list(LORA_TARGETS)))
    tokens: list[int] = []
    collate = trainer.data_collator

    def counting(examples: list[dict[str, Any]]) -> dict[str, Any]:
        out = collate(examples)
        tokens.append(int(out["attention_mask"].sum()))
        return out

    trainer.data_collator = counting
    timer = _StepTimer(cuda)
    trainer.add_callback(type("Timer", (TrainerCallback,), {
        "on_step_begin": lambda self, *a, **k: timer.begin(), "on_step_end": lambda self, *a, **k: timer.end(),
    })())
    trainer.train()
    timed = slice(skip, None) if len(timer.ms) > skip else slice(None)
    seconds = sum(timer.ms[timed]) / 1000.0
    return {"tokens_per_s": sum(tokens[: len(timer.ms)][timed]) / seconds, "step_ms": timer.ms,
            "tokens": tokens[: len(timer.ms)], "peak_gib": max(timer.peaks[timed], default=float("nan")),
            "steps_timed": len(timer.ms[timed])}


class _StepTimer:
    """Wall time per optimizer step, synchronised on CUDA, and the step's peak allocated memory."""

    def __init__(self, cuda: bool) -> None:
        self.cuda, self.ms, self.peaks, self._start = cuda, [], [], 0.0

    def begin(self) -> None:
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        self._start = time.perf_counter()

    def end(self) -> None:
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            self.peaks.append(torch.cuda.max_memory_allocated() / 2**30)
        self.ms.append((time.perf_counter() - self._start) * 1000.0)


def trl_result(shape: str, model_dir: Path, data: Path, root: Path, args: argparse.Namespace) -> ProductResult:
    """TRL's row, from a child process (its own CUDA context and memory figures)."""
    out = root / "trl.json"
    argv = [sys.executable, "-m", "bench.dpo", "trl", str(model_dir), str(data), str(out), str(args.steps),
            str(args.skip), args.device, str(args.trl_batch)]
    # The GPU box is offline: nothing of TRL's (datasets, hub) may try the network.
    env = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", **os.environ,
           **({"TRITON_INTERPRET": "1"} if args.device == "cpu" else {})}
    started = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, timeout=args.timeout, env=env)
    result = ProductResult(shape, f"TRL DPOTrainer (batch {args.trl_batch})")
    result.seconds = time.perf_counter() - started
    if done.returncode != 0:
        result.status = f"failed: {done.stderr[-300:]}"
        print(done.stderr[-3000:], file=sys.stderr)
        return result
    figures = json.loads(out.read_text())
    result.tokens_per_s, result.peak_gib, result.steps_timed = figures["tokens_per_s"], figures["peak_gib"], figures["steps_timed"]
    result.step_ms, result.tokens = figures["step_ms"], figures["tokens"]
    result.step_ms_median = statistics.median(result.step_ms[args.skip:] or result.step_ms)
    return result


def verdict(ftq: ProductResult, trl: ProductResult | None, tiny: bool = False) -> str:
    """The target line: ftq's tokens/s against 7,500 and TRL, and its peak against TRL's."""
    target = ("a tiny smoke run: the target is for the 8B shape" if tiny
              else "met" if ftq.tokens_per_s >= TARGET_TOKENS_PER_S else "MISSED")
    lines = [f"ftq DPO: {ftq.tokens_per_s:,.0f} real tokens/s (target >= {TARGET_TOKENS_PER_S:,}): {target}"]
    if trl is not None and trl.status == "ok":
        memory = "no more" if ftq.peak_gib <= trl.peak_gib else "MORE" if ftq.peak_gib > trl.peak_gib else "n/a"
        lines.append(f"vs TRL: {ftq.tokens_per_s / trl.tokens_per_s:.2f}x tokens/s, peak {ftq.peak_gib:.1f} GiB vs "
                     f"{trl.peak_gib:.1f} GiB ({memory})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["trl"]:
        model_dir, data, out, steps, skip, device, batch = argv[1:8]
        figures = run_trl(Path(model_dir), Path(data), Path(out).parent / "trl-run", int(steps), int(skip), device, int(batch))
        Path(out).write_text(json.dumps(figures))
        return 0
    args = parse(argv)
    from bench.product_path import table

    shape = TINY if args.tiny else SHAPES["llama-8b"]
    root = Path(args.workdir) / shape.name
    root.mkdir(parents=True, exist_ok=True)
    model_dir = save_model(shape, root / "model", args.device)
    data = root / "pairs.jsonl"
    write_pairs(data, model_dir, args.steps * PAIRS_PER_STEP * 2, scale=0.1 if args.tiny else 1.0)
    trl = None if args.no_trl else trl_result(shape.name, model_dir, data, root, args)
    cap = memory_cap(trl, args)
    runs = [("ftq DPO (auto" + (f", planned within TRL's {cap:.1f} GiB)" if cap else ")"), cap)]
    runs += [("ftq DPO (auto, uncapped)", None)] if cap and args.uncapped else []
    results, events = [], []
    for label, limit in runs:
        result, events_of_run = run_ftq(shape.name, label, model_dir, data, root, args, limit)
        results.append(result)
        events = events or events_of_run
    results += [trl] if trl is not None else []
    print(table(results))
    print(rewards_line(events))
    if results[0].status == "ok":
        print(verdict(results[0], trl, args.tiny))
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in results], indent=2))
    return 0 if all(r.status == "ok" for r in results) else 1


def memory_cap(trl: ProductResult | None, args: argparse.Namespace) -> float | None:
    """The GiB ftq's activation policy plans within: TRL's measured peak ("at no more memory"),
    unless ``--set max_gpu_memory_gb=`` names one or TRL has no GPU figure."""
    if any(s.startswith("max_gpu_memory_gb=") for s in args.set) or trl is None or trl.status != "ok":
        return None
    return trl.peak_gib if trl.peak_gib == trl.peak_gib else None  # NaN on the CPU


def run_ftq(shape: str, label: str, model_dir: Path, data: Path, root: Path, args: argparse.Namespace,
            cap_gib: float | None) -> tuple[ProductResult, list[dict[str, Any]]]:
    """One ftq DPO job through ``python -m trainer run``; its row and its events."""
    from bench.product_path import summarize

    name = "capped" if cap_gib else "auto"
    job = ftq_job(model_dir, data, root / f"out-{name}", args.steps, args.device, 512 if args.tiny else TOKENS_PER_STEP)
    for assignment in args.set + ([f"max_gpu_memory_gb={cap_gib:.2f}"] if cap_gib else []):
        set_field(job, assignment)
    path = root / f"job-dpo-{name}.json"
    path.write_text(json.dumps(job, indent=2))
    started = time.perf_counter()
    events, stderr = run_job(path, 1, args.timeout)
    result = summarize(shape, label, events, args.skip)
    result.seconds = time.perf_counter() - started
    if result.status != "ok":
        print(stderr, file=sys.stderr)
    return result, events


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--skip", type=int, default=3, help="warm-up steps left out of the figures")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="change an ftq job field")
    parser.add_argument("--trl-batch", type=int, default=PAIRS_PER_STEP, help="TRL's per_device_train_batch_size")
    parser.add_argument("--no-trl", action="store_true", help="only the ftq run")
    parser.add_argument("--uncapped", action="store_true", help="also run ftq without planning within TRL's peak")
    parser.add_argument("--workdir", default="/tmp/ftq-bench-dpo")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--tiny", action="store_true", help="a tiny Llama (CPU smoke run)")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--timeout", type=float, default=3600.0)
    return parser.parse_args(argv)


if __name__ == "__main__":
    sys.exit(main())
