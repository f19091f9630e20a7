"""The sampler: ``Engine(model, tokenizer).generate(requests) -> results``.

One ``generate`` call runs the ``trainer.generate.scheduler`` loop: each step is one forward of
the stock model (through peft when it carries adapters, unmerged, with whatever LoRA layers the
trainer installed) on ``ftq_sampler`` attention (``trainer.generate.attention``), which writes
the step's keys and values into the ``trainer.generate.cache.KVCache`` and reads each sequence's
own. Logits are computed only for the tokens that sample (``logits_to_keep``); the draws are
``trainer.generate.sampling``'s. Each step reads its tokens back to the host once (one sync per
forward, not per sequence) to decide who finishes and who is admitted; with ``overlap`` (on with
CUDA graphs) a decode step's tokens are read while the next step's forward, already fed them on
the device, runs (``trainer.generate.overlap``).

Attention: the ``torch`` backend (the reference, the CPU path) or, on CUDA, ``triton`` (a decode
kernel reading the cache in place, SDPA for prompts); ``attention_backend`` or the
``FTQ_SAMPLER_ATTENTION`` environment variable picks, default ``auto`` (see
``trainer.generate.attention``). With ``cuda_graphs`` a decode-only step replays a CUDA graph
captured per batch-size bucket (``DecodeGraphs``); other steps run eagerly.

The cache is allocated on the first call and kept for later calls of the same shape and dtype
(``release()`` frees it): no step allocates one. With ``shared_prompts`` it has a prompt store
that the ``n`` choices of a prompt read in place (``trainer.generate.cache``); the results are the
unshared layout's, and a slot holds only generated tokens, so more sequences fit in one cache.

Under several ranks: every rank must call ``generate`` with the same requests. The schedule is a
function of the requests and the drawn tokens only, so ranks that draw the same tokens run the
same forwards, which FSDP2 requires (each forward all-gathers every layer's shards with every
rank). Ranks may still disagree on a token (a seedless request draws its seed from each rank's
own generator; reductions may differ between ranks); pass ``agree`` (e.g. a broadcast from rank
0, ``trainer.parallel.distributed.Comm.broadcast_from_first``) and every step's tokens are rank
0's, so all ranks finish together. Under DDP the forward exchanges nothing; ``agree`` still
keeps the ranks' outputs equal. Ranks that complete different requests (GRPO's rollouts, each
rank its own prompts) pass ``lockstep`` instead: a rank done early runs idle forwards until the
last rank is done, one "anyone still busy?" collective a step.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence as Seq
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from trainer.features.attention.packed import unwrap_model
from trainer.generate.attention import StepState, choose_backend, sampler_attention
from trainer.generate.cache import KVCache, SharedPrompts
from trainer.generate.graphs import DecodeGraphs
from trainer.generate.overlap import Ahead, admits_nothing, follow, may_defer
from trainer.generate.params import Request, Result, SamplingParams, TokenLogprob
from trainer.generate.sampling import RowParams, choose, generator_for, token_logprobs
from trainer.generate.scheduler import Scheduler, StepPlan
from trainer.generate.stopping import Stopper, eos_ids
from trainer.generate.transfer import to_device

BACKEND_ENV = "FTQ_SAMPLER_ATTENTION"
"""Names the sampler's attention backend where ``Engine`` is given none (``torch`` forces the reference)."""


@dataclass
class EngineStats:
    """What the engine has run since it was made (tests and logs)."""

    forwards: int = 0
    graph_replays: int = 0
    """Forwards run by replaying a captured CUDA graph (``cuda_graphs``)."""
    forward_tokens: int = 0
    """Tokens fed through the model (prompts once, then one per decoding sequence and step)."""
    caches_allocated: int = 0
    idle_forwards: int = 0
    """Forwards run only to keep step with other ranks (``generate``'s ``lockstep``)."""
    overlapped_steps: int = 0
    """Forwards queued before the previous step's tokens were read (``overlap``)."""


class Engine:
    """Generation with a KV cache and continuous batching over one model.

    Args:
        model: a transformers causal LM, or a peft model around one (its adapters applied unmerged).
        tokenizer: for stop strings and completion text (optional: ids in, ids out without it).
        slots: sequences decoded together (the cache's first dimension).
        max_len: positions per slot: prompt plus generated tokens at most.
        max_batch_tokens: tokens per forward a step admits new prompts up to (one prompt may exceed it).
        device: where the inputs go; the input embeddings' device by default.
        cache_dtype: of the cached keys and values; default autocast's dtype when it is on around
            ``generate``, else the input embeddings' dtype (a call in another dtype reallocates).
        agree: ``tokens -> tokens`` applied to each step's drawn tokens (see the module docstring).
        forward: what a step calls with the model's keyword arguments, default ``model`` itself
            (under FSDP2, ``trainer.parallel.strategy.Parallel.model_forward``: through the root unit).
        attention_backend: ``auto``, ``torch`` or ``triton`` (``trainer.generate.attention``'s
            ``BACKENDS``); default the ``FTQ_SAMPLER_ATTENTION`` environment variable, else ``auto``
            (``triton`` on CUDA where Triton imports, else ``torch``). ``self.backend`` is the choice.
        cuda_graphs: replay a captured CUDA graph for each decode-only step (every sequence of the
            step decoding one token, no adapter named, no fork): one graph per batch-size bucket
            (``trainer.generate.graphs.GRAPH_BUCKETS`` up to ``slots``), the step padded to its bucket (``DecodeGraphs``).
            Needs the ``triton`` backend; the cache gets one scratch slot for the padding. One
            process only: under FSDP2 the forward's all-gathers are not captured. ``"auto"``: on
            when the backend is ``triton`` (CUDA), off otherwise (batch generation jobs, whose ranks
            share nothing in a forward).
        shared_prompts: the shared-prompt cache layout (``trainer.generate.cache.SharedPrompts``):
            every prompt is prefilled into a prompt slot that the ``n`` choices admitted with it all
            read (none copies it), and a slot holds only its sequence's generated tokens, at most
            ``new_len`` (a completion also ends, ``length``, at ``new_len`` tokens). None (default):
            each slot holds its whole sequence, ``max_len`` positions. GRPO's rollouts use it
            (``trainer.objectives.grpo_slots.rollout_slots`` sizes both stores).
        overlap: queue each decode step's forward before the previous step's tokens are read back,
            feeding them on the device (``trainer.generate.overlap``: the host's work a step hides
            behind the GPU's; a token reaches the host one step later). ``"auto"`` (default): on
            with CUDA graphs. Never under ``agree`` or ``generate``'s ``lockstep``.

    Raises:
        ValueError: a size below its least, or a backend that is unknown or cannot run here.
    """

    def __init__(self, model: torch.nn.Module, tokenizer: Any = None, *, slots: int = 8, max_len: int = 2048,
                 max_batch_tokens: int = 4096, device: torch.device | None = None,
                 cache_dtype: torch.dtype | None = None,
                 agree: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 forward: Callable[..., Any] | None = None, attention_backend: str | None = None,
                 cuda_graphs: bool | str = False, shared_prompts: SharedPrompts | None = None,
                 overlap: bool | str = "auto") -> None:
        if slots < 1 or max_len < 2 or max_batch_tokens < 1:
            raise ValueError(
                f"slots (>= 1), max_len (>= 2) and max_batch_tokens (>= 1): got {slots}, {max_len}, {max_batch_tokens}"
            )
        self.model, self.tokenizer = model, tokenizer
        self._call = forward if forward is not None else model
        self.slots, self.max_len, self.max_batch_tokens = slots, max_len, max_batch_tokens
        self.shared_prompts = shared_prompts
        lm = unwrap_model(model)
        embed = lm.get_input_embeddings().weight
        self.device = torch.device(device) if device is not None else embed.device
        self._embed_dtype, self._cache_dtype = embed.dtype, cache_dtype
        self.config, self.agree = lm.config, agree
        self.eos = eos_ids(tokenizer, getattr(lm, "generation_config", None))
        self.cache: KVCache | None = None
        self.stats = EngineStats()
        requested = attention_backend or os.environ.get(BACKEND_ENV) or "auto"
        self.backend = choose_backend(requested, self.device)
        if cuda_graphs == "auto":
            cuda_graphs = self.backend == "triton"
        if cuda_graphs and self.backend != "triton":
            raise ValueError(f"cuda_graphs needs the triton attention backend on CUDA (got {self.backend} on "
                             f"{self.device}); pass cuda_graphs=False")
        self.graphs: DecodeGraphs | None = DecodeGraphs(slots, shared_prompts is not None) if cuda_graphs else None
        self.overlap = (self.graphs is not None) if overlap == "auto" else bool(overlap)
        self._overlapping = False
        self._ahead: tuple[Scheduler, Ahead] | None = None

    def generate(self, requests: Seq[Request], lockstep: Callable[[bool], bool] | None = None) -> list[Result]:
        """Complete every request; results in request order.

        Args:
            lockstep: ``busy -> any rank busy`` (``Comm.any_rank``): each rank completes its own
                requests, and a rank that is done keeps running a one-token idle forward
                (``_idle``) until every rank is, so all ranks run the same number of forwards, as
                FSDP2's gathers need. One small host collective per step.

        Raises:
            ValueError: a prompt does not fit ``max_len``, a request asks for stop strings without a
                tokenizer, or the model is one the sampler cannot run.
        """
        scheduler = self.scheduler(requests)
        with self.running(overlap=lockstep is None) as step:
            if lockstep is None:
                while scheduler.busy:
                    step(scheduler)
            else:
                while lockstep(scheduler.busy):
                    if scheduler.busy:
                        step(scheduler)
                    else:
                        self._idle()
        return scheduler.results()

    def scheduler(self, requests: Seq[Request] = ()) -> Scheduler:
        """A scheduler of this engine's shape (``generate``'s; ``trainer.generate.serve`` adds to it)."""
        shared = self.shared_prompts
        return Scheduler(requests, self.slots, self.max_len, self.max_batch_tokens, self._stopper,
                         lambda seed: generator_for(seed, self.device), _draw_seed,
                         shared.slots if shared else 0, shared.prompt_len if shared else 0)

    @contextmanager
    def running(self, overlap: bool = True) -> Iterator[Callable[[Scheduler], None]]:
        """The model switched to the sampler's attention, in eval mode, without autograd, and the
        cache allocated, for the block; yields ``step(scheduler)``, which runs one forward of the
        scheduler's next plan and advances it. Each step with a sequence that names an adapter other
        than the active one runs the per-token adapter path (see ``_forward``, ``_mixed_adapters``).

        With the engine's ``overlap`` (and ``overlap`` here; never with ``agree``) a decode step may
        leave its tokens on the device: the next ``step`` call queues the following forward first,
        then applies them (``trainer.generate.overlap``); the block's end applies what is pending."""
        with sampler_attention(self.model), torch.no_grad(), _evaluating(self.model):
            cache = self._allocate()
            self._overlapping = self.overlap and overlap and self.agree is None
            try:
                yield lambda scheduler: self._step(scheduler, cache)
                if self._ahead is not None:
                    scheduler, ahead = self._ahead
                    ahead.apply(scheduler)
            finally:
                self._ahead, self._overlapping = None, False

    def release(self) -> None:
        """Free the cache (the next ``generate`` allocates it again)."""
        self.cache = None

    def _stopper(self, params: SamplingParams, prompt_length: int) -> Stopper:
        room = self.max_len - prompt_length
        if self.shared_prompts is not None:
            room = min(room, self.shared_prompts.new_len)
        return Stopper(params, self.eos, self.tokenizer, room)

    def _allocate(self) -> KVCache:
        dtype = self._cache_dtype
        if dtype is None:
            autocast = torch.is_autocast_enabled(self.device.type)
            dtype = torch.get_autocast_dtype(self.device.type) if autocast else self._embed_dtype
        cache = self.cache
        if cache is None or cache.keys_SHLD[0].dtype != dtype:
            slots = self.slots + (self.graphs is not None)
            shared = self.shared_prompts
            length = shared.new_len if shared is not None else self.max_len
            self.cache = cache = KVCache.for_model(self.config, slots, length, dtype, self.device, shared)
            self.stats.caches_allocated += 1
            if self.graphs is not None:
                self.graphs.reset()
        return cache

    def _step(self, scheduler: Scheduler, cache: KVCache) -> None:
        if self._ahead is not None:
            (owner, ahead), self._ahead = self._ahead, None
            if admits_nothing(scheduler) and owner is scheduler:
                self._ahead = self._launch(scheduler, ahead, cache)
            ahead.apply(owner)
            return
        plan = scheduler.plan()
        if not plan.sampled:
            return
        active = _mixed_adapters(self.model, plan.adapters)
        logits_RV = self._logits(plan, cache, active)
        for source, targets, length in plan.forks:
            cache.copy_prefix(source, targets, length)
        if plan.pick != list(range(len(plan.keep))):
            logits_RV = logits_RV.index_select(0, to_device(plan.pick, torch.long, logits_RV.device))
        if self._overlapping and active is None and may_defer(plan, scheduler):
            self._ahead = (scheduler, Ahead.of(plan, self._choose(plan, logits_RV)))
            return
        scheduler.advance(plan, *self._draw(plan, logits_RV))

    def _launch(self, scheduler: Scheduler, ahead: Ahead, cache: KVCache) -> tuple[Scheduler, Ahead] | None:
        """Queue the forward and draws of the step after ``ahead`` (``overlap.follow``), or None."""
        followed = follow(ahead, self.device)
        if followed is None:
            return None
        plan, ids = followed
        logits_RV = self._logits(plan, cache, None, ids)
        self.stats.overlapped_steps += 1
        return scheduler, Ahead.of(plan, self._choose(plan, logits_RV))

    def _logits(self, plan: StepPlan, cache: KVCache, active: str | None,
                ids: torch.Tensor | None = None) -> torch.Tensor:
        """The step's kept logits: a graph replay where one takes the plan, else an eager forward."""
        logits_RV = None
        if self.graphs is not None and active is None and self.graphs.takes(plan):
            logits_RV = self.graphs.run(self.model, cache, plan, _current_adapter(self.model), ids)
            self.stats.graph_replays += logits_RV is not None
        if logits_RV is None:
            state = StepState.build(cache, plan.segments, self.device, self.backend, plan.prompts or None)
            logits_RV = self._forward(plan, state, active, ids)
        self.stats.forwards += 1
        self.stats.forward_tokens += len(plan.input_ids)
        return logits_RV

    def _idle(self) -> None:
        """One forward of one token at position 0 of slot 0 (free: nothing runs), its logits
        unread: a rank whose requests are done pairs the forwards of the ranks still sampling."""
        assert self.cache is not None, "_idle runs inside running(), which allocates the cache"
        plan = StepPlan(segments=[(0, 0, 1)], input_ids=[0], keep=[0], adapters=[None])
        self._forward(plan, StepState.build(self.cache, plan.segments, self.device, self.backend), None)
        self.stats.forwards += 1
        self.stats.idle_forwards += 1

    def _forward(self, plan: StepPlan, state: StepState, active: str | None,
                 ids: torch.Tensor | None = None) -> torch.Tensor:
        """The logits of the row's kept tokens [K, V].

        With ``active`` (some request names an adapter) the tokens go in as a batch of one-token
        rows, each with its adapter: peft's ``adapter_names`` splits a batch by its first
        dimension (the trainer's fused LoRA layers hand such calls to peft's forward), and
        ``logits_to_keep`` cannot pick rows across the batch, so every token's logits are computed.
        ``ids``: the row's token ids on the device, in place of ``plan.input_ids``.
        """
        input_ids = ids if ids is not None else to_device(plan.input_ids, torch.long, self.device)
        keep = to_device(plan.keep, torch.long, self.device)
        if active is None:
            out = self._call(input_ids=input_ids.unsqueeze(0), position_ids=state.position_T.unsqueeze(0),
                             use_cache=False, logits_to_keep=keep, sampler_state=state)
            return out.logits[0]
        names = [name if name is not None else active
                 for name, (_, _, count) in zip(plan.adapters, plan.segments) for _ in range(count)]
        out = self._call(input_ids=input_ids.unsqueeze(1), position_ids=state.position_T.unsqueeze(1),
                         use_cache=False, sampler_state=state, adapter_names=names)
        return out.logits[:, -1].index_select(0, keep)

    def _choose(self, plan: StepPlan, logits_RV: torch.Tensor) -> torch.Tensor:
        """The step's tokens on the device [R] (each row's draw; ``agree``'s when given)."""
        params = [seq.params for seq in plan.sampled]
        rows = RowParams.of(params, logits_RV.shape[-1], logits_RV.device)
        tokens_R = choose(logits_RV, rows, [seq.generator for seq in plan.sampled])
        return self.agree(tokens_R) if self.agree is not None else tokens_R

    def _draw(self, plan: StepPlan, logits_RV: torch.Tensor) -> tuple[list[int], list[TokenLogprob | None]]:
        """The step's tokens and (where asked) their logprobs, read back to the host together."""
        params = [seq.params for seq in plan.sampled]
        tokens_R = self._choose(plan, logits_RV)
        wanted = [p.logprobs for p in params]
        if not any(wanted):
            return tokens_R.tolist(), [None] * len(params)
        top = max(p.top_logprobs for p in params)
        chosen_R, top_vals, top_ids = token_logprobs(logits_RV, tokens_R, top)
        tokens, chosen, vals, ids = (t.tolist() for t in (tokens_R, chosen_R, top_vals, top_ids))
        logprobs = [
            TokenLogprob(t, c, tuple(zip(i[: p.top_logprobs], v[: p.top_logprobs]))) if p.logprobs else None
            for p, t, c, v, i in zip(params, tokens, chosen, vals, ids)
        ]
        return tokens, logprobs


def _mixed_adapters(model: torch.nn.Module, adapters: list[str | None]) -> str | None:
    """The active adapter when the step's sequences name adapters other than it (the per-token
    adapter path runs), else None: every sequence runs the model as it is (none named, or each
    names the active adapter, as a chat session on one tuned model does), on the plain path
    (the fused LoRA layers, CUDA graphs).

    Raises:
        ValueError: as ``_active_adapter``.
    """
    named = {name for name in adapters if name is not None}
    if not named:
        return None
    active = _active_adapter(model)
    return None if named == {active} else active


def _current_adapter(model: torch.nn.Module) -> str | None:
    """The model's one active peft adapter (a CUDA graph captured under one replays only under
    it); None without adapters or with several active. A ``PeftModel``'s ``active_adapter`` is a
    property; transformers' own peft integration (``model.add_adapter`` on a plain model) has the
    method ``active_adapters()``."""
    if not hasattr(model, "peft_config"):
        return None
    active = getattr(model, "active_adapter", None)
    if callable(active):
        try:
            names = model.active_adapters()
        except ValueError:  # transformers: "No adapter loaded"
            return None
        active = names[0] if len(names) == 1 else None
    return active if isinstance(active, str) else None


def _active_adapter(model: torch.nn.Module) -> str:
    """The adapter a request without one runs with, in a call where others name theirs.

    Raises:
        ValueError: ``model`` is no peft model, or has several adapters active at once.
    """
    active = _current_adapter(model)
    if active is None:
        raise ValueError(
            f"requests name adapters, but {type(model).__name__} "
            + ("has several active adapters" if hasattr(model, "peft_config") else "carries no peft adapters")
            + "; name one per request (BASE_ADAPTER for the base) or leave Request.adapter None"
        )
    return active


def _draw_seed() -> int:
    """A seed for a request without one, from torch's global (CPU) generator."""
    return int(torch.randint(0, 2**62, (1,)).item())


@contextmanager
def _evaluating(model: torch.nn.Module) -> Iterator[None]:
    """``model`` in eval mode (no dropout) inside the block, its mode restored after."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)
