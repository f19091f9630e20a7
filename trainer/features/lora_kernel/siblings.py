"""One matmul for the LoRA ``A`` of layers that read the same input (serving).

Why: unmerged LoRA costs two small matmuls per adapted projection on top of the base one; at
decode batch sizes each is a launch-bound kernel (cuBLAS adds a split-K reduce to the thin
``x @ A^T``). An attention's q, k and v projections read one tensor, as do an MLP's gate and up
projections, so their ``x @ A^T`` can be one matmul against the ``A``\\ s stacked (``[r_q + r_k +
r_v, in]``): on a Llama decoder layer 5 matmuls (and reduces) instead of 7 for the ``A`` side.

How: ``group_siblings(model)`` finds, in each module, the fused LoRA layers named in ``SIBLINGS``
(all present, the same input width) and gives them one ``SiblingGroup``. The first sibling called
with an input computes the stacked product and keeps it with the input; each later sibling called
with the very same tensor object (``is``: the HF attention and MLP forwards pass one
``hidden_states`` to each) takes its columns; once every sibling has taken its part the group
drops the input. Anything else (another input, a sibling called twice, another adapter, grad
enabled) computes its own product as before. Only where nothing trains: under ``torch.no_grad``
and with the adapter copies kept (``AdapterCache.keep``), which ``trainer.generate.kernels``
installs for a served model; training never reaches it.

Numerics: each column of the stacked product is a dot product of the same row and the same
``A`` row, in the same dtype, as the separate matmul's; a GEMM may tile the two shapes
differently, so the bits may differ within the dtype's rounding (as between batch sizes).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
"""Names of LoRA layers of one module that read the same input in the HF forwards."""


class SiblingGroup:
    """The fused LoRA layers of one module that read one input (see the module docstring)."""

    def __init__(self, layers: list[nn.Module]) -> None:
        self.layers = layers
        self.index = {id(layer): i for i, layer in enumerate(layers)}
        self._input: torch.Tensor | None = None
        self._parts: list[torch.Tensor] = []
        self._taken: set[int] = set()
        self._stacked: dict[tuple[Any, ...], tuple[torch.Tensor, list[int], tuple[int, ...]]] = {}

    def down(self, layer: nn.Module, x: torch.Tensor, x2: torch.Tensor, adapters: list[torch.Tensor]) -> torch.Tensor:
        """``x2 @ A^T`` of ``layer`` ([tokens, r]), from the group's stacked matmul over ``x``.

        Args:
            x: the tensor the layer was called with (its identity marks the shared input).
            x2: ``x`` as the ``[tokens, in]`` matrix in the compute dtype.
            adapters: every sibling's ``A`` in the compute dtype, in ``self.layers`` order.
        """
        i = self.index[id(layer)]
        if self._input is not x or i in self._taken:
            stacked, ranks = self._stack(adapters)
            self._parts = list((x2 @ stacked.t()).split(ranks, dim=1))
            self._input, self._taken = x, set()
        self._taken.add(i)
        part = self._parts[i]
        if len(self._taken) == len(self.layers):
            self._input, self._parts = None, []
        return part

    def _stack(self, adapters: list[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
        """The siblings' ``A`` stacked, kept per adapter (a CUDA graph captured over one reads it where
        it is) and refreshed in place when a copy changed in place (``AdapterCache`` does so)."""
        key = tuple((a.data_ptr(), a.dtype) for a in adapters)
        versions = tuple(a._version for a in adapters)
        entry = self._stacked.get(key)
        if entry is None:
            entry = self._stacked[key] = (torch.cat(adapters, dim=0), [a.shape[0] for a in adapters], versions)
        elif entry[2] != versions:
            torch.cat(adapters, dim=0, out=entry[0])
            entry = self._stacked[key] = (entry[0], entry[1], versions)
        return entry[0], entry[1]


def group_siblings(model: nn.Module, layers: list[nn.Module]) -> int:
    """Give the fused LoRA ``layers`` of ``model`` that read one input their ``SiblingGroup``
    (``layer._ftq_siblings``); the number of groups made."""
    fused = {id(layer) for layer in layers}
    groups = 0
    for module in model.modules():
        for names in SIBLINGS:
            members = [getattr(module, name, None) for name in names]
            if not all(m is not None and id(m) in fused for m in members):
                continue
            if len({m.get_base_layer().in_features for m in members}) != 1:
                continue
            group = SiblingGroup(members)
            for member in members:
                member._ftq_siblings = group
            groups += 1
    return groups


def ungroup(layers: list[nn.Module]) -> None:
    for layer in layers:
        layer.__dict__.pop("_ftq_siblings", None)


SERVE_UPDATE_FIRST = True
"""Served layers (``serve_forward``) write the update first and accumulate the base matmul onto it
(``base_plus_update``'s ``update_first``); ``python -m bench.sampler --update-last`` measures the
other order."""


def base_plus_update(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype,
                     xa: torch.Tensor, sb: torch.Tensor, update_first: bool = False) -> torch.Tensor:
    """``x2 @ W^T (+ b) + xa @ sB^T`` in ``dtype`` ([tokens, out]); the fused LoRA layer's forward
    and ``serve_forward``.

    Default (training): the update is added in place into the base matmul's output (one
    ``addmm_``, which reads and writes the whole output once more). ``update_first``: the update
    (and bias) is written first and the base matmul accumulates onto it (``beta=1``: its epilogue
    reads the output instead of a separate kernel reading and writing it), one output pass fewer.
    Both round once more than the exact sum, at another point: bf16 outputs differ by an ulp."""
    w = weight.to(dtype)
    if update_first:
        out = xa @ sb.t() if bias is None else torch.addmm(bias.to(dtype), xa, sb.t())
        return out.addmm_(x2, w.t())
    out = x2 @ w.t() if bias is None else torch.addmm(bias.to(dtype), x2, w.t())
    return out.addmm_(xa, sb.t())


def serve_forward(layer: nn.Module, group: SiblingGroup | None, x: torch.Tensor, name: str, dtype: torch.dtype,
                  a: torch.Tensor, sb: torch.Tensor) -> torch.Tensor | None:
    """``layer``'s output without autograd (a served model): its ``x @ A^T`` from ``group`` when it
    has one, else its own; the update written first (``SERVE_UPDATE_FIRST``). None when a sibling
    lacks adapter ``name`` (the caller's own path then runs)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1]).to(dtype)
    if group is None:
        xa = x2 @ a.t()
    else:
        cache = layer._ftq_adapter_cache
        adapters = []
        for member in group.layers:
            if name not in member.lora_A or "_ftq_adapter_cache" not in vars(member):
                return None
            member_a, _ = cache.get(member, member.lora_A[name].weight, member.lora_B[name].weight,
                                    float(member.scaling[name]), dtype)
            adapters.append(member_a)
        xa = group.down(layer, x, x2, adapters)
    base = layer.get_base_layer()
    out = base_plus_update(x2, base.weight, base.bias, dtype, xa, sb, update_first=SERVE_UPDATE_FIRST)
    return out.view(*shape[:-1], out.shape[-1])
