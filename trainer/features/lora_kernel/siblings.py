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

Served models also put each group's base weights into one matrix (``fuse_weights``): the group
then runs one base matmul and one block-diagonal update for all its layers (``fused``); each base
layer's weight is a view of its rows, and a group whose weights were rebound since steps aside
(``weights_current``). An adapter changed in place reaches the kept copies, the stacked ``A`` and
the block-diagonal ``sB`` at the next forward that runs Python (a step admitting a prompt): a
CUDA graph's replay alone reads them as they are.

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
        self.weight: torch.Tensor | None = None
        """The base weights as one ``[sum out, in]`` matrix (``fuse_weights``), or None."""
        self.bias: torch.Tensor | None = None
        self.widths: list[int] = []

    def down(self, layer: nn.Module, x: torch.Tensor, x2: torch.Tensor, adapters: list[torch.Tensor]) -> torch.Tensor:
        """``x2 @ A^T`` of ``layer`` ([tokens, r]), from the group's stacked matmul over ``x``.

        Args:
            x: the tensor the layer was called with (its identity marks the shared input).
            x2: ``x`` as the ``[tokens, in]`` matrix in the compute dtype.
            adapters: every sibling's ``A`` in the compute dtype, in ``self.layers`` order.
        """
        def compute() -> list[torch.Tensor]:
            stacked, ranks = self._stack(adapters)
            return list((x2 @ stacked.t()).split(ranks, dim=1))

        return self._share(layer, x, compute)

    def fused(self, layer: nn.Module, x: torch.Tensor, dtype: torch.dtype,
              adapters: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """``layer``'s whole output from the group's one matmul over ``x`` (``fuse_weights``): the
        stacked ``x @ A^T``, one block-diagonal ``sB`` expand for every sibling's update and one
        base matmul over the concatenated weights (``base_plus_update``); ``layer``'s columns of
        it (a view: its rows are the group's output width apart). ``adapters``: each sibling's
        ``(A, sB)`` in the compute dtype, in ``self.layers`` order."""
        shape = x.shape

        def compute() -> list[torch.Tensor]:
            x2 = x.reshape(-1, shape[-1]).to(dtype)
            stacked, _ = self._stack([a for a, _ in adapters])
            expand = self._block_diagonal([sb for _, sb in adapters])
            out = base_plus_update(x2, self.weight, self.bias, dtype, x2 @ stacked.t(), expand)
            return [part.view(*shape[:-1], part.shape[-1]) for part in out.split(self.widths, dim=1)]

        return self._share(layer, x, compute)

    def _share(self, layer: nn.Module, x: torch.Tensor, compute: Any) -> torch.Tensor:
        """``layer``'s part of ``compute()``, computed by the first sibling called with ``x`` and
        handed to the others called with the same tensor (see the module docstring)."""
        i = self.index[id(layer)]
        if self._input is not x or i in self._taken:
            self._parts = compute()
            self._input, self._taken = x, set()
        self._taken.add(i)
        part = self._parts[i]
        if len(self._taken) == len(self.layers):
            self._input, self._parts = None, []
        return part

    def fuse_weights(self) -> bool:
        """Put the siblings' base weights (and biases) into one matrix, each base layer's weight a
        view of its rows: a served model's group then runs one base matmul (``fused``). Only for
        plain ``nn.Linear`` bases of one dtype and device; False (nothing changed) otherwise.
        ``unfuse_weights`` gives each its own storage again."""
        bases = [layer.get_base_layer() for layer in self.layers]
        weights = [base.weight for base in bases]
        biases = {(b.dtype, b.device) for b in (base.bias for base in bases) if b is not None}
        if (not all(plain_linear(base) for base in bases) or len({(w.dtype, w.device) for w in weights}) != 1
                or not biases <= {(weights[0].dtype, weights[0].device)}):
            return False
        self.weight = torch.cat([w.detach() for w in weights])
        self.widths = [w.shape[0] for w in weights]
        if any(base.bias is not None for base in bases):
            self.bias = torch.cat([base.bias.detach() if base.bias is not None else weights[0].new_zeros(w.shape[0])
                                   for base, w in zip(bases, weights)])
        for base, part in zip(bases, self.weight.split(self.widths)):
            base.weight.data = part
        if self.bias is not None:
            for base, part in zip(bases, self.bias.split(self.widths)):
                if base.bias is not None:
                    base.bias.data = part
        return True

    def weights_current(self) -> bool:
        """Whether every sibling's base weight (and bias) is still a view of the group's matrix: a
        ``model.to(...)``, ``load_state_dict(assign=True)`` or a merge after ``fuse_weights`` rebinds
        them, and the group then steps aside (each layer computes alone) rather than serve the
        matrix's old values."""
        storage = self.weight.untyped_storage().data_ptr()
        bases = [layer.get_base_layer() for layer in self.layers]
        if any(base.weight.untyped_storage().data_ptr() != storage for base in bases):
            return False
        if self.bias is None:
            return all(base.bias is None for base in bases)
        bias = self.bias.untyped_storage().data_ptr()
        return all(base.bias is None or base.bias.untyped_storage().data_ptr() == bias for base in bases)

    def unfuse_weights(self) -> None:
        """Each base weight (and bias) its own storage again, where it is still a view of the group's."""
        if self.weight is None:
            return
        shared = {self.weight.untyped_storage().data_ptr()}
        if self.bias is not None:
            shared.add(self.bias.untyped_storage().data_ptr())
        for layer in self.layers:
            base = layer.get_base_layer()
            for param in (base.weight, base.bias):
                if param is not None and param.untyped_storage().data_ptr() in shared:
                    param.data = param.data.clone()
        self.weight = self.bias = None

    def _block_diagonal(self, expands: list[torch.Tensor]) -> torch.Tensor:
        """The siblings' ``sB`` ([out_i, r_i]) as one block-diagonal ``[sum out, sum r]``, kept per
        adapter and refreshed in place (as ``_stack``)."""
        key = ("sB",) + tuple((b.data_ptr(), b.dtype) for b in expands)
        versions = tuple(b._version for b in expands)
        entry = self._stacked.get(key)
        if entry is not None and entry[2] == versions:
            return entry[0]
        matrix = entry[0] if entry is not None else torch.zeros(
            sum(b.shape[0] for b in expands), sum(b.shape[1] for b in expands), dtype=expands[0].dtype,
            device=expands[0].device)
        row = col = 0
        for b in expands:
            matrix[row:row + b.shape[0], col:col + b.shape[1]].copy_(b)
            row, col = row + b.shape[0], col + b.shape[1]
        self._stacked[key] = (matrix, [], versions)
        return matrix

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


def plain_linear(base: nn.Module) -> bool:
    """``base`` is an ``nn.Linear`` whose forward is exactly ``F.linear`` (no hooks, no override), so
    its weight can be used directly; anything else (a 4-bit layer, a hooked or offloaded one) is
    called as it is and only the update is fused."""
    return (
        type(base) is nn.Linear
        and not base._forward_hooks
        and not base._forward_pre_hooks
        and "forward" not in vars(base)
    )


def group_siblings(model: nn.Module, layers: list[nn.Module], fuse: bool = False) -> int:
    """Give the fused LoRA ``layers`` of ``model`` that read one input their ``SiblingGroup``
    (``layer._ftq_siblings``); the number of groups made. ``fuse``: also their base weights as
    one matrix (``SiblingGroup.fuse_weights``: a served model, which ``ungroup`` restores)."""
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
            if fuse:
                group.fuse_weights()
            for member in members:
                member._ftq_siblings = group
            groups += 1
    return groups


def ungroup(layers: list[nn.Module]) -> None:
    """Undo ``group_siblings`` (each base layer its own weight storage again)."""
    for layer in layers:
        group = layer.__dict__.pop("_ftq_siblings", None)
        if group is not None:
            group.unfuse_weights()


def base_plus_update(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype,
                     xa: torch.Tensor, sb: torch.Tensor) -> torch.Tensor:
    """``x2 @ W^T (+ b) + xa @ sB^T`` in ``dtype`` ([tokens, out]): the update added in place into
    the base matmul's output (one ``addmm_``); the fused LoRA layer's forward, ``serve_forward`` and
    a group's one matmul (``SiblingGroup.fused``).

    (Session 18 measured the other order, the update written first and the base matmul
    accumulated onto it with ``beta=1``, on the served 8B: no difference beyond noise at batch 64
    or 256, so there is one order.)"""
    w = weight.to(dtype)
    out = x2 @ w.t() if bias is None else torch.addmm(bias.to(dtype), x2, w.t())
    return out.addmm_(xa, sb.t())


def serve_forward(layer: nn.Module, group: SiblingGroup | None, x: torch.Tensor, name: str, dtype: torch.dtype,
                  a: torch.Tensor, sb: torch.Tensor) -> torch.Tensor | None:
    """``layer``'s output without autograd (a served model): from ``group``'s one matmul when its
    weights are fused, else with its ``x @ A^T`` from ``group`` when it has one, else its own. None
    when a sibling lacks adapter ``name`` (the caller's own path then runs)."""
    shape = x.shape
    if group is not None:
        cache = layer._ftq_adapter_cache
        adapters = []
        for member in group.layers:
            if name not in member.lora_A or "_ftq_adapter_cache" not in vars(member):
                return None
            adapters.append(cache.get(member, member.lora_A[name].weight, member.lora_B[name].weight,
                                      float(member.scaling[name]), dtype))
        if group.weight is not None and group.weights_current():
            return group.fused(layer, x, dtype, adapters)
    x2 = x.reshape(-1, shape[-1]).to(dtype)
    if group is None:
        xa = x2 @ a.t()
    else:
        xa = group.down(layer, x, x2, [member_a for member_a, _ in adapters])
    base = layer.get_base_layer()
    out = base_plus_update(x2, base.weight, base.bias, dtype, xa, sb)
    return out.view(*shape[:-1], out.shape[-1])
