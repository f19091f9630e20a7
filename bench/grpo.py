"""GRPO step time: ftq's product path beside TRL's GRPOTrainer with its defaults, in one call.

The workload (issue 28): the Llama-3.1-8B shape with random weights (``bench.product_path``'s saved
model and tiny tokenizer), LoRA r=16 alpha=16 on every linear projection, 64 text prompts a step of
exactly 256 tokens each (single-token words, fixed seed), 8 completions a prompt, at most 512 new
tokens, temperature 1. The reward is the same function written twice: ftq's grader JSON
(``string_check``, ``ilike``: 1 when the completion's text holds an ``e``) and a TRL reward function
computing the same thing on TRL's decoded completion. Neither run forces a length: the random
model emits its end-of-sequence id with probability about 1/128,256 a token, so nearly every
completion runs to 512 tokens; the table reports the tokens each run really generated.

- ftq: a job.json with ``objective: grpo`` through ``python -m trainer run`` (every switch
  ``auto``; ``grpo`` defaults: ``loss_type`` dapo, ``scale_rewards`` group, beta 0, as TRL's),
  ``batch_tokens`` 24,576 (four groups of 8 x (256 + 512)) and ``grad_accum`` 16: 64 prompts a
  step. TRL runs first; ftq's ``max_gpu_memory_gb`` is then TRL's measured peak, so the activation
  policy and the sampler's cache plan within it. Figures from its step events: ``step_ms``; the
  split is ``generation_ms`` (the sampler), ``grading_ms`` (the grader) and the rest of the step
  (packing and the training forward, backward and optimizer step); generated tokens =
  ``completion_length`` x sequences; trained tokens = ``tokens`` (prompt + completion of each
  sequence); peak = ``gpu_mem_peak``.
- TRL: ``GRPOTrainer`` in a child process on the same prompts (``Dataset`` of ``prompt`` strings),
  the same model directory in bf16 and ``peft_config``; ``GRPOConfig`` defaults (bf16, gradient
  checkpointing, ``per_device_train_batch_size`` 8, ``num_generations`` 8, ``max_completion_length``
  512, transformers ``generate``, no vLLM) but ``gradient_accumulation_steps`` 64, so one optimizer
  step trains 64 prompts x 8 and generates them in one ``generate`` call of 512 sequences
  (``generation_batch_size`` = 8 x 64; ``--trl-generation-batch`` halves it where that runs out of
  memory). Step time: CUDA-synchronised wall time from ``on_step_begin`` to ``on_step_end``;
  generation: its ``_generate_single_turn``; reward: its ``_calculate_rewards``; training: the rest.
  Peak: ``max_memory_allocated`` over the step. ``--trl-warmup`` runs one short ``generate`` and one
  forward and backward before training, so a single timed step does not carry CUDA's first-call
  costs (what the device's 10-minute call allows: a TRL step of this size takes minutes).

Run on a GPU::

    python -m bench.grpo [--steps 3] [--skip 1] [--trl-steps 1 --trl-warmup] [--json PATH] [--set FIELD=VALUE]

``--device cpu --tiny`` runs the same machinery on a tiny Llama (4 prompts x 4, 16 + 16 tokens).
Target (issue 28): ftq's step at least 3x faster than TRL's at no more peak memory. NeMo RL's
published figure for on-policy Llama-3.1-8B GRPO on 16 H100s is 1,581 tokens/s/GPU.
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
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.product_path import TINY, _single_token_words, job_for, run_job, save_model, set_field
from bench.workload import LORA_TARGETS, SHAPES

TARGET_SPEEDUP = 3.0
NEMO_RL_TOKENS_PER_S_GPU = 1_581
GRADER = {"type": "string_check", "name": "has an e", "input": "{{sample.output_text}}", "reference": "e",
          "operation": "ilike"}


@dataclass(frozen=True)
class Workload:
    prompts_per_step: int
    group: int
    prompt_tokens: int
    new_tokens: int

    @property
    def group_tokens(self) -> int:
        return self.group * (self.prompt_tokens + self.new_tokens)


FULL = Workload(64, 8, 256, 512)
SMALL = Workload(4, 4, 16, 16)
"""The ``--tiny`` smoke run's."""


def has_e(completions: list[str], **_: Any) -> list[float]:
    """TRL's twin of ``GRADER``: ``string_check`` ``ilike`` is ``reference.lower() in text.lower()``."""
    return [float("e" in text.lower()) for text in completions]


@dataclass
class Row:
    label: str
    status: str = "ok"
    step_ms: list[float] = field(default_factory=list)
    generation_ms: list[float] = field(default_factory=list)
    reward_ms: list[float] = field(default_factory=list)
    generated: list[int] = field(default_factory=list)
    """Completion tokens per step."""
    trained: list[int] = field(default_factory=list)
    """Real tokens trained per step (prompt + completion of each sequence)."""
    peak_gib: list[float] = field(default_factory=list)
    reward_mean: list[float] = field(default_factory=list)
    steps_timed: int = 0
    settings: str = ""

    def timed(self, values: list[Any], skip: int) -> list[Any]:
        return values[skip:] if len(values) > skip else values

    def summary(self, skip: int) -> dict[str, float]:
        step = statistics.median(self.timed(self.step_ms, skip))
        gen = statistics.median(self.timed(self.generation_ms, skip))
        reward = statistics.median(self.timed(self.reward_ms, skip))
        seconds = sum(self.timed(self.step_ms, skip)) / 1000.0
        tokens = sum(self.timed(self.generated, skip)) + sum(self.timed(self.trained, skip))
        return {"step_s": step / 1e3, "generation_s": gen / 1e3, "reward_ms": reward,
                "training_s": (step - gen - reward) / 1e3,
                "generated": statistics.mean(self.timed(self.generated, skip)),
                "trained": statistics.mean(self.timed(self.trained, skip)),
                "tokens_per_s": tokens / seconds, "peak_gib": max(self.timed(self.peak_gib, skip)),
                "reward_mean": statistics.mean(self.timed(self.reward_mean, skip))}


def write_prompts(path: Path, model_dir: Path, work: Workload, count: int, seed: int = 0) -> list[str]:
    """``count`` text prompts of exactly ``work.prompt_tokens`` tokens (the tokenizer's specials included)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    words = _single_token_words(tokenizer)
    specials = len(tokenizer("")["input_ids"])
    rng = random.Random(seed)
    prompts = ["".join(rng.choice(words) for _ in range(work.prompt_tokens - specials)) for _ in range(count)]
    lengths = {len(tokenizer(p)["input_ids"]) for p in prompts}
    if lengths != {work.prompt_tokens}:
        raise RuntimeError(f"prompts of {sorted(lengths)} tokens, not {work.prompt_tokens}")
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts), encoding="utf-8")
    return prompts


def ftq_job(model_dir: Path, data: Path, out: Path, steps: int, device: str, work: Workload) -> dict[str, Any]:
    """``bench.product_path``'s job with ``objective: grpo``: ``grad_accum`` micro-batches of four groups."""
    per_micro = 4
    job = job_for(model_dir, data, out, steps, device, 1, per_micro * work.group_tokens)
    job["data"].update(format="prompts", max_seq_len=work.prompt_tokens + work.new_tokens)
    job["optim"]["grad_accum"] = work.prompts_per_step // per_micro
    job["objective"] = "grpo"
    job["grpo"] = {"graders": GRADER, "group_size": work.group, "max_new_tokens": work.new_tokens,
                   "temperature": 1.0}
    return job


def run_ftq(model_dir: Path, data: Path, root: Path, args: argparse.Namespace, work: Workload,
            cap_gib: float | None) -> Row:
    job = ftq_job(model_dir, data, root / "out-ftq", args.steps, args.device, work)
    for assignment in args.set + ([f"max_gpu_memory_gb={cap_gib:.2f}"] if cap_gib else []):
        set_field(job, assignment)
    path = root / "job-grpo.json"
    path.write_text(json.dumps(job, indent=2))
    events, stderr = run_job(path, 1, args.timeout)
    plan = next((e for e in events if e["type"] == "plan"), {"decisions": []})
    decisions = {d["name"]: d for d in plan["decisions"]}
    policy = (decisions.get("gradient_checkpointing") or decisions.get("activation_policy") or {}).get("backend")
    row = Row("ftq GRPO (auto" + (f", planned within TRL's {cap_gib:.1f} GiB)" if cap_gib else ")"),
              settings=f"batch_tokens {job['data']['batch_tokens']}, grad_accum {job['optim']['grad_accum']}, "
                       f"activation policy {policy}, attention {(decisions.get('attention') or {}).get('backend')}")
    done = next((e for e in events if e["type"] == "done"), None)
    if done is None or done["status"] != "succeeded":
        row.status = "failed: " + " ".join(str(done and done.get("message")).splitlines())[:300]
        print(stderr, file=sys.stderr)
        return row
    for e in (e for e in events if e["type"] == "step"):
        row.step_ms.append(e["step_ms"])
        row.generation_ms.append(e["generation_ms"])
        row.reward_ms.append(e["grading_ms"])
        # A GRPO step's ``sequences`` counts its prompts. Trained tokens: each sequence's prompt and
        # completion, what the event's ``tokens`` counts since 2026-11-27 (before, the packed budget).
        completions = e["sequences"] * work.group
        generated = round(e["completion_length"] * completions)
        row.generated.append(generated)
        row.trained.append(completions * work.prompt_tokens + generated)
        row.peak_gib.append((e.get("gpu_mem_peak") or float("nan")) / 2**30)
        row.reward_mean.append(e["reward_mean"])
    row.steps_timed = len(row.timed(row.step_ms, args.skip))
    return row


def run_trl(model_dir: Path, data: Path, out: Path, steps: int, device: str, work: Workload,
            generation_batch: int, warmup: bool) -> dict[str, Any]:
    """TRL's GRPOTrainer on ``data`` (call in a child process: see the module docstring)."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    cuda = device == "cuda"
    prompts = [json.loads(line)["prompt"] for line in data.read_text().splitlines()]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16 if cuda else torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    sequences = work.prompts_per_step * work.group
    per_device = min(8, sequences)
    extra = {} if generation_batch == sequences else {"generation_batch_size": generation_batch}
    args = GRPOConfig(output_dir=str(out), per_device_train_batch_size=per_device,
                      gradient_accumulation_steps=sequences // per_device, num_generations=work.group,
                      max_completion_length=work.new_tokens, max_steps=steps, report_to=[], save_strategy="no",
                      logging_steps=1, use_cpu=not cuda, bf16=cuda, **extra)
    trainer = GRPOTrainer(model=model, reward_funcs=has_e, args=args, train_dataset=Dataset.from_list(
        [{"prompt": p} for p in prompts]), processing_class=tokenizer,
        peft_config=LoraConfig(r=16, lora_alpha=16, target_modules=list(LORA_TARGETS)))
    clock = _Clock(cuda)
    generated: list[int] = []
    generate, rewards = trainer._generate_single_turn, trainer._calculate_rewards

    def timed_generate(*a: Any, **k: Any) -> Any:
        with clock.part("generation"):
            completion_ids, logprobs = generate(*a, **k)
        generated.append(sum(len(c) for c in completion_ids))
        return completion_ids, logprobs

    def timed_rewards(*a: Any, **k: Any) -> Any:
        with clock.part("reward"):
            return rewards(*a, **k)

    trainer._generate_single_turn, trainer._calculate_rewards = timed_generate, timed_rewards
    trainer.add_callback(type("Timer", (TrainerCallback,), {
        "on_step_begin": lambda self, *a, **k: clock.begin(), "on_step_end": lambda self, *a, **k: clock.end(),
    })())
    if warmup:
        _warm_up(trainer.model, tokenizer, prompts[:8], torch.device("cuda" if cuda else "cpu"))
    trainer.train()
    steps_done = len(clock.steps)
    calls = len(generated) // max(steps_done, 1)  # generate calls a step
    per_step = [sum(generated[i * calls:(i + 1) * calls]) for i in range(steps_done)]
    rewards_logged = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    return {"step_ms": [s["step"] for s in clock.steps], "generation_ms": [s["generation"] for s in clock.steps],
            "reward_ms": [s["reward"] for s in clock.steps], "peak_gib": [s["peak"] for s in clock.steps],
            "generated": per_step, "trained": [sequences * work.prompt_tokens + g for g in per_step],
            "reward_mean": rewards_logged[:steps_done], "generation_batch": generation_batch,
            "per_device_train_batch_size": per_device, "gradient_accumulation_steps": sequences // per_device,
            "gradient_checkpointing": args.gradient_checkpointing}


def _warm_up(model: Any, tokenizer: Any, prompts: list[str], device: Any) -> None:
    """One short sampled ``generate`` and one forward and backward: CUDA's first-call costs (context,
    cuBLAS handles, allocator growth) paid before the timed step."""
    import torch

    batch = tokenizer(prompts, return_tensors="pt", padding=True).to(device)
    with torch.no_grad():
        model.generate(**batch, max_new_tokens=8, do_sample=True)
    model.train()
    model(**batch, labels=batch["input_ids"]).loss.backward()
    model.zero_grad(set_to_none=True)


class _Clock:
    """Wall time of each optimizer step and of named parts inside it, synchronised on CUDA, and the
    step's peak allocated memory."""

    def __init__(self, cuda: bool) -> None:
        self.cuda, self.steps, self._current, self._start = cuda, [], {}, 0.0

    def _sync(self) -> None:
        import torch

        if self.cuda:
            torch.cuda.synchronize()

    def begin(self) -> None:
        import torch

        self._sync()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        self._current = {"generation": 0.0, "reward": 0.0}
        self._start = time.perf_counter()

    def end(self) -> None:
        import torch

        self._sync()
        peak = torch.cuda.max_memory_allocated() / 2**30 if self.cuda else float("nan")
        self.steps.append({**self._current, "step": (time.perf_counter() - self._start) * 1e3, "peak": peak})

    def part(self, name: str) -> Any:
        clock = self

        class _Part:
            def __enter__(self) -> None:
                clock._sync()
                self.start = time.perf_counter()

            def __exit__(self, *exc: Any) -> None:
                clock._sync()
                clock._current[name] = clock._current.get(name, 0.0) + (time.perf_counter() - self.start) * 1e3

        return _Part()


def trl_row(model_dir: Path, data: Path, root: Path, args: argparse.Namespace, work: Workload) -> Row:
    """TRL's row from a child process (its own CUDA context and memory figures); on running out of
    memory, again with half the generation batch (``generate`` called twice a step)."""
    batch = args.trl_generation_batch or work.prompts_per_step * work.group
    while True:
        out = root / "trl.json"
        out.unlink(missing_ok=True)
        argv = [sys.executable, "-m", "bench.grpo", "trl", str(model_dir), str(data), str(out), str(args.trl_steps),
                args.device, str(batch), "1" if args.trl_warmup else "0", "tiny" if args.tiny else "full"]
        # The GPU box is offline; on the CPU, Triton (which TRL's imports reach) needs its interpreter.
        env = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", **os.environ,
               **({"TRITON_INTERPRET": "1"} if args.device == "cpu" else {})}
        done = subprocess.run(argv, capture_output=True, text=True, timeout=args.timeout, env=env)
        oom = "OutOfMemoryError" in done.stderr or "CUDA out of memory" in done.stderr
        if done.returncode == 0 or not oom or batch <= work.group * 2:
            break
        print(f"TRL ran out of memory with generation batch {batch}; again with {batch // 2}", file=sys.stderr)
        batch //= 2
    row = Row(f"TRL GRPOTrainer (generation batch {batch})")
    if done.returncode != 0:
        row.status = "failed: " + " ".join(done.stderr.strip().splitlines()[-1:])[:300]
        print(done.stderr[-3000:], file=sys.stderr)
        return row
    figures = json.loads(out.read_text())
    for name in ("step_ms", "generation_ms", "reward_ms", "generated", "trained", "peak_gib", "reward_mean"):
        setattr(row, name, figures[name])
    row.settings = (f"per_device_train_batch_size {figures['per_device_train_batch_size']}, gradient_accumulation_steps "
                    f"{figures['gradient_accumulation_steps']}, generation_batch_size {batch}, gradient_checkpointing "
                    f"{figures['gradient_checkpointing']}")
    row.steps_timed = len(row.timed(row.step_ms, args.trl_skip))
    return row


def table(rows: list[tuple[Row, int]]) -> str:
    lines = ["| run | step s | generation s | reward ms | training s | generated tok/step | trained tok/step "
             "| (generated + trained) tok/s/GPU | peak GiB | reward mean | steps timed |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row, skip in rows:
        if row.status != "ok":
            lines.append(f"| {row.label} | {row.status} | | | | | | | | | |")
            continue
        s = row.summary(skip)
        lines.append(f"| {row.label} | {s['step_s']:.1f} | {s['generation_s']:.1f} | {s['reward_ms']:.0f} | "
                     f"{s['training_s']:.1f} | {s['generated']:,.0f} | {s['trained']:,.0f} | {s['tokens_per_s']:,.0f} | "
                     f"{s['peak_gib']:.2f} | {s['reward_mean']:.3f} | {row.steps_timed} |")
    return "\n".join(lines)


def verdict(ftq: Row, trl: Row | None, args: argparse.Namespace) -> str:
    mine = ftq.summary(args.skip)
    lines = [f"ftq GRPO: {mine['tokens_per_s']:,.0f} (generated + trained) tokens/s/GPU on 1 GPU; NeMo RL's "
             f"published on-policy Llama-3.1-8B figure: {NEMO_RL_TOKENS_PER_S_GPU:,} tokens/s/GPU on 16 H100s"]
    if trl is not None and trl.status == "ok":
        theirs = trl.summary(args.trl_skip)
        speedup = theirs["step_s"] / mine["step_s"]
        target = "a tiny smoke run" if args.tiny else "met" if speedup >= TARGET_SPEEDUP else "MISSED"
        memory = ("no more" if mine["peak_gib"] <= theirs["peak_gib"] else "MORE" if mine["peak_gib"] > theirs["peak_gib"]
                  else "n/a")  # NaN on the CPU
        lines.append(f"vs TRL: step {speedup:.2f}x faster (target >= {TARGET_SPEEDUP:.0f}x: {target}); generation "
                     f"{theirs['generation_s'] / mine['generation_s']:.2f}x, training "
                     f"{theirs['training_s'] / mine['training_s']:.2f}x; peak {mine['peak_gib']:.1f} GiB vs "
                     f"{theirs['peak_gib']:.1f} GiB ({memory})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["trl"]:
        model_dir, data, out, steps, device, batch, warmup, size = argv[1:9]
        work = SMALL if size == "tiny" else FULL
        figures = run_trl(Path(model_dir), Path(data), Path(out).parent / "trl-run", int(steps), device, work,
                          int(batch), warmup == "1")
        Path(out).write_text(json.dumps(figures))
        return 0
    args = parse(argv)
    shape, work = (TINY, SMALL) if args.tiny else (SHAPES["llama-8b"], FULL)
    root = Path(args.workdir) / shape.name
    root.mkdir(parents=True, exist_ok=True)
    model_dir = save_model(shape, root / "model", args.device)
    data = root / "prompts.jsonl"
    write_prompts(data, model_dir, work, max(args.steps, args.trl_steps) * work.prompts_per_step)
    trl = None if args.no_trl else trl_row(model_dir, data, root, args, work)
    print(table([(trl, args.trl_skip)]) if trl else "", flush=True)
    cap = None
    if trl is not None and trl.status == "ok" and args.device == "cuda":
        if not any(s.startswith("max_gpu_memory_gb=") for s in args.set):
            cap = max(trl.timed(trl.peak_gib, args.trl_skip))
    ftq = run_ftq(model_dir, data, root, args, work, cap)
    rows = [(ftq, args.skip)] + ([(trl, args.trl_skip)] if trl is not None else [])
    print(f"\n{shape.name}, {work.prompts_per_step} prompts x {work.group}, {work.prompt_tokens}-token prompts, "
          f"up to {work.new_tokens} new tokens\n" + table(rows))
    for row, _ in rows:
        print(f"{row.label}: {row.settings}; step ms {[round(x) for x in row.step_ms]}")
    if ftq.status == "ok":
        print(verdict(ftq, trl, args))
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r, _ in rows], indent=2))
    return 0 if all(r.status == "ok" for r, _ in rows) else 1


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="ftq's steps")
    parser.add_argument("--skip", type=int, default=1, help="ftq's warm-up steps left out of the figures")
    parser.add_argument("--trl-steps", type=int, default=3)
    parser.add_argument("--trl-skip", type=int, default=1)
    parser.add_argument("--trl-warmup", action="store_true", help="a short generate and backward before TRL trains")
    parser.add_argument("--trl-generation-batch", type=int, default=0, help="TRL's generation_batch_size (0: a step's)")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="change an ftq job field")
    parser.add_argument("--no-trl", action="store_true", help="only the ftq run")
    parser.add_argument("--workdir", default="/tmp/ftq-bench-grpo")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--tiny", action="store_true", help="a tiny Llama and a small workload (CPU smoke run)")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--timeout", type=float, default=3600.0)
    return parser.parse_args(argv)


if __name__ == "__main__":
    sys.exit(main())
