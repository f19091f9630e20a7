"""From one step's logits to tokens: temperature, top-k, top-p, seeded draws, logprobs.

Every row is one sequence with its own parameters (a batch mixes greedy and sampled requests).
Order, as transformers' ``generate`` and vLLM: temperature scales the logits, top-k keeps the
``k`` largest, top-p keeps the smallest set of the most likely tokens whose probability reaches
``p`` (the most likely token always stays). A sampled row draws with the exponential race
(``argmax(p / E)``, ``E ~ Exp(1)`` from its own ``torch.Generator``: the same categorical draw as
``multinomial``, and always ``V`` numbers per token, so a seeded sequence's draws never depend on
the other rows); a greedy row takes the argmax of its raw logits.

Logprobs are of the raw model distribution (``log_softmax`` of the logits in fp32, before
temperature, top-k and top-p), as OpenAI's API and vLLM (``logprobs_mode="raw_logprobs"``, its
default) return them: a sampled token's logprob is not the probability it was drawn with.

Shapes (legend): ``R`` rows (sequences sampled this step), ``V`` vocabulary, ``K`` top logprobs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trainer.generate.params import SamplingParams
from trainer.generate.transfer import to_device


@dataclass(frozen=True)
class RowParams:
    """The step's per-row sampling parameters as device tensors (built once per step)."""

    temperature_R1: torch.Tensor
    """Greedy rows hold 1 (their logits are not scaled)."""
    top_k_R1: torch.Tensor
    """``V`` where top-k is off."""
    top_p_R1: torch.Tensor
    greedy: list[bool]
    filtered: bool
    """Whether any row restricts its support (top-k or top-p): the sort is skipped otherwise."""

    @classmethod
    def of(cls, params: list[SamplingParams], vocab: int, device: torch.device) -> RowParams:
        greedy = [p.greedy for p in params]
        values = to_device(
            [[1.0 if g else p.temperature, float(p.top_k or vocab), p.top_p] for p, g in zip(params, greedy)],
            torch.float32, device,
        )
        filtered = any(not g and (p.top_k or p.top_p < 1) for p, g in zip(params, greedy))
        return cls(values[:, 0:1], values[:, 1:2].long(), values[:, 2:3], greedy, filtered)


def processed_logits(logits_RV: torch.Tensor, rows: RowParams) -> torch.Tensor:
    """The logits sampling draws from, fp32 [R, V]: scaled by temperature, ``-inf`` outside each
    row's top-k and top-p."""
    logits_RV = logits_RV.float() / rows.temperature_R1
    if not rows.filtered:
        return logits_RV
    sorted_RV, order_RV = logits_RV.sort(dim=-1, descending=True)
    rank_V = torch.arange(logits_RV.shape[-1], device=logits_RV.device)
    drop_RV = rank_V >= rows.top_k_R1
    sorted_RV = sorted_RV.masked_fill(drop_RV, float("-inf"))
    probs_RV = torch.softmax(sorted_RV, dim=-1)
    before_RV = probs_RV.cumsum(dim=-1) - probs_RV  # probability of the more likely tokens
    drop_RV |= before_RV >= rows.top_p_R1
    drop_RV[:, 0] = False
    return logits_RV.scatter(-1, order_RV, sorted_RV.masked_fill(drop_RV, float("-inf")))


def choose(logits_RV: torch.Tensor, rows: RowParams, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row [R] (long): the argmax for greedy rows, a seeded draw for the others."""
    tokens_R = logits_RV.argmax(dim=-1)
    sampled = [i for i, g in enumerate(rows.greedy) if not g]
    if not sampled:
        return tokens_R
    probs_RV = torch.softmax(processed_logits(logits_RV, rows), dim=-1)
    noise_RV = torch.ones_like(probs_RV)
    for i in sampled:
        noise_RV[i].exponential_(generator=generators[i])
    noise_RV.clamp_min_(torch.finfo(noise_RV.dtype).tiny)  # a zero draw would divide 0 by 0
    drawn_R = (probs_RV / noise_RV).argmax(dim=-1)
    index_R = to_device(sampled, torch.long, logits_RV.device)
    return tokens_R.index_copy(0, index_R, drawn_R.index_select(0, index_R))


def token_logprobs(logits_RV: torch.Tensor, tokens_R: torch.Tensor, top: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Raw-distribution log-probabilities: the chosen tokens' [R], and the ``top`` most likely
    tokens' values and ids [R, K] (K = ``top``; empty when 0)."""
    logprobs_RV = torch.log_softmax(logits_RV.float(), dim=-1)
    chosen_R = logprobs_RV.gather(-1, tokens_R.unsqueeze(-1)).squeeze(-1)
    top_vals, top_ids = logprobs_RV.topk(top, dim=-1) if top else (logprobs_RV[:, :0], tokens_R[:, None][:, :0])
    return chosen_R, top_vals, top_ids


def generator_for(seed: int, device: torch.device) -> torch.Generator:
    """A generator on ``device`` seeded with ``seed``."""
    return torch.Generator(device=device).manual_seed(seed)
