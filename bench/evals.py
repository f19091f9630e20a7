"""An eval run (``trainer.evals.run.run_eval``, what ``python -m trainer eval job.json`` runs) of
``--items`` items on a random-weight shape, timed by part, beside the sampler alone (issue 27).

Run on a GPU: ``python -m bench.evals [--shape llama-8b] [--items 1000] [--json PATH]``; a CPU smoke
run: ``python -m bench.evals --shape tiny --items 24 --device cpu``.

Setup (not timed): the shape's random-weight model saved to ``--workdir`` as bench.product_path
saves one (bf16 on CUDA, the tiny tokenizer beside it: nothing is downloaded), a rank-16 LoRA
adapter on it with non-zero B (the eval runs on ``base + adapter``, as a tuned model's run does),
and ``--items`` items rendered as an eval's prompts file (a user message of ``--prompt-words``
random single-token words; the item's ``answer`` another such word).

The eval run, in this process, with the product's code (``run_eval``: ``load_model``, the Engine,
chunks of ``chunk_prompts``, every completion graded by every criterion before its line is
written): a ``string_check`` (eq), a ``text_similarity`` (fuzzy_match) and, with ``--python``, a
``python`` grader (its sandboxed process per item). Reported:

- ``total``: ``run_eval``'s wall time, from nothing loaded to the completions file merged;
- ``loading``: ``load_model`` (weights from disk onto the device, the adapter, the fused LoRA layers);
- ``generation``: the Engine's ``generate`` calls (prefill + decode of every chunk), with the
  completion tokens over that time: the sampler's tokens/s inside the run;
- ``waiting for grades``: the runner waiting for graded lines: with the python grader the items
  are graded on ``grading_workers`` threads while the next chunk generates
  (``trainer.generate.job.ChunkLines``), so this is only what grading adds to the run; with 0
  workers (in line) it is all of the grading;
- ``grader time (summed)``: ``grade_all`` over every item (all criteria), summed over the threads;
- ``other``: the rest (prompts read and tokenized, lines written, progress, the final merge).

Then the sampler alone, as ``bench.sampler`` times it (``bench.sampler.build``: the shape built in
memory with its adapter and the fused LoRA layers, ``Engine.generate`` on random token ids of the
run's mean prompt length, ``ignore_eos`` to ``--new-tokens``, ``slots`` = the run's, CUDA graphs as
the run's engine, warmed up on the same prompts first): the tokens/s
an eval run should hold. Nothing here is a test: no row asserts a speed.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

from bench.product_path import TINY, save_model
from bench.workload import SHAPES, ModelShape

CRITERIA = [
    {"type": "string_check", "name": "exact", "input": "{{sample.output_text}}", "reference": "{{item.answer}}",
     "operation": "eq"},
    {"type": "text_similarity", "name": "close", "input": "{{sample.output_text}}", "reference": "{{item.answer}}",
     "evaluation_metric": "fuzzy_match", "pass_threshold": 0.5},
]
PYTHON = {"type": "python", "name": "mentions", "pass_threshold": 1.0,
          "source": "def grade(sample, item):\n    return float(item['answer'] in sample['output_text'])\n"}


@dataclass
class Timings:
    shape: str
    items: int
    total_s: float = 0.0
    loading_s: float = 0.0
    generation_s: float = 0.0
    grading_s: float = 0.0
    grading_wait_s: float = 0.0
    other_s: float = 0.0
    grading_workers: int = 0
    completion_tokens: int = 0
    prompt_tokens: int = 0
    run_tokens_per_s: float = float("nan")
    alone_tokens_per_s: float = float("nan")
    alone_note: str = ""


class Clock:
    """Seconds spent inside the wrapped callables, by name."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def patch(self, owner: Any, attr: str, name: str, device: torch.device | None) -> Iterator[None]:
        """Time ``owner.attr``; ``device``: synchronised around each call (None: not, for what
        runs on grading threads beside the sampler and touches no GPU)."""
        original = getattr(owner, attr)
        lock = threading.Lock()

        def timed(*args: Any, **kwargs: Any) -> Any:
            if device is not None:
                _sync(device)
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                if device is not None:
                    _sync(device)
                with lock:
                    self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

        setattr(owner, attr, timed)
        try:
            yield
        finally:
            setattr(owner, attr, original)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def save_adapter(shape: ModelShape, directory: Path, device: str) -> Path:
    """A rank-16 LoRA adapter with non-zero B on the saved model (``bench.sampler.attach_lora``)."""
    from transformers import AutoModelForCausalLM

    from bench.sampler import attach_lora

    if (directory / "adapter_config.json").exists():
        return directory
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(shape.config(), dtype=dtype)  # the adapter only needs the shapes
    attach_lora(model, shape).save_pretrained(directory)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return directory


def write_items(path: Path, model_dir: Path, count: int, words: int, seed: int = 0) -> None:
    """``count`` prompts records of an eval run: the rendered messages and the item."""
    from transformers import AutoTokenizer

    from bench.product_path import _single_token_words

    vocabulary = [w.strip() for w in _single_token_words(AutoTokenizer.from_pretrained(model_dir))]
    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(count):
            question = " ".join(rng.choices(vocabulary, k=words))
            record = {"messages": [{"role": "user", "content": question}], "item": {"answer": rng.choice(vocabulary)}}
            f.write(json.dumps(record) + "\n")


def run_eval_timed(args: argparse.Namespace, shape: ModelShape, workdir: Path) -> Timings:
    import trainer.evals.run as eval_run
    import trainer.generate.job as generate_job
    from trainer.evals.config import EvalConfig
    from trainer.generate.engine import Engine

    device = torch.device(args.device)
    model_dir = save_model(shape, workdir / shape.name / "model", args.device)
    adapter = save_adapter(shape, workdir / shape.name / "adapter", args.device)
    prompts = workdir / f"items-{args.items}.jsonl"
    write_items(prompts, model_dir, args.items, args.prompt_words)
    out = Path(tempfile.mkdtemp(dir=workdir, prefix="run-"))
    config = EvalConfig(model=str(model_dir), adapter=str(adapter), prompts_file=str(prompts), output_dir=str(out),
                        sampling={"max_tokens": args.new_tokens, "temperature": 0.0}, slots=args.slots,
                        chunk_prompts=args.chunk, device=args.device, grading_workers=args.grading_workers,
                        testing_criteria=CRITERIA + ([PYTHON] if args.python else []))
    clock = Clock()
    with clock.patch(generate_job, "load_model", "loading", device), \
            clock.patch(Engine, "generate", "generation", device), \
            clock.patch(eval_run, "grade_all", "grading", None), \
            clock.patch(generate_job.ChunkLines, "flush", "waiting", None):
        start = time.perf_counter()
        status = eval_run.run_eval(config, lambda *_a, **_k: None)
        total = time.perf_counter() - start
    if status != "succeeded":
        raise RuntimeError(f"the eval run ended {status}")
    lines = [json.loads(line) for line in config.completions_path.read_text().splitlines()]
    got = Timings(shape.name, len(lines), total, clock.seconds.get("loading", 0.0), clock.seconds.get("generation", 0.0),
                  clock.seconds.get("grading", 0.0), clock.seconds.get("waiting", 0.0),
                  grading_workers=eval_run.grading_workers(config))
    if got.grading_workers == 0:  # graded in line, on the runner's thread
        got.grading_wait_s = got.grading_s
    got.other_s = got.total_s - got.loading_s - got.generation_s - got.grading_wait_s
    got.completion_tokens = sum(int(line["usage"]["completion_tokens"]) for line in lines)
    got.prompt_tokens = sum(int(line["usage"]["prompt_tokens"]) for line in lines)
    got.run_tokens_per_s = got.completion_tokens / got.generation_s if got.generation_s else float("nan")
    passed = sum(line["status"] == "pass" for line in lines)
    print(f"{shape.name}: {len(lines)} items graded ({passed} passed: random weights), "
          f"{got.completion_tokens} completion tokens", flush=True)
    return got


def sampler_alone(args: argparse.Namespace, shape: ModelShape, timings: Timings) -> None:
    """``bench.sampler``'s row on the run's work: batch ``slots``, the mean prompt length, ``--new-tokens``."""
    from bench.sampler import build, ftq_generate, prompts
    from trainer.generate import kernels
    from trainer.generate.engine import Engine

    length = max(1, round(timings.prompt_tokens / max(timings.items, 1)))
    count = min(args.items, args.alone_prompts)
    model = build(shape, torch.device(args.device))
    installed = kernels.install(model)
    try:
        # as the eval run's engine (trainer.generate.job): CUDA graphs for the decode-only steps
        engine = Engine(model, None, slots=args.slots, max_len=length + args.new_tokens + 1, cuda_graphs="auto")
        ids = prompts(count, length, shape.vocab)
        ftq_generate(engine, ids, min(args.new_tokens, 16))  # warm-up: the kernels and every graph bucket
        out, seconds = ftq_generate(engine, ids, args.new_tokens)
        engine.release()
    finally:
        installed.uninstall()
    tokens = sum(len(row) for row in out)
    timings.alone_tokens_per_s = tokens / seconds
    timings.alone_note = f"{count} prompts of {length} tokens, {args.new_tokens} new each, slots {args.slots}"


def table(rows: list[Timings]) -> str:
    lines = ["| shape | items | grading workers | total s | loading s | generation s | waiting for grades s | "
             "other s | grader time s (summed) | sampler tok/s in the run | sampler alone tok/s | in run / alone |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        share = lambda part: f"{part:.2f} ({part / r.total_s:.0%})"  # noqa: E731
        ratio = r.run_tokens_per_s / r.alone_tokens_per_s if r.alone_tokens_per_s == r.alone_tokens_per_s else float("nan")
        lines.append(f"| {r.shape} | {r.items} | {r.grading_workers} | {r.total_s:.2f} | {share(r.loading_s)} | "
                     f"{share(r.generation_s)} | {share(r.grading_wait_s)} | {share(r.other_s)} | {r.grading_s:.2f} | "
                     f"{r.run_tokens_per_s:.0f} | {r.alone_tokens_per_s:.0f} | {ratio:.2f} |")
    return "\n".join(lines)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="llama-8b", choices=[*SHAPES, "tiny"])
    p.add_argument("--items", type=int, default=1000)
    p.add_argument("--prompt-words", type=int, default=48, help="words per item's question (single tokens each)")
    p.add_argument("--new-tokens", type=int, default=64, help="max_completion_tokens of the run")
    p.add_argument("--slots", type=int, default=64, help="the eval job's slots (sequences decoded together)")
    p.add_argument("--chunk", type=int, default=256, help="the eval job's chunk_prompts")
    p.add_argument("--python", action="store_true", help="add a python grader (a sandboxed process per item)")
    p.add_argument("--grading-workers", type=int, default=None,
                   help="the run's grading_workers (default: the product's; 0 grades in line, as before 2026-11-28)")
    p.add_argument("--alone-prompts", type=int, default=256, help="prompts of the sampler-alone row")
    p.add_argument("--no-alone", action="store_true", help="skip the sampler-alone row")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--workdir", default=str(Path(tempfile.gettempdir()) / "ftq-bench-evals"))
    p.add_argument("--json", help="write the rows here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    shape = TINY if args.shape == "tiny" else SHAPES[args.shape]
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    timings = run_eval_timed(args, shape, workdir)
    if not args.no_alone:
        sampler_alone(args, shape, timings)
    print(table([timings]))
    if timings.alone_note:
        print(f"sampler alone: {timings.alone_note}")
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(timings)], indent=2))
    print(f"generation is {timings.generation_s / timings.total_s:.0%} of the run's time")
    return 0


if __name__ == "__main__":
    sys.exit(main())
