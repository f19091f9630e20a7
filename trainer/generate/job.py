"""``python -m trainer generate job.json``: a batch generation job (``GenerateConfig``) as a process.

Each rank (one, or torchrun's ``WORLD_SIZE``) loads the model (and the adapter, unmerged), takes
the prompts whose index is its rank modulo the world size and that no earlier attempt finished
(``trainer.generate.outputs``), and runs them through ``Engine.generate`` ``chunk_prompts`` at a
time, appending each chunk's lines to its part file. Ranks share nothing while they run: the
prompts are data-parallel, each rank's engine decodes its own (on CUDA with the triton attention
backend and CUDA graphs for its decode-only steps: ``Engine(cuda_graphs="auto")``). Rank 0 emits
the events:

``log``       what runs: prompts left, ranks, device, dtype, model, adapter
``progress``  stage "generate", prompts_done, prompts_total, tokens (completion tokens of this
              attempt, every rank), tokens_per_s (of this attempt): once when the model has loaded
              (prompts_done: what earlier attempts wrote, the resume point; tokens_per_s null),
              then after each of rank 0's chunks
``done``      status, error_code, message, path (completions.jsonl), prompts, tokens,
              adapter_path (None), steps (0)

SIGTERM / SIGINT stop a rank after the chunk it is in (written whole, or not at all; with
``lines_workers``, the chunk generated before it is written too); a resumed
run starts at the first prompt with no line. With a fixed ``seed`` a resumed run writes the same
file as one that ran through: each prompt's draws depend only on its seed (``params``).
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import torch

from trainer.generate import outputs
from trainer.generate.chat import render_messages
from trainer.generate.engine import Engine
from trainer.generate.job_config import GenerateConfig
from trainer.generate.params import Request, Result, SamplingParams
from trainer.generate.prompts import CHAT, PromptRecord, read_prompts
from trainer.parallel.distributed import Comm, World, device_for

Emit = Callable[..., None]


LineOf = Callable[[PromptRecord, Result], dict[str, Any]]
"""What a finished prompt writes: ``output_line`` for a generation job; an eval grades it first."""
LinesFor = Callable[[Any, Any, torch.device], LineOf]
"""``(model, tokenizer, device) -> LineOf``, called once the model has loaded: an eval run's graders
may judge with that model (``trainer.evals.judges``)."""


def run_generation(config: GenerateConfig, emit: Emit, world: World | None = None,
                   lines_for: LinesFor | None = None, lines_workers: int = 0) -> str:
    """Run the job on this rank; returns ``succeeded`` or ``cancelled`` (failures raise).

    ``lines_for``: makes each finished prompt's line maker once the model has loaded (default
    ``output_line``); an eval run (``trainer.evals.run``) passes one that grades the completion, so
    a line is written (and a resumed run skips its prompt) only once it is graded.
    ``lines_workers``: with 0, a chunk's lines are made as it finishes; with more, on that many
    threads while the next chunk generates (``ChunkLines``: an eval's python graders are processes,
    which would otherwise leave the GPU idle while they run).

    Raises:
        trainer.generate.prompts.PromptError: the prompts file cannot be read.
        ValueError: bad sampling parameters, a prompt longer than ``max_len``, a tokenizer
            without a chat template for chat prompts.
    """
    world = world or World.from_env()
    device = device_for(world, _device_type(config.device))
    comm = Comm(world, device).start()
    try:
        with _stop_on_signals() as stop:
            return _run(config, emit if world.is_main else _silent, world, device, comm, stop, lines_for,
                        lines_workers)
    finally:
        comm.close()


def _run(config: GenerateConfig, emit: Emit, world: World, device: torch.device, comm: Comm,
         stop: threading.Event, lines_for: LinesFor | None, lines_workers: int) -> str:
    params = SamplingParams(**_sampling(config.sampling))
    prompts = read_prompts(config.prompts_file)
    done = outputs.read_lines(config.completions_path, config.parts_dir)
    model, tokenizer, dtype = load_model(config, device)
    emit("log", level="info", message=f"generating {len(prompts) - len(done)} of {len(prompts)} prompts on "
         f"{world.world_size} rank(s) ({device}, {str(dtype).removeprefix('torch.')}) with {config.model}"
         + (f" + adapter {config.adapter}" if config.adapter else ""))
    emit("progress", stage="generate", prompts_done=len(done), prompts_total=len(prompts), tokens=0,
         tokens_per_s=None)
    mine = [p for p in prompts if p.index % world.world_size == world.rank and p.index not in done]
    ids = {p.index: tuple(encode(p, tokenizer)) for p in mine}
    longest = max((len(v) for v in ids.values()), default=1)
    engine = Engine(model, tokenizer, slots=min(config.slots, max(1, len(mine))),
                    max_len=config.max_len or longest + params.max_tokens, device=device, cuda_graphs="auto")
    line_of = lines_for(model, tokenizer, device) if lines_for is not None else output_line
    progress = outputs.Progress(config.completions_path, config.parts_dir)
    base_tokens, started = progress.update()[1], time.perf_counter()

    def write(lines: list[dict[str, Any]] | None) -> None:
        if not lines:
            return
        outputs.append(part, lines)
        prompts_done, tokens = progress.update()
        elapsed = max(time.perf_counter() - started, 1e-9)
        emit("progress", stage="generate", prompts_done=prompts_done, prompts_total=len(prompts),
             tokens=tokens - base_tokens, tokens_per_s=round((tokens - base_tokens) / elapsed, 2))

    with outputs.open_part(config.parts_dir, world.rank) as part, ChunkLines(line_of, lines_workers) as lines:
        for start in range(0, len(mine), config.chunk_prompts):
            if stop.is_set():
                break
            chunk = mine[start:start + config.chunk_prompts]
            write(lines.submit(chunk, engine.generate([Request(ids[p.index], params) for p in chunk])))
        write(lines.flush())
    if stop.is_set():
        return "cancelled"
    comm.barrier()
    if world.is_main:
        outputs.merge(config.completions_path, config.parts_dir, len(prompts))
    return "succeeded"


class ChunkLines:
    """The lines of finished chunks, in prompt order: made at once (``workers`` 0), or on a pool of
    ``workers`` threads while the next chunk generates, one chunk behind (``submit`` hands back the
    chunk before). A line that raises re-raises in the runner, as it would unpooled."""

    def __init__(self, line_of: LineOf, workers: int) -> None:
        self.line_of = line_of
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="lines") if workers > 0 else None
        self.pending: list[Future[dict[str, Any]]] | None = None

    def __enter__(self) -> ChunkLines:
        return self

    def __exit__(self, *_exc: object) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)

    def submit(self, chunk: list[PromptRecord], results: list[Result]) -> list[dict[str, Any]] | None:
        """Start this chunk's lines; the lines to write now (this chunk's unpooled, else the last one's)."""
        if self.pool is None:
            return [self.line_of(p, r) for p, r in zip(chunk, results)]
        previous = self.flush()
        self.pending = [self.pool.submit(self.line_of, p, r) for p, r in zip(chunk, results)]
        return previous

    def flush(self) -> list[dict[str, Any]] | None:
        """The started chunk's lines (waiting for them), or None."""
        pending, self.pending = self.pending, None
        return None if pending is None else [f.result() for f in pending]


def _silent(*_args: Any, **_kwargs: Any) -> None:
    return None


def _sampling(raw: dict[str, Any]) -> dict[str, Any]:
    out = dict(raw)
    if "stop" in out:
        out["stop"] = tuple([out["stop"]] if isinstance(out["stop"], str) else out["stop"])
    return out


def _device_type(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def encode(prompt: PromptRecord, tokenizer: Any) -> list[int]:
    """The prompt's ids: chat through the template with the generation prompt, text as training tokenizes it."""
    if prompt.fmt == CHAT:
        return render_messages(tokenizer, prompt.record["messages"], prompt.record.get("tools"))
    return tokenizer(prompt.record["prompt"])["input_ids"]


def output_line(prompt: PromptRecord, result: Result) -> dict[str, Any]:
    """One line of completions.jsonl: the prompt's index and its input, its choices, the token counts."""
    source = "messages" if prompt.fmt == CHAT else "prompt"
    choices = []
    for c in result.completions:
        choice: dict[str, Any] = {"index": c.index, "text": c.text, "finish_reason": c.finish_reason,
                                  "tokens": len(c.token_ids)}
        if c.logprobs is not None:
            choice["logprobs"] = [{"token_id": lp.token_id, "logprob": lp.logprob,
                                   **({"top": [list(t) for t in lp.top]} if lp.top else {})} for lp in c.logprobs]
        choices.append(choice)
    return {"index": prompt.index, source: prompt.record[source], "choices": choices,
            "usage": {"prompt_tokens": result.prompt_tokens,
                      "completion_tokens": sum(len(c.token_ids) for c in result.completions)}}


def load_base(path: str, dtype_name: str, trust_remote_code: bool, device: torch.device,
              tokenizer_path: str | None = None) -> tuple[Any, Any, torch.dtype]:
    """``(model, tokenizer, dtype)`` of the base at ``path`` on ``device``: ``dtype_name`` or, for
    ``auto``, the checkpoint's own dtype on CUDA and float32 on the CPU (generation jobs and sessions).

    ``tokenizer_path``: where the tokenizer loads from instead of ``path`` (a full fine-tune saved
    without tokenizer files loads its base's: ``GenerateConfig.tokenizer``)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer.export.formats import base_torch_dtype

    if dtype_name != "auto":
        dtype = getattr(torch, dtype_name)
    else:
        dtype = base_torch_dtype(path) if device.type == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, device_map={"": str(device)},
                                                 trust_remote_code=trust_remote_code)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path or path, trust_remote_code=trust_remote_code)
    return model, tokenizer, dtype


def load_model(config: GenerateConfig, device: torch.device) -> tuple[Any, Any, torch.dtype]:
    """``(model, tokenizer, dtype)``: the model on ``device`` in eval mode, the adapter unmerged on it,
    with the trainer's kernels (``trainer.generate.kernels``: fused LoRA layers, fused ops)."""
    model, tokenizer, dtype = load_base(config.model, config.dtype, config.trust_remote_code, device, config.tokenizer)
    if config.adapter:
        import warnings

        from peft import PeftModel

        with warnings.catch_warnings():
            # peft <= 0.21 reads transformers' deprecated `is_gradient_checkpointing` (not ours to fix).
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            model = PeftModel.from_pretrained(model, config.adapter)
    from trainer.generate import kernels

    kernels.install(model)  # the trainer's fused LoRA layers and ops, as training runs them
    return model.eval(), tokenizer, dtype


@contextmanager
def _stop_on_signals() -> Iterator[threading.Event]:
    """SIGTERM / SIGINT set the returned event while the run lasts (main thread only), then restore."""
    stop = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield stop
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
