"""The sampler: ``Engine(model, tokenizer).generate(requests) -> results``.

One ``generate`` call runs the ``trainer.generate.scheduler`` loop: each step is one forward of
the stock model (through peft when it carries adapters, unmerged, with whatever LoRA layers the
trainer installed) on ``ftq_sampler`` attention (``trainer.generate.attention``), which writes
the step's keys and values into the ``trainer.generate.cache.KVCache`` and reads each sequence's
own. Logits are computed only for the tokens that sample (``logits_to_keep``); the draws are
``trainer.generate.sampling``'s. Each step reads its tokens back to the host once (one sync per
forward, not per sequence) to decide who finishes and who is admitted.

Attention: the ``torch`` backend (the reference, the CPU path) or, on CUDA, ``triton`` (a decode
kernel reading the cache in place, SDPA for prompts); ``attention_backend`` or the
``FTQ_SAMPLER_ATTENTION`` environment variable picks, default ``auto`` (see
``trainer.generate.attention``).

The cache is allocated on the first call and kept for later calls of the same shape and dtype
(``release()`` frees it): no step allocates one.

Under several ranks: every rank must call ``generate`` with the same requests. The schedule is a
function of the requests and the drawn tokens only, so ranks that draw the same tokens run the
same forwards, which FSDP2 requires (each forward all-gathers every layer's shards with every
rank). Ranks may still disagree on a token (a seedless request draws its seed from each rank's
own generator; reductions may differ between ranks); pass ``agree`` (e.g. a broadcast from rank
0, ``trainer.parallel.distributed.Comm.broadcast_from_first``) and every step's tokens are rank
0's, so all ranks finish together. Under DDP the forward exchanges nothing; ``agree`` still
keeps the ranks' outputs equal.
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
from trainer.generate.cache import KVCache
from trainer.generate.params import Request, Result, SamplingParams, TokenLogprob
from trainer.generate.sampling import RowParams, choose, generator_for, token_logprobs
from trainer.generate.scheduler import Scheduler, StepPlan
from trainer.generate.stopping import Stopper, eos_ids

BACKEND_ENV = "FTQ_SAMPLER_ATTENTION"
"""Names the sampler's attention backend where ``Engine`` is given none (``torch`` forces the reference)."""


@dataclass
class EngineStats:
    """What the engine has run since it was made (tests and logs)."""

    forwards: int = 0
    forward_tokens: int = 0
    """Tokens fed through the model (prompts once, then one per decoding sequence and step)."""
    caches_allocated: int = 0


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
        attention_backend: ``auto``, ``torch`` or ``triton`` (``trainer.generate.attention``'s
            ``BACKENDS``); default the ``FTQ_SAMPLER_ATTENTION`` environment variable, else ``auto``
            (``triton`` on CUDA where Triton imports, else ``torch``). ``self.backend`` is the choice.

    Raises:
        ValueError: a size below its least, or a backend that is unknown or cannot run here.
    """

    def __init__(self, model: torch.nn.Module, tokenizer: Any = None, *, slots: int = 8, max_len: int = 2048,
                 max_batch_tokens: int = 4096, device: torch.device | None = None,
                 cache_dtype: torch.dtype | None = None,
                 agree: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 attention_backend: str | None = None) -> None:
        if slots < 1 or max_len < 2 or max_batch_tokens < 1:
            raise ValueError(
                f"slots (>= 1), max_len (>= 2) and max_batch_tokens (>= 1): got {slots}, {max_len}, {max_batch_tokens}"
            )
        self.model, self.tokenizer = model, tokenizer
        self.slots, self.max_len, self.max_batch_tokens = slots, max_len, max_batch_tokens
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

    def generate(self, requests: Seq[Request]) -> list[Result]:
        """Complete every request; results in request order.

        Raises:
            ValueError: a prompt does not fit ``max_len``, a request asks for stop strings without a
                tokenizer, or the model is one the sampler cannot run.
        """
        scheduler = self.scheduler(requests)
        with self.running() as step:
            while scheduler.busy:
                step(scheduler)
        return scheduler.results()

    def scheduler(self, requests: Seq[Request] = ()) -> Scheduler:
        """A scheduler of this engine's shape (``generate``'s; ``trainer.generate.serve`` adds to it)."""
        return Scheduler(requests, self.slots, self.max_len, self.max_batch_tokens, self._stopper,
                         lambda seed: generator_for(seed, self.device), _draw_seed)

    @contextmanager
    def running(self) -> Iterator[Callable[[Scheduler], None]]:
        """The model switched to the sampler's attention, in eval mode, without autograd, and the
        cache allocated, for the block; yields ``step(scheduler)``, which runs one forward of the
        scheduler's next plan and advances it. Each step with a sequence that names an adapter runs
        the per-token adapter path (see ``_forward``)."""
        with sampler_attention(self.model), torch.no_grad(), _evaluating(self.model):
            cache = self._allocate()
            yield lambda scheduler: self._step(scheduler, cache)

    def release(self) -> None:
        """Free the cache (the next ``generate`` allocates it again)."""
        self.cache = None

    def _stopper(self, params: SamplingParams, prompt_length: int) -> Stopper:
        return Stopper(params, self.eos, self.tokenizer, self.max_len - prompt_length)

    def _allocate(self) -> KVCache:
        dtype = self._cache_dtype
        if dtype is None:
            autocast = torch.is_autocast_enabled(self.device.type)
            dtype = torch.get_autocast_dtype(self.device.type) if autocast else self._embed_dtype
        cache = self.cache
        if cache is None or cache.keys_SHLD[0].dtype != dtype:
            self.cache = cache = KVCache.for_model(self.config, self.slots, self.max_len, dtype, self.device)
            self.stats.caches_allocated += 1
        return cache

    def _step(self, scheduler: Scheduler, cache: KVCache) -> None:
        plan = scheduler.plan()
        if not plan.sampled:
            return
        active = _active_adapter(self.model) if any(a is not None for a in plan.adapters) else None
        state = StepState.build(cache, plan.segments, self.device, self.backend)
        logits_RV = self._forward(plan, state, active)
        self.stats.forwards += 1
        self.stats.forward_tokens += len(plan.input_ids)
        for source, targets, length in plan.forks:
            cache.copy_prefix(source, targets, length)
        if plan.pick != list(range(len(plan.keep))):
            logits_RV = logits_RV.index_select(0, torch.tensor(plan.pick, device=logits_RV.device))
        scheduler.advance(plan, *self._draw(plan, logits_RV))

    def _forward(self, plan: StepPlan, state: StepState, active: str | None) -> torch.Tensor:
        """The logits of the row's kept tokens [K, V].

        With ``active`` (some request names an adapter) the tokens go in as a batch of one-token
        rows, each with its adapter: peft's ``adapter_names`` splits a batch by its first
        dimension (the trainer's fused LoRA layers hand such calls to peft's forward), and
        ``logits_to_keep`` cannot pick rows across the batch, so every token's logits are computed.
        """
        input_ids = torch.tensor(plan.input_ids, dtype=torch.long).to(self.device)
        keep = torch.tensor(plan.keep, dtype=torch.long).to(self.device)
        if active is None:
            out = self.model(input_ids=input_ids.unsqueeze(0), position_ids=state.position_T.unsqueeze(0),
                             use_cache=False, logits_to_keep=keep, sampler_state=state)
            return out.logits[0]
        names = [name if name is not None else active
                 for name, (_, _, count) in zip(plan.adapters, plan.segments) for _ in range(count)]
        out = self.model(input_ids=input_ids.unsqueeze(1), position_ids=state.position_T.unsqueeze(1),
                         use_cache=False, sampler_state=state, adapter_names=names)
        return out.logits[:, -1].index_select(0, keep)

    def _draw(self, plan: StepPlan, logits_RV: torch.Tensor) -> tuple[list[int], list[TokenLogprob | None]]:
        """The step's tokens and (where asked) their logprobs, read back to the host together."""
        params = [seq.params for seq in plan.sampled]
        rows = RowParams.of(params, logits_RV.shape[-1], logits_RV.device)
        tokens_R = choose(logits_RV, rows, [seq.generator for seq in plan.sampled])
        if self.agree is not None:
            tokens_R = self.agree(tokens_R)
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


def _active_adapter(model: torch.nn.Module) -> str:
    """The adapter a request without one runs with, in a call where others name theirs.

    Raises:
        ValueError: ``model`` is no peft model, or has several adapters active at once.
    """
    active = getattr(model, "active_adapter", None) if hasattr(model, "peft_config") else None
    if not isinstance(active, str):
        raise ValueError(
            f"requests name adapters, but {type(model).__name__} "
            + ("has several active adapters" if active else "carries no peft adapters")
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
