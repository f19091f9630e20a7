"""GRPO: each step samples ``group_size`` completions of its prompts from the policy being trained,
grades them, and trains on them with group-normalised advantages (``trainer.objectives.grpo_loss``).

The step (``trainer.training.step``) calls ``rollout`` with this rank's prompts before its
micro-batches: the sampler (``trainer.generate.Engine``) runs on the training model itself (its
adapters unmerged, the fused layers as installed, no copy), at ``grpo.temperature``/``top_p`` with a
seed from the job's seed and the step, so a resumed step samples the same completions. Each
completion is graded with the job's grader (``trainer.graders.run.grade``: its item is the prompt's
record, so ``{{item.x}}`` reads the record's own fields); a grader's failure on an item scores it 0
(and is counted). Advantages are each reward less its group's mean, over the group's spread (or,
``scale_rewards: batch``, the step's over every rank). Each rank samples only its own prompts; the
seeds depend on the prompt, not the rank, so two ranks sample what one process would. Under FSDP2
(method full on several GPUs, or a sharded LoRA base) every forward gathers parameters with all
ranks, so the ranks' samplers decode in lock-step (``Engine.generate``'s ``lockstep``): a rank whose
prompts are done runs idle forwards until every rank's are, decided each step by one small host
collective (``Comm.any_rank``). Then ``pack``
lays a prompt's group out for training: where the run's packed attention takes shared prefixes
(``trainer.data.packed_metadata.PREFIX_BACKENDS``, no sliding window), the prompt but its last token
once, then ``group_size`` sequences each of the last prompt token and a completion that see the prompt
as their prefix (the same attention, positions and log-probabilities as ``group_size`` whole
sequences, with the prompt's forward and backward done once instead of ``G`` times); otherwise
``group_size`` whole sequences (prompt + completion). Labels on the completions; the loss reads each
completion token's log-probability through the fused head. With one
optimisation step per batch of rollouts the sampling policy is the current one: ``old`` is the
log-probabilities detached (ratio 1, gradient of ``logp``). The step's denominator is its number
of sequences (``grpo``, ``dr_grpo``) or of completion tokens over every rank (``bnpo``, ``dapo``:
gathered once after the rollouts with the batch spread's sums, on the host group).

Legend: ``G`` group size.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from trainer.config import TrainConfig
from trainer.data.packing import PackedBatch, SegmentRow
from trainer.errors import ConfigError
from trainer.objectives.grpo_loss import STD_EPS, denominator, group_advantages, policy_loss
from trainer.objectives.grpo_slots import rollout_slots
from trainer.training.flops import FlopCounter

STATS = ("reward_sum", "reward_sq_sum", "completions", "zero_std_groups", "groups", "completion_tokens",
         "grade_errors", "clip_low", "clip_high", "loss_tokens", "ratio_sum", "kl_sum",
         "rollout_ranks", "generation_ms", "grading_ms")
"""The step's device sums, in order (``new_stats``): the rollout's, the loss's (``LOSS_STATS``), the
ranks' rollout timings (host wall times, summed over the ranks that sampled, then averaged)."""
LOSS_STATS = slice(7, 12)
TIMING_STATS = slice(12, 15)


@dataclass
class PromptItem:
    """One prompt of the job: a schedule item whose group is sampled at its step."""

    index: int
    ids: list[int]
    record: dict[str, Any]
    group: int
    max_new: int
    shared: bool = False
    """Packed with its prompt once for the group (``Grpo.share_prefixes``; ``build_loss`` turns it off
    where the installed attention cannot take shared prefixes)."""
    completions: list[list[int]] = field(default_factory=list)
    """This step's ``G`` completions (set by ``rollout``)."""
    rewards: list[float] = field(default_factory=list)
    scores: list[dict[str, float]] = field(default_factory=list)
    """Each completion's score by grader (a ``multi`` grader's graders, else the one grader's name)."""
    advantages: list[float] = field(default_factory=list)
    errors: int = 0

    def __len__(self) -> int:
        """Tokens the packed group may take: what the schedule packs micro-batches by. ``shared``: the
        prompt but its last token once, then G times its last token and the longest completion;
        else G times the prompt and the longest completion."""
        if self.shared:
            return len(self.ids) - 1 + self.group * (1 + self.max_new)
        return self.group * (len(self.ids) + self.max_new)

    @property
    def num_loss_tokens(self) -> int:
        """The group's sequences: the step's loss denominator counts sequences (see ``Grpo``)."""
        return self.group


class Grpo:
    """The ``grpo`` objective (``trainer.objectives.declarations.GRPO``)."""

    share_prompts = True
    """The sampler's shared-prompt cache (``trainer.generate.cache``): a group's completions read one
    copy of its prompt's keys, so more sequences decode at once. The same rollouts either way
    (``tests/unit/trainer/test_grpo.py`` turns it off to show it)."""
    share_prefixes = True
    """Train each prompt once for its group (``pack``; where the installed attention takes shared
    prefixes): the same losses and gradients as the whole sequences, ``(G - 1) * (prompt - 1)`` fewer
    tokens through the model per group (``tests/unit/trainer/test_grpo.py``, ``test_grpo_loss.py``)."""

    def __init__(self) -> None:
        self.config: Any = None
        self.tokenizer: Any = None
        self.seed = 0
        self.items: list[PromptItem] = []
        self.step_tokens = 0
        """Completion tokens of the step over every rank (``bnpo``/``dapo``'s denominator)."""
        self.sampled: list[PromptItem] = []
        """This rank's prompts of the step (``rollout``'s), the only ones whose completions it knows."""
        self.comm: Any = None
        self.memory_cap: int | None = None
        """The job's ``max_gpu_memory_gb`` in bytes: the sampler's cache is sized within it too."""
        self.strategy: str | None = None
        """The run's parallel strategy (``build_loss``'s): under ``fsdp2`` the rollouts run in lock-step."""
        self._timings: list[float] = []
        """This rank's last rollout: [1, generation ms, grading ms], added to the step's sums once."""
        self._shown: dict[int, list[dict[str, Any]]] = {}
        """The first rollouts of each step not yet emitted (``take_rollouts``), by step."""

    def load_data(self, config: TrainConfig, tokenizer: Any) -> tuple[list[PromptItem], None]:
        from trainer.generate.job import encode
        from trainer.generate.prompts import PromptError, read_prompts
        from trainer.graders.errors import GraderError
        from trainer.graders.run import uses_model
        from trainer.graders.spec import validate

        grpo = config.grpo
        if grpo.graders is None:
            raise ConfigError("grpo.graders: a GRPO job needs a grader (the reward), e.g. "
                              '{"type": "string_check", "operation": "like", ...}')
        try:
            self.grader = validate(grpo.graders, "grpo.graders")
        except GraderError as exc:
            raise ConfigError(str(exc)) from None
        if uses_model(self.grader):
            raise ConfigError("grpo.graders.type: score_model and label_model graders need a judge model beside the "
                              "policy, which a GRPO job does not load; use string_check, text_similarity or python")
        try:
            prompts = read_prompts(config.data.train_path)
        except PromptError as exc:
            raise ConfigError(f"data.train_path: {exc}") from None
        self.config, self.tokenizer, self.seed = grpo, tokenizer, config.seed
        self.memory_cap = None if config.max_gpu_memory_gb is None else int(config.max_gpu_memory_gb * 2**30)
        items = [PromptItem(p.index, list(encode(p, tokenizer)), p.record, grpo.group_size, grpo.max_new_tokens,
                            shared=self.share_prefixes) for p in prompts]
        self.items = items
        _check_fit(items, config.data.batch_tokens)
        return items, None

    def rollout(self, comm: Any, model: torch.nn.Module, step: int, items: Sequence[PromptItem],
                forward: Any = None, cache_dtype: torch.dtype | None = None) -> None:
        """Sample, grade and score each of this rank's ``items`` for ``step`` (module docstring);
        ``forward``: the model's forward as the run's strategy calls it (``Parallel.model_forward``),
        ``cache_dtype``: the dtype its forwards see the parameters in (``Parallel.gathered_dtype``;
        None: the parameters' own)."""
        from trainer.generate.engine import Engine
        from trainer.generate.params import Request, SamplingParams

        from trainer.generate.cache import SharedPrompts

        grpo = self.config
        longest = max((len(item.ids) for item in items), default=1)
        slots, prompt_slots = rollout_slots(model, len(items), grpo.group_size, longest, grpo.max_new_tokens,
                                            self.memory_cap, self.share_prompts)
        shared = SharedPrompts(prompt_slots, longest, grpo.max_new_tokens) if self.share_prompts else None
        # A fresh engine a step: its cache and CUDA graphs (bound to the cache) go with it.
        # FSDP2 gathers every layer in every forward with all ranks: the ranks decode in lock-step
        # (a CUDA graph would not capture the gathers)
        lockstep = comm.any_rank if self.strategy == "fsdp2" else None
        engine = Engine(model, self.tokenizer, slots=slots, max_len=longest + grpo.max_new_tokens, forward=forward,
                        cache_dtype=cache_dtype, cuda_graphs="auto" if lockstep is None else False,
                        shared_prompts=shared)
        requests = [Request(tuple(item.ids), SamplingParams(
            max_tokens=grpo.max_new_tokens, temperature=grpo.temperature, top_p=grpo.top_p, n=grpo.group_size,
            seed=(self.seed * 1_000_003 + step) * 1_000_003 + item.index)) for item in items]
        started = time.perf_counter()
        try:
            results = engine.generate(requests, lockstep)  # each decode step reads its tokens back: synced
        finally:
            engine.release()  # the training step after needs the memory
        generated = time.perf_counter()
        self.sampled, self.comm = list(items), comm
        texts = [[c.text for c in result.completions] for result in results]
        for item, result, text in zip(items, results, texts):
            item.completions = [c.token_ids for c in result.completions]
            item.rewards, item.scores, item.errors = self._grade(item, text)
        self._timings = [1.0, (generated - started) * 1e3, (time.perf_counter() - generated) * 1e3]
        self._score(comm, items)
        self._shown[step] = shown_rollouts(items, texts, self.tokenizer, self.config.log_rollouts)

    def take_rollouts(self, step: int) -> list[dict[str, Any]] | None:
        """The first ``grpo.log_rollouts`` rollouts of this rank's prompts at ``step`` (the ``rollouts``
        event's, which rank 0 emits after the step's event), forgotten once taken; older steps' too."""
        shown = self._shown.pop(step, None)
        for older in [s for s in self._shown if s < step]:
            del self._shown[older]
        return shown

    def _score(self, comm: Any, items: Sequence[PromptItem]) -> None:
        """Each completion's advantage, and the step's completion tokens over every rank. One host
        gather: ``scale_rewards: batch`` divides by the spread of the whole step's rewards (TRL's std of
        the generation batch, gathered over processes; the sample std), not this rank's."""
        rewards = [r for item in items for r in item.rewards]
        local = [float(sum(len(c) for item in items for c in item.completions)),
                 float(len(rewards)), sum(rewards), sum(r * r for r in rewards)]
        tokens, n, total, squares = (sum(column) for column in zip(*comm.gather_host(local, "grpo token counts")))
        self.step_tokens = int(tokens)
        scale = self.config.scale_rewards
        spread = math.sqrt(max(squares - total * total / n, 0.0) / (n - 1)) if n > 1 else 0.0
        for item in items:
            advantages, _ = group_advantages(torch.tensor(item.rewards), self.config.group_size,
                                             "none" if scale == "batch" else scale)
            item.advantages = (advantages / (spread + STD_EPS) if scale == "batch" else advantages).tolist()

    def _grade(self, item: PromptItem, texts: list[str]) -> tuple[list[float], list[dict[str, float]], int]:
        """Each completion's reward, its score by grader, and how many failed (scored 0). A template
        naming a field this record lacks fails its completions too: the submission's dry run reads
        the first records only."""
        from trainer.graders.errors import GraderError
        from trainer.graders.run import grade

        rewards, scores, errors = [], [], 0
        for text in texts:
            try:
                result = grade(self.grader, text, item.record, param="grpo.graders")
            except GraderError:
                rewards.append(0.0)
                scores.append({self.grader["name"]: 0.0})
                errors += 1
                continue
            rewards.append(float(result.score))
            scores.append({k: float(v) for k, v in result.sub_scores.items()} or {result.name: float(result.score)})
            errors += 0 if result.ok else 1
        return rewards, scores, errors

    def pack(self, items: Sequence[PromptItem]) -> PackedBatch:
        """The micro-batch's groups (module docstring): extras ``advantage`` (each token its sequence's)
        and ``sequence`` (each token's sequence index); ``prefixes`` when the prompts are shared."""
        self._packed = list(items)  # the micro-batch whose rollout sums ``collecting`` adds
        row = SegmentRow()
        shared = any(item.shared for item in items)
        for item in items:
            head = item.ids[:-1] if shared else []  # the prompt but its last token, trained once
            prefix = row.add(head, [-100] * len(head), advantage=0.0, sequence=len(row.lengths)) if head else -1
            tail = item.ids[len(head):]
            for completion, adv in zip(*_sampled(item)):
                row.add(tail + completion, [-100] * (len(tail) - 1) + completion + [-100], len(head), prefix,
                        advantage=adv, sequence=len(row.lengths))
        return row.batch(sum(i.num_loss_tokens for i in items), {"advantage": torch.float32}, shared)

    def build_loss(self, config: TrainConfig, model: torch.nn.Module, installed: Any, strategy: str | None) -> Any:
        self.strategy = strategy
        from trainer.features.attention.packed import windowed_attention

        shared = self.share_prefixes and installed.attention.takes_prefixes and not windowed_attention(model)
        for item in self.items:
            item.shared = shared
        _check_fit(self.items, config.data.batch_tokens)  # whole sequences are longer
        if config.grpo.beta > 0 and config.method == "full":
            raise ConfigError("grpo.beta: the KL reference is the base with the adapter off, which method full "
                              "has not; use lora or qlora, or beta 0")
        self._check_context(model)
        self.loss = GrpoLoss(self, installed.loss.kernel)
        return self.loss

    def _check_context(self, model: torch.nn.Module) -> None:
        """Refuse prompts that, with ``max_new_tokens`` after them, overrun the model's positions."""
        context = getattr(getattr(model, "config", None), "max_position_embeddings", None)
        longest = max((len(item.ids) for item in self.items), default=0)
        if isinstance(context, int) and longest + self.config.max_new_tokens > context:
            raise ConfigError(f"grpo.max_new_tokens: the longest prompt ({longest} tokens) and "
                              f"{self.config.max_new_tokens} new tokens overrun the model's context of {context}; "
                              "lower grpo.max_new_tokens or shorten the prompts")

    def new_stats(self, device: torch.device) -> torch.Tensor:
        return torch.zeros(len(STATS), dtype=torch.float32, device=device)

    @contextmanager
    def collecting(self, stats: torch.Tensor | None) -> Iterator[None]:
        self.loss.stats = stats
        self.loss.add_rollout_stats(getattr(self, "_packed", []))
        if stats is not None and self._timings:  # the rank's rollout, with its first micro-batch
            stats[TIMING_STATS] += torch.tensor(self._timings, dtype=torch.float32).to(stats.device)
            self._timings = []
        try:
            yield
        finally:
            self.loss.stats = None

    def step_fields(self, sums: Sequence[float], targets: int) -> dict[str, float | None]:
        s = dict(zip(STATS, sums))
        n = max(s["completions"], 1.0)
        mean = s["reward_sum"] / n
        return {
            "reward_mean": mean,
            "reward_std": math.sqrt(max(s["reward_sq_sum"] / n - mean * mean, 0.0)),
            "zero_std_fraction": s["zero_std_groups"] / max(s["groups"], 1.0),
            "completion_length": s["completion_tokens"] / n,
            "clip_fraction": (s["clip_low"] + s["clip_high"]) / max(s["loss_tokens"], 1.0),
            "kl": s["kl_sum"] / max(s["loss_tokens"], 1.0) if self.config.beta > 0 else None,
            "grade_error_fraction": s["grade_errors"] / n,
            "generation_ms": s["generation_ms"] / s["rollout_ranks"] if s["rollout_ranks"] else None,
            "grading_ms": s["grading_ms"] / s["rollout_ranks"] if s["rollout_ranks"] else None,
        }

    def eval_accuracy(self, sums: Sequence[float], targets: int) -> float | None:
        return None

    def sampled_tokens(self) -> int:
        """Tokens of this rank's sampled sequences in the step, prompt and completion each (the step
        event's ``tokens``, the same whether the prompts are packed shared or not; an item's ``len``
        is what the schedule packs it by)."""
        return sum(len(item.ids) + len(c) for item in self.sampled for c in item.completions)

    def step_flops(self, counter: FlopCounter, items: Sequence[Any]) -> float:
        """The training forward and backward on the packed groups, plus the sampler's forwards
        (2 per parameter per token it fed: each prompt once, each generated token once). A rank
        knows the completions of its own prompts only (``sampled``; the step's ``items`` of other
        ranks hold older ones), so each counts its own and the counts are summed over the ranks:
        a host gather, which every rank reaches once a step, after its micro-batches."""
        mine = self.sampled if self.comm is not None else items
        lengths = [len(item.ids) + len(c) for item in mine for c in item.completions]
        fed = sum(len(item.ids) + sum(len(c) for c in item.completions) for item in mine)
        local = counter.step_flops(lengths) + 2.0 * (counter.trainable_params + counter.frozen_params) * fed
        # a shared prompt (but its last token) is trained once for its group, not G times: its forward
        # and backward, attention included (a completion's attention over it is the whole sequence's)
        local -= sum((len(item.completions) - 1) * counter.step_flops([len(item.ids) - 1])
                     for item in mine if item.shared and len(item.ids) > 1)
        return sum(row[0] for row in self.comm.gather_host([local], "grpo flops")) if self.comm is not None else local


MAX_ROLLOUT_CHARS = 2000
"""A shown rollout's prompt and completion are cut to this many characters (the event stays small)."""


def shown_rollouts(items: Sequence[PromptItem], texts: Sequence[Sequence[str]], tokenizer: Any,
                   count: int) -> list[dict[str, Any]]:
    """The first ``count`` completions of ``items`` (graded and scored), in order, as the
    ``rollouts`` event lists them: the prompt's index and text, the completion's text and tokens,
    its reward, advantage and score by grader, and whether its grading failed."""
    shown: list[dict[str, Any]] = []
    for item, completions in zip(items, texts):
        if len(shown) >= count:
            break
        prompt = tokenizer.decode(item.ids, skip_special_tokens=True) if tokenizer is not None else ""
        for k, text in enumerate(completions[: count - len(shown)]):
            shown.append({
                "prompt_index": item.index, "prompt": _cut(prompt), "completion": _cut(text),
                "completion_tokens": len(item.completions[k]), "reward": item.rewards[k],
                "advantage": item.advantages[k], "scores": item.scores[k],
            })
    return shown


def _cut(text: str) -> str:
    return text if len(text) <= MAX_ROLLOUT_CHARS else text[:MAX_ROLLOUT_CHARS] + "…"


def _sampled(item: PromptItem) -> tuple[list[list[int]], list[float]]:
    """``item``'s completions and advantages. On a rank with no micro-batch of its own, the step
    packs the step's first one as a stand-in (``trainer.training.step._padded``: its loss times 0,
    only so DDP's collectives pair) whose prompts another rank sampled: one this rank never sampled
    packs as ``G`` copies of its last prompt token, advantage 0, so the row is never empty."""
    if item.completions:
        return item.completions, item.advantages
    return [item.ids[-1:]] * item.group, [0.0] * item.group


def sequence_advantages(batch: PackedBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """A packed micro-batch's (``Grpo.pack``'s) sequence index per position [T] and advantage per
    sequence [S], on the batch's device (no host read)."""
    seq_T = batch.extras["sequence"].reshape(-1)
    adv_T = batch.extras["advantage"].reshape(-1)
    # every token of a sequence carries its advantage: the scatter writes equal values
    adv_S = torch.zeros(len(batch.lengths), dtype=adv_T.dtype, device=adv_T.device).scatter_(0, seq_T, adv_T)
    return seq_T, adv_S


def _check_fit(items: Sequence[PromptItem], batch_tokens: int) -> None:
    """A prompt's group is packed whole into one micro-batch: refuse one longer than ``batch_tokens``."""
    over = max(items, key=len, default=None)
    if over is not None and len(over) > batch_tokens:
        group = (f"{len(over.ids) - 1} prompt + {over.group} x (1 + {over.max_new} new)" if over.shared else
                 f"{over.group} x ({len(over.ids)} prompt + {over.max_new} new)")
        raise ConfigError(f"data.batch_tokens: prompt {over.index}'s group, {group} = {len(over)} tokens, is packed "
                          f"into one micro-batch of at most {batch_tokens}; raise hyperparameters.batch_tokens or "
                          "lower grpo.group_size, grpo.max_new_tokens or the prompt")


class GrpoLoss:
    """``loss(model, batch, meta, num_items)`` of one packed micro-batch of groups."""

    def __init__(self, objective: Grpo, loss_kernel: str) -> None:
        self.objective, self.loss_kernel = objective, loss_kernel
        self.stats: torch.Tensor | None = None

    def __call__(self, model: torch.nn.Module, batch: PackedBatch, meta: Any, num_items: int) -> torch.Tensor:
        from trainer.features.loss.packed_forward import packed_token_logprobs

        grpo = self.objective.config
        loss_config = grpo.loss_config()
        ref_T = None
        if grpo.beta > 0:
            with torch.no_grad(), model.disable_adapter():
                ref_T = packed_token_logprobs(model, batch, meta, self.loss_kernel)
        logp_T = packed_token_logprobs(model, batch, meta, self.loss_kernel)
        seq_T, adv_S = sequence_advantages(batch)
        mask_T = batch.targets.reshape(-1) != -100
        numerator, stats = policy_loss(logp_T, logp_T.detach(), ref_T, adv_S, seq_T, mask_T, loss_config)
        divisor = denominator(loss_config, int(num_items), self.objective.step_tokens, grpo.max_new_tokens)
        if self.stats is not None:
            self.stats[LOSS_STATS] += stats.to(self.stats.device)
        return numerator / divisor

    def add_rollout_stats(self, items: Sequence[PromptItem]) -> None:
        """The micro-batch's rewards and completions into the step's sums (host values, one copy)."""
        if self.stats is None:
            return
        rewards = [r for item in items for r in item.rewards]
        zero = sum(1 for item in items if len(set(item.rewards)) == 1)
        tokens = sum(len(c) for item in items for c in item.completions)
        values = [sum(rewards), sum(r * r for r in rewards), len(rewards), zero, len(items), tokens,
                  sum(item.errors for item in items)]
        self.stats[:7] += torch.tensor(values, dtype=torch.float32).to(self.stats.device)
