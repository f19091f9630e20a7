"""lm-evaluation-harness (the optional ``lm-eval`` package, ``lm_eval``) on ftq's model loading and
sampler: ``FtqLM`` is an ``lm_eval.api.model.LM`` whose

- ``generate_until`` runs every request through the sampler (``trainer.generate.engine.Engine``,
  continuous batching, LoRA unmerged as ``load_model`` installs it): greedy unless the task's
  ``gen_kwargs`` say ``do_sample``, stopping at the task's ``until`` strings or ``max_gen_toks``;
- ``loglikelihood`` scores each continuation with one forward of context + continuation (the sum of
  the continuation tokens' log-probabilities, and whether each was the argmax), batched by padding;
- ``loglikelihood_rolling`` scores a whole text in windows of the model's context.

``evaluate(model, tokenizer, task_dir, tasks)`` runs tasks whose YAML lives in ``task_dir`` (their data
local files: ``dataset_path: json`` with ``data_files``) with ``HF_DATASETS_OFFLINE=1``: nothing is
downloaded. ``lm_eval`` is imported here only, never by the trainer's other modules.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from lm_eval.api.model import LM

from trainer.generate.engine import Engine
from trainer.generate.params import Request, SamplingParams


class FtqLM(LM):
    """A loaded causal LM (and its tokenizer) as lm-eval's ``LM``."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any, *, slots: int = 16, max_len: int = 2048,
                 batch_size: int = 8) -> None:
        super().__init__()
        self.model, self.tokenizer = model.eval(), tokenizer
        self.slots, self.max_len, self.batch_size = slots, max_len, batch_size
        self.device_ = next(model.parameters()).device

    # -- generation: the sampler ------------------------------------------------------------
    def generate_until(self, requests: list[Any]) -> list[str]:
        engine_requests = []
        for request in requests:
            context, kwargs = request.args
            kwargs = dict(kwargs or {})
            until = kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            sample = bool(kwargs.get("do_sample", False))
            params = SamplingParams(max_tokens=int(kwargs.get("max_gen_toks", 256)),
                                    temperature=float(kwargs.get("temperature", 1.0)) if sample else 0.0,
                                    stop=tuple(until))
            engine_requests.append(Request(tuple(self._encode(context)), params))
        longest = max((len(r.prompt_ids) + r.params.max_tokens for r in engine_requests), default=2)
        engine = Engine(self.model, self.tokenizer, slots=min(self.slots, max(1, len(requests))),
                        max_len=max(longest + 1, 2), device=self.device_)
        try:
            results = engine.generate(engine_requests)
        finally:
            engine.release()
        return [result.completions[0].text for result in results]

    # -- likelihoods: forwards ----------------------------------------------------------------
    def loglikelihood(self, requests: list[Any]) -> list[tuple[float, bool]]:
        pairs = []
        for request in requests:
            context, continuation = request.args
            context_ids = self._encode(context) if context else [self._prefix_token()]
            pairs.append((context_ids, self._encode(continuation, special=False)))
        out: list[tuple[float, bool]] = []
        for start in range(0, len(pairs), self.batch_size):
            out.extend(self._score(pairs[start:start + self.batch_size]))
        return out

    def loglikelihood_rolling(self, requests: list[Any]) -> list[float]:
        totals = []
        for request in requests:
            (text,) = request.args
            ids = self._encode(text, special=False)
            total, prefix = 0.0, [self._prefix_token()]
            for start in range(0, len(ids), self.max_len - 1):
                window = ids[start:start + self.max_len - 1]
                context = prefix if start == 0 else ids[max(0, start - 1):start]
                total += self._score([(context, window)])[0][0]
            totals.append(total)
        return totals

    def _score(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """Per (context, continuation): the continuation's summed log-probability and whether greedy."""
        rows = [(ctx + cont)[-self.max_len:] for ctx, cont in pairs]
        width = max(len(r) for r in rows)
        pad = self.tokenizer.pad_token_id or 0
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, :len(row)], mask[i, :len(row)] = torch.tensor(row), 1
        with torch.no_grad():
            logits = self.model(input_ids=ids.to(self.device_), attention_mask=mask.to(self.device_)).logits
        logprobs = torch.log_softmax(logits.float(), dim=-1).cpu()
        out = []
        for i, ((_, cont), row) in enumerate(zip(pairs, rows)):
            n = min(len(cont), len(row) - 1)
            positions = torch.arange(len(row) - n - 1, len(row) - 1)
            targets = torch.tensor(row[len(row) - n:])
            picked = logprobs[i, positions]
            out.append((float(picked.gather(1, targets[:, None]).sum()), bool((picked.argmax(-1) == targets).all())))
        return out

    def _encode(self, text: str, special: bool = True) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=special)["input_ids"])

    def _prefix_token(self) -> int:
        token = self.tokenizer.bos_token_id
        return token if token is not None else (self.tokenizer.eos_token_id or 0)


def evaluate(model: torch.nn.Module, tokenizer: Any, task_dir: Path, tasks: list[str], *,
             limit: int | None = None, slots: int = 16) -> dict[str, Any]:
    """lm-eval's ``simple_evaluate`` of ``tasks`` (YAML under ``task_dir``) on ``FtqLM``, offline:
    ``{"results": {task: {metric: value}}, "samples": {task: [per-document records]}}``."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(task_dir), include_defaults=False)
    got = simple_evaluate(model=FtqLM(model, tokenizer, slots=slots), tasks=tasks, task_manager=manager,
                          limit=limit, log_samples=True, bootstrap_iters=0, random_seed=0)
    if got is None:
        raise RuntimeError("lm-eval returned no results (not rank 0)")
    return {"results": got["results"], "samples": got.get("samples", {})}
