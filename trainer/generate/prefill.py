"""The step's prompts as one packed batch through the trainer's varlen attention kernel.

A step that admits several prompts (each a run of tokens from position 0; the scheduler appends
them after the decoding tokens, so they lie contiguous at the row's end) attends all of them in
one call of ``trainer.kernels.attention.flash_varlen_attention`` per layer (the kernel the trainer
trains with: causal within each prompt, the layer's window and sinks), where it would otherwise
run one attention call per prompt per layer. ``trainer.generate.attention`` builds the batch with
the step (``StepState.prefill``) and calls ``attend_prefill`` before its per-group paths.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from trainer.generate.transfer import to_device


@dataclass(frozen=True)
class Prefill:
    """The step's prompts (each a run of tokens from position 0, contiguous at the row's end) as one
    packed varlen batch: rows ``[start, start + cu_seqlens[-1])`` of the row."""

    start: int
    tokens: int
    cu_seqlens: torch.Tensor
    """int32 [P + 1] the prompts' offsets from ``start``."""
    max_seqlen: int
    groups: frozenset[int]
    """The indices in ``StepState.groups`` of the prompts of several tokens it holds."""


def plan_prefill(segments: list[tuple[int, int, int]], has_singles: bool, device: torch.device) -> Prefill | None:
    """The step's prompts as one varlen batch, when two or more have several tokens and every
    segment from the first of them on starts at position 0 (the scheduler appends prompts after
    the decoding tokens). A one-token prompt among them is a sample of one token in the batch (its
    row is also the singles group's, which writes the same output again)."""
    first = next((i for i, (_, _, count) in enumerate(segments) if count > 1), len(segments))
    tail = [count for _, _, count in segments[first:]]
    if sum(count > 1 for count in tail) < 2 or any(start for _, start, _ in segments[first:]):
        return None
    start = sum(count for _, _, count in segments[:first])
    offsets = [0]
    for count in tail:
        offsets.append(offsets[-1] + count)
    group0 = 1 if has_singles else 0
    groups = range(group0, group0 + sum(count > 1 for count in tail))
    return Prefill(start, offsets[-1], to_device(offsets, torch.int32, device), max(tail),
                   frozenset(groups))


def attend_prefill(prefill: Prefill | None, cache_dtype: torch.dtype, query_THD: torch.Tensor,
                   key_THD: torch.Tensor, value_THD: torch.Tensor, out_THD: torch.Tensor, scale: float,
                   window: int | None, sinks: torch.Tensor | None, softcap: float | None) -> frozenset[int]:
    """The step's prompts in one call of the trainer's varlen kernel (``trainer.kernels.attention``),
    each over its own keys (the step's: a prompt starts at position 0), with the layer's window
    and sinks; the groups it attended (none when there is no such batch, or the layer or the
    tensors need what the kernel lacks: soft-capping, a dtype other than the cache's, a head dim, or
    fp32 on CUDA, where its dots run in tf32; the decode kernel and SDPA keep fp32 exact there)."""
    from trainer.kernels import attention as varlen

    if prefill is None or softcap is not None or query_THD.dtype != cache_dtype:
        return frozenset()
    if query_THD.dtype == torch.float32 and query_THD.device.type == "cuda":
        return frozenset()  # the kernel's fp32 dots are tf32 on CUDA: fp32 prompts keep their fp32 paths
    if varlen_reason(query_THD.device, query_THD.shape[-1]) is not None:
        return frozenset()
    rows = slice(prefill.start, prefill.start + prefill.tokens)
    out_THD[rows] = varlen.flash_varlen_attention(
        query_THD[rows], key_THD[rows].to(query_THD.dtype), value_THD[rows].to(query_THD.dtype),
        prefill.cu_seqlens, prefill.max_seqlen, causal=True, window=(window - 1, 0) if window else None,
        sinks=sinks, softmax_scale=scale)
    return prefill.groups


def varlen_reason(device: torch.device, head_dim: int) -> str | None:
    """Why the trainer's varlen kernel cannot attend prompts here, or None (on the CPU only under
    Triton's interpreter, as ``decode_attention.supported`` allows, for the tests)."""
    from trainer.kernels import attention as varlen

    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
        return None if head_dim in varlen.SUPPORTED_HEAD_DIMS else f"head dim {head_dim}"
    return varlen.supported(device, head_dim)
