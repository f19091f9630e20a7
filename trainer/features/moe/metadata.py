"""The routing of one MoE layer: its token->expert assignments grouped by expert with one stable
argsort, as a frozen ``RoutingMetadata`` built at dispatch and consumed at combine (and by the
Triton kernels of ``trainer.kernels.moe``).

Shape legend (as in ``trainer.features.moe.routing``): T tokens, K experts per token, S = T*K
routed slots, E experts.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch


@dataclass(frozen=True, eq=False)
class RoutingMetadata:
    """Where every routed slot goes, built once at dispatch and consumed at combine.

    Build with ``build_routing``; the tensors are shared by the layer's forward and backward.
    """

    sort_idx_S: torch.Tensor
    """Flat slot ids ``t*K + j`` in expert-grouped order (stable: tokens ascending per expert)."""
    inverse_S: torch.Tensor
    """Inverse of ``sort_idx_S``: the grouped row of each flat slot."""
    token_S: torch.Tensor
    """Token of each grouped row (``sort_idx_S // K``)."""
    expert_S: torch.Tensor
    """Expert of each grouped row (sorted ascending)."""
    slot_expert_S: torch.Tensor
    """Expert of each flat slot ``t*K + j`` (the assignments, flattened; the combine's bias rows)."""
    counts_E: torch.Tensor
    """Rows per expert, int32, on the device."""
    offsets_E: torch.Tensor
    """End row of each expert's group (inclusive cumsum of ``counts_E``), int32: grouped_mm's ``offs``."""
    num_tokens: int
    top_k: int
    host_offsets: tuple[int, ...] | None = None
    """``offsets_E`` on the host, only for the loop fallback (its one host sync); None on the grouped path."""

    @property
    def num_slots(self) -> int:
        return self.num_tokens * self.top_k

    def groups(self) -> Iterator[tuple[int, int, int]]:
        """``(expert, start, end)`` of every non-empty group (loop fallback only)."""
        assert self.host_offsets is not None, "groups() needs host_offsets: build with host_offsets=True"
        start = 0
        for expert, end in enumerate(self.host_offsets):
            if end > start:
                yield expert, start, end
            start = end


def build_routing(top_k_index_TK: torch.Tensor, num_experts: int, *, host_offsets: bool = False) -> RoutingMetadata:
    """Group the ``[T, K]`` token->expert assignments by expert (module docstring: the algorithm).

    Args:
        top_k_index_TK: expert ids, integer ``[T, K]``; every id in ``[0, num_experts)``.
        num_experts: E.
        host_offsets: also copy the offsets to the host (one sync) for the loop fallback.
    Raises:
        ValueError: ``top_k_index_TK`` is not a 2-D integer tensor.
    """
    if top_k_index_TK.dim() != 2 or top_k_index_TK.dtype.is_floating_point:
        raise ValueError(
            f"top_k_index must be an integer [tokens, top_k] tensor, got {top_k_index_TK.dtype} {tuple(top_k_index_TK.shape)}"
        )
    num_tokens, top_k = top_k_index_TK.shape
    flat_S = top_k_index_TK.reshape(-1)
    expert_S, sort_idx_S = torch.sort(flat_S, stable=True)
    inverse_S = torch.empty_like(sort_idx_S)
    inverse_S[sort_idx_S] = torch.arange(sort_idx_S.numel(), device=sort_idx_S.device)
    bounds_E = torch.arange(num_experts, device=flat_S.device, dtype=expert_S.dtype)
    offsets_E = torch.searchsorted(expert_S, bounds_E, right=True).to(torch.int32)
    counts_E = torch.diff(offsets_E, prepend=offsets_E.new_zeros(1))
    return RoutingMetadata(
        sort_idx_S=sort_idx_S,
        inverse_S=inverse_S,
        token_S=torch.div(sort_idx_S, top_k, rounding_mode="floor"),
        expert_S=expert_S,
        slot_expert_S=flat_S,
        counts_E=counts_E,
        offsets_E=offsets_E,
        num_tokens=num_tokens,
        top_k=top_k,
        # The loop fallback's single host sync per layer: both GEMMs and their backward reuse it.
        host_offsets=tuple(offsets_E.tolist()) if host_offsets else None,
    )
