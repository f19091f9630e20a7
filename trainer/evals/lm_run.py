"""An eval run of an lm-evaluation-harness task (``EvalConfig.lm_eval``; the API checked it:
``core.evals.lm_task``): the run's items are the task's documents, lm-eval renders and scores
them on ``trainer.evals.lm_harness.FtqLM`` (generate_until on ftq's sampler, loglikelihood and
multiple_choice by forwards), ``chunk_prompts`` documents at a time.

Each chunk is a task of its own: its documents written as a JSONL file beside a YAML naming it
(``dataset_path: json``, HF datasets' local builder, ``HF_DATASETS_OFFLINE=1``: nothing is
downloaded), run by ``lm_eval.simple_evaluate``; each document's record becomes its line (the
rendered context as the input, the answer, per metric a result scored as lm-eval scored it and
passed at its ``pass_threshold``), appended to the part file as the generation job's are. So a
cancelled run stops after its chunk and a resumed one starts at the first item with no line, and
the run's totals are the means of per-item scores (the only aggregation the API lets a task ask).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from trainer.evals.config import EvalConfig
from trainer.evals.results import status_of
from trainer.generate import outputs
from trainer.generate.job import Emit, _device_type, _stop_on_signals, load_model
from trainer.generate.prompts import PromptRecord, read_prompts
from trainer.parallel.distributed import World, device_for

MISSING = ("lm-eval is not installed on this worker: an lm_eval run needs ftq's lm_eval extra "
           "(pip install 'ftq[lm_eval]', or `make up SERVICE_EXTRAS=lm_eval`)")


def run_lm_eval(config: EvalConfig, emit: Emit, world: World | None = None) -> str:
    """Score every item with the task; ``succeeded`` or ``cancelled`` (failures raise)."""
    world = world or World.from_env()
    if world.world_size > 1:
        raise ValueError("an lm_eval run takes one GPU (gpus: 1)")
    os.environ["HF_DATASETS_OFFLINE"] = os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        from trainer.evals.lm_harness import FtqLM
    except ImportError as exc:
        raise RuntimeError(MISSING) from exc
    assert config.lm_eval is not None
    prompts = read_prompts(config.prompts_file)
    done = outputs.read_lines(config.completions_path, config.parts_dir)
    model, tokenizer, dtype = load_model(config, device_for(world, _device_type(config.device)))
    max_len = config.max_len or int(getattr(model.config, "max_position_embeddings", 2048))
    lm = FtqLM(model, tokenizer, slots=config.slots, max_len=max_len)
    emit("log", level="info", message=f"lm-eval task {config.lm_eval['task']} ({config.lm_eval['output_type']}): "
         f"{len(prompts) - len(done)} of {len(prompts)} items with {config.model}"
         + (f" + adapter {config.adapter}" if config.adapter else "") + f" ({str(dtype).removeprefix('torch.')})")
    emit("progress", stage="generate", prompts_done=len(done), prompts_total=len(prompts), tokens=0, tokens_per_s=None)
    todo = [p for p in prompts if p.index not in done]
    progress = outputs.Progress(config.completions_path, config.parts_dir)
    with _stop_on_signals() as stop, tempfile.TemporaryDirectory(prefix="ftq-lm-eval-") as tmp, \
            outputs.open_part(config.parts_dir, world.rank) as part:
        for start in range(0, len(todo), config.chunk_prompts):
            if stop.is_set():
                return "cancelled"
            chunk = todo[start:start + config.chunk_prompts]
            samples = run_chunk(lm, config.lm_eval, [p.record.get("item") for p in chunk], Path(tmp) / str(start))
            outputs.append(part, [item_line(p, samples[i], config) for i, p in enumerate(chunk)])
            prompts_done, _ = progress.update()  # tokens are not counted (a likelihood task generates none): 0
            emit("progress", stage="generate", prompts_done=prompts_done, prompts_total=len(prompts), tokens=0,
                 tokens_per_s=0.0)
    if stop.is_set():
        return "cancelled"
    outputs.merge(config.completions_path, config.parts_dir, len(prompts))
    return "succeeded"


def sandbox_templates() -> None:
    """Render lm-eval's task templates in Jinja's sandbox.

    lm-eval renders ``doc_to_text``, ``doc_to_target``, ``doc_to_choice``, ``description`` and the
    rest with a plain ``jinja2.Environment`` (``lm_eval.utils.env``, read by ``apply_template`` at
    each call), so a user's task template could reach Python's internals (``lipsum``'s globals, a
    string built at render time to spell a dunder: the submission's ``__`` check does not see it)
    and run commands on the worker. The sandbox refuses every such access (``SecurityError``: the
    run fails naming it); ordinary templates, ``regex_replace`` included, render as before.
    """
    import lm_eval.utils as utils
    from jinja2 import BaseLoader, StrictUndefined
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    if isinstance(utils.env, ImmutableSandboxedEnvironment):
        return
    env = ImmutableSandboxedEnvironment(loader=BaseLoader, undefined=StrictUndefined, keep_trailing_newline=True)
    env.filters["regex_replace"] = utils.regex_replace
    for name in ("lipsum", "cycler", "joiner", "namespace"):  # nothing a task needs; less to reach through
        env.globals.pop(name, None)
    utils.env = env


def run_chunk(lm: Any, task: dict[str, Any], docs: list[Any], where: Path) -> dict[int, dict[str, Any]]:
    """lm-eval's per-document records of ``task`` over ``docs``, by position in ``docs``; its
    templates rendered in Jinja's sandbox (``sandbox_templates``)."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    sandbox_templates()
    where.mkdir(parents=True)
    data = where / "docs.jsonl"
    data.write_text("".join(json.dumps(doc, ensure_ascii=False) + "\n" for doc in docs), encoding="utf-8")
    local = {"dataset_path": "json", "test_split": "test",
             "dataset_kwargs": {"data_files": {"test": str(data)}, "cache_dir": str(where / "hf")}}
    (where / "task.yaml").write_text(json.dumps({**task, **local}), encoding="utf-8")  # JSON is YAML
    got = simple_evaluate(model=lm, tasks=[task["task"]], task_manager=TaskManager(
        include_path=str(where), include_defaults=False), log_samples=True, bootstrap_iters=0,
        random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0)
    if got is None:
        raise RuntimeError("lm-eval returned no results")
    return {int(s["doc_id"]): s for s in got["samples"][task["task"]]}


def item_line(prompt: PromptRecord, sample: dict[str, Any], config: EvalConfig) -> dict[str, Any]:
    """An item's line as a graded generation line reads: the context lm-eval built as the input, the
    answer (the generation, or the likeliest choice, or the continuation scored) and a result per metric."""
    arguments, responses = sample["arguments"], sample["filtered_resps"]
    kind = config.lm_eval["output_type"] if config.lm_eval else ""
    if kind == "generate_until":
        answer = str(responses[0])
    else:
        scores = [float(r[0]) for r in responses]
        answer = str(arguments[max(range(len(scores)), key=scores.__getitem__)][1])
    results = []
    for criterion in config.testing_criteria:
        value = sample.get(criterion["name"])
        error = None if value is not None else f"lm-eval did not score {criterion['name']} for this item"
        score = float(value) if value is not None else 0.0
        results.append({"name": criterion["name"], "type": "lm_eval", "score": score, "sample": None, "error": error,
                        "passed": error is None and score >= float(criterion.get("pass_threshold", 1.0))})
    return {"index": prompt.index, "messages": [{"role": "user", "content": str(arguments[0][0])}],
            "choices": [{"index": 0, "text": answer, "finish_reason": "stop", "tokens": 0}],
            "usage": {"prompt_tokens": 0, "completion_tokens": 0}, "item": prompt.record.get("item"),
            "lm_eval": {"target": _plain(sample.get("target")), "responses": _plain(responses)},
            "results": results, "status": status_of(results)}


def _plain(value: Any) -> Any:
    """lm-eval's values (numpy numbers, tuples) as JSON."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    try:
        return float(value)
    except (TypeError, ValueError):
        return str(value)
