"""MoE routing by one stable argsort + counts: tokens grouped per expert once per layer, no host sync.

Why: transformers' eager experts loop (``experts_implementation="eager"``, the seed's "before")
visits experts one by one and finds each one's tokens with ``torch.where`` on a ``[E, K, T]``
one-hot mask: a ``nonzero`` per hit expert, i.e. one device->host sync per expert per layer
(issue 4 measured 225 host syncs on one GPT-OSS-20B-shaped layer), plus ~10 small launches per expert.
Unsloth's rewrite (unsloth-zoo #535) groups once with argsort + ``bincount`` but keeps the loop,
and ``bincount`` itself syncs on CUDA (it sizes its output from the max); its backward then
loses, because per-expert slices make autograd allocate full-size zero gradients per expert.

Here, per MoE layer and forward (and again in a gradient-checkpoint recompute)::

    top_k_index [T, K]  ->  flat slots s = t*K + j  (token-major)      [S = T*K]
    sort_idx_S      = stable argsort(flat expert ids)   tokens ascending inside each expert
    expert_S        = flat[sort_idx_S]                  sorted expert ids
    offsets_E       = searchsorted(expert_S, 0..E-1, right)  end of each expert's group (int32)
    counts_E        = diff(offsets_E)                   tokens per expert, a fixed [E] tensor
    inverse_S       = the inverse permutation            slot -> its row in the grouped order

For assignments ``[[1, 0], [2, 1], [0, 2]]`` (T=3, K=2, E=3): flat ``[1,0,2,1,0,2]``,
``sort_idx_S = [1, 4, 0, 3, 2, 5]``, tokens ``[0, 2, 0, 1, 1, 2]``, ``counts_E = [2, 2, 2]``,
``offsets_E = [2, 4, 6]``.

Counts come from ``searchsorted`` on the already-sorted ids, not ``bincount`` (syncs on CUDA to
size its output) nor an atomic ``scatter_add_``: one small kernel, fixed ``[E]`` output,
deterministic. The argsort, the gathers and the grouped GEMM
(``torch.nn.functional.grouped_mm`` / ``torch._grouped_mm``, bf16 on CUDA sm80+) take device
tensors only, so the grouped path has **no host sync** (``tests/gpu/test_moe_gpu.py`` checks it
under ``torch.cuda.set_sync_debug_mode("error")``). Where grouped_mm cannot run (CPU, fp32 on a
GPU, older GPUs) a loop over the contiguous per-expert slices runs instead, costing exactly ONE
host sync per layer: a single ``offsets_E.tolist()`` stored in the metadata, reused by both
GEMMs and their backward.

Backward efficiency (the reason the plain rewrite lost): every step is one op over the whole
permuted tensor. Dispatch ``x[token_S]`` and combine are custom autograd functions whose
backward is a single gather by the inverse permutation (no zero-filled ``[T, H]`` per expert,
no atomic scatter); grouped_mm's backward is grouped_mm; the loop fallback is one autograd
function that writes each expert's slice of one preallocated gradient. The weighted
scatter-add back to token order is a gather by the inverse permutation summed over K in fp32
(deterministic, no atomics).

On CUDA (with Triton installed) three steps run as Triton kernels instead of chains of
element-wise torch ops, each reading its rows once and computing in fp32: the gate activation
with its bias (GPT-OSS's clamped SwiGLU, SiLU-gated experts), the combine with GPT-OSS's down
bias, and the backward passes of both and of the dispatch. ``install(..., triton=False)`` keeps
torch ops (the reference those kernels are tested against, in Triton's interpreter on CPU).

Surface (what the trainer calls, after the model is on its device, before or after peft)::

    reason = supported(model)              # None, or why not (no MoE blocks, EP-split experts, ...)
    result = install(model, enabled)       # InstallResult; result.describe() for the plan's reason:
                                           # "grouped routing on 24 MoE blocks (gpt_oss), grouped_mm, Triton combine + gate"
    targets = expert_lora_targets(model)   # peft target_parameters for LoRA on the 3-D expert weights

``install`` patches every recognised experts module (transformers' ``@use_experts_implementation``
classes: GPT-OSS, Qwen3-MoE, Mixtral, and the same layout elsewhere) to
``grouped_experts_forward``, or with ``enabled=False`` to transformers' eager loop whatever
``config._experts_implementation`` says (the honest "before"). LoRA works unchanged: attention
LoRA does not touch the experts, and peft's ``target_parameters`` LoRA on
``experts.gate_up_proj`` / ``down_proj`` parametrizes those attributes, which the grouped
forward reads like any other weight (``all-linear`` never reaches them: they are not ``nn.Linear``).

Shape legend: T tokens, K experts per token, S = T*K routed slots, E experts, H hidden size,
I expert intermediate size, N a GEMM's output width.
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

try:  # Triton is optional (CPU boxes may lack it): only the gate and combine kernels need it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on boxes without triton
    triton = None
    tl = None

FAMILIES = {
    "GptOssExperts": "gpt_oss",
    "Qwen3MoeExperts": "qwen3_moe",
    "MixtralExperts": "mixtral",
}
"""Experts classes proven equal to the eager loop in tests/unit/trainer/test_moe_routing.py."""

_PATCHED = "_ftq_moe_routing"
"""Instance attribute marking a patched module (its value: ``grouped`` or ``eager``)."""
_TRITON = "_ftq_triton"
"""Instance attribute: run dispatch-backward, gate and combine as Triton kernels (else torch ops)."""
_GATE = "_ftq_gate"
"""Instance attribute: ``(activation, interleaved)`` when the Triton gate kernel implements the module's gate."""

ACT_GPT_OSS = 0
"""GPT-OSS: ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)``, ``g = min(gate, limit)``; gate/up interleaved."""
ACT_SILU = 1
"""Qwen3-MoE / Mixtral: ``silu(gate) * up``; gate and up concatenated (``chunk(2)``)."""


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


class _Dispatch(torch.autograd.Function):
    """``x_TH[token_S]``: token rows copied into grouped order; backward = one gather + sum over K."""

    @staticmethod
    def forward(ctx, x_TH: torch.Tensor, meta: RoutingMetadata, use_triton: bool) -> torch.Tensor:
        ctx.meta, ctx.use_triton = meta, use_triton
        return x_TH.index_select(0, meta.token_S)

    @staticmethod
    def backward(ctx, grad_SH: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        meta: RoutingMetadata = ctx.meta
        if ctx.use_triton:
            return _gather_sum(grad_SH, meta, None, None), None, None
        # Row s of the grouped order came from token sort_idx_S[s] // K; reading the grouped
        # gradient back in flat slot order puts a token's K rows next to each other.
        grad_TKH = grad_SH.index_select(0, meta.inverse_S).view(meta.num_tokens, meta.top_k, -1)
        return grad_TKH.sum(dim=1, dtype=torch.float32).to(grad_SH.dtype), None, None


class _Combine(torch.autograd.Function):
    """``out[t] = sum_j w[t, j] * (y[inverse[t*K + j]] + b[e_tj])``: the weighted scatter-add back to token order.

    Written as a gather by the inverse permutation, never an atomic scatter: deterministic, fp32
    accumulation. Torch ops: ``index_select`` + one ``bmm`` (the bias must be added to ``y``
    before; ``bias_EH`` only with Triton). Triton: one kernel reads each expert-output row once
    and adds the bias row of its expert on the fly. Backward: ``dy`` is a gather of the output
    gradient scaled by the slot's weight; ``dw`` a dot product per slot.
    """

    @staticmethod
    def forward(ctx, y_SH, weights_TK, bias_EH, meta: RoutingMetadata, use_triton: bool) -> torch.Tensor:
        ctx.meta, ctx.use_triton = meta, use_triton
        ctx.save_for_backward(y_SH, weights_TK, bias_EH)
        if use_triton:
            return _gather_sum(y_SH, meta, weights_TK, bias_EH)
        assert bias_EH is None, "the torch-ops combine takes the bias already added to y"
        T, K = meta.num_tokens, meta.top_k
        y_TKH = y_SH.index_select(0, meta.inverse_S).view(T, K, -1)
        return torch.bmm(weights_TK.to(y_SH.dtype).view(T, 1, K), y_TKH).view(T, -1)

    @staticmethod
    def backward(ctx, grad_TH: torch.Tensor):
        meta: RoutingMetadata = ctx.meta
        y_SH, weights_TK, bias_EH = ctx.saved_tensors
        T, K = meta.num_tokens, meta.top_k
        need_y, need_w, need_b = ctx.needs_input_grad[:3]
        grad_y = grad_w = grad_b = None
        if need_y or need_b:
            if ctx.use_triton:
                grad_y = _scale_rows(grad_TH, meta, weights_TK)
            else:
                # Row s of the grouped order is flat slot sort_idx_S[s]: weight w.flat[slot], token slot // K.
                w_S = weights_TK.reshape(-1).index_select(0, meta.sort_idx_S).to(grad_TH.dtype)
                grad_y = grad_TH.index_select(0, meta.token_S) * w_S[:, None]
        if need_w:
            if ctx.use_triton:
                grad_w = _slot_dots(grad_TH, y_SH, meta, bias_EH).to(weights_TK.dtype)
            else:
                y_TKH = y_SH.index_select(0, meta.inverse_S).view(T, K, -1)
                grad_w = torch.bmm(y_TKH, grad_TH.view(T, -1, 1)).view(T, K).to(weights_TK.dtype)
        if need_b:
            # What autograd does for bias.index_select(0, expert_S): scatter-add the rows back.
            grad_b = torch.zeros_like(bias_EH).index_add_(0, meta.expert_S, grad_y.to(bias_EH.dtype))
        return grad_y if need_y else None, grad_w, grad_b, None, None


class _LoopGroupedMM(torch.autograd.Function):
    """``x_SK[rows of e] @ w_EKN[e]`` per non-empty group, into one preallocated output.

    The fallback where grouped_mm cannot run. One autograd node for all experts, so backward
    writes each group's slice of one ``dx`` (and ``dw`` only when the weight needs it) instead
    of autograd summing E full-size zero-padded slice gradients.
    """

    @staticmethod
    def forward(ctx, x_SK: torch.Tensor, w_EKN: torch.Tensor, meta: RoutingMetadata) -> torch.Tensor:
        ctx.meta = meta
        ctx.save_for_backward(x_SK, w_EKN)
        out_SN = x_SK.new_empty(x_SK.shape[0], w_EKN.shape[-1])
        # In the weight's dtype like grouped_mm (an outer autocast would clash with ``out=``).
        with torch.autocast(x_SK.device.type, enabled=False):
            for e, start, end in meta.groups():
                torch.mm(x_SK[start:end], w_EKN[e], out=out_SN[start:end])
        return out_SN

    @staticmethod
    def backward(ctx, grad_SN: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        meta: RoutingMetadata = ctx.meta
        x_SK, w_EKN = ctx.saved_tensors
        grad_x = torch.empty_like(x_SK) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros(w_EKN.shape, dtype=w_EKN.dtype, device=w_EKN.device) if ctx.needs_input_grad[1] else None
        grad_SN = grad_SN.to(x_SK.dtype)
        with torch.autocast(x_SK.device.type, enabled=False):
            for e, start, end in meta.groups():
                if grad_x is not None:
                    torch.mm(grad_SN[start:end], w_EKN[e].T, out=grad_x[start:end])
                if grad_w is not None:
                    torch.mm(x_SK[start:end].T, grad_SN[start:end], out=grad_w[e])
        return grad_x, grad_w, None


def grouped_mm_available(device: torch.device, dtype: torch.dtype) -> bool:
    """True when torch's grouped GEMM runs here: bf16 on CUDA sm80+ (torch >= 2.9; sm90 only before)."""
    if device.type != "cuda" or dtype != torch.bfloat16:
        return False
    if not (hasattr(torch.nn.functional, "grouped_mm") or hasattr(torch, "_grouped_mm")):
        return False
    major, minor = torch.cuda.get_device_capability(device)
    if hasattr(torch.nn.functional, "grouped_mm") or _torch_at_least(2, 9):
        return (major, minor) >= (8, 0)
    return major == 9


def _torch_at_least(major: int, minor: int) -> bool:
    parts = torch.__version__.split("+")[0].split(".")
    return (int(parts[0]), int(parts[1])) >= (major, minor)


def grouped_linear(x_SK: torch.Tensor, w_EKN: torch.Tensor, meta: RoutingMetadata) -> torch.Tensor:
    """``[S, K] x [E, K, N] -> [S, N]``, row group e times ``w_EKN[e]`` (grouped_mm or the loop)."""
    x_SK = x_SK.to(w_EKN.dtype)
    if meta.host_offsets is None:
        grouped_mm = getattr(torch.nn.functional, "grouped_mm", None) or torch._grouped_mm
        return grouped_mm(x_SK, w_EKN, offs=meta.offsets_E)
    return _LoopGroupedMM.apply(x_SK, w_EKN, meta)


def grouped_experts_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor | None = None,
    top_k_weights: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """Forward of a transformers experts module (``@use_experts_implementation`` layout), grouped.

    Same arguments and result as the module's own forward (GPT-OSS names them ``router_indices``
    / ``routing_weights``; both spellings are accepted).

    Args:
        hidden_states: ``[T, H]``.
        top_k_index: ``[T, K]`` expert ids.
        top_k_weights: ``[T, K]`` routing weights.
    Returns:
        ``[T, H]`` in ``hidden_states``' dtype.
    """
    top_k_index = kwargs.pop("router_indices", top_k_index)
    top_k_weights = kwargs.pop("routing_weights", top_k_weights)
    if kwargs or top_k_index is None or top_k_weights is None:
        raise TypeError(f"grouped experts forward takes (hidden_states, top_k_index, top_k_weights); got extra {sorted(kwargs)}")
    if hidden_states.shape[0] == 0:
        return torch.zeros_like(hidden_states)
    has_gate = getattr(self, "has_gate", True)
    up_w = self.gate_up_proj if has_gate else self.up_proj
    grouped = grouped_mm_available(hidden_states.device, up_w.dtype)
    meta = build_routing(top_k_index, self.num_experts, host_offsets=not grouped)

    use_triton = getattr(self, _TRITON, False)
    gate = getattr(self, _GATE, None) if use_triton else None
    has_bias = getattr(self, "has_bias", False)
    post_norm = getattr(self, "has_post_expert_norm", False)

    x_SH = _Dispatch.apply(hidden_states, meta, use_triton)
    h_SN = grouped_linear(x_SH, _as_EKN(self, up_w), meta)
    if gate is not None:
        act, interleaved = gate
        bias = self.gate_up_proj_bias if has_bias else None
        h_SI = fused_gate(h_SN, meta.expert_S, bias, act, interleaved, *_clamp_params(self, act))
    else:
        if has_bias:
            h_SN = h_SN + _bias(self, "gate_up_proj_bias" if has_gate else "up_proj_bias", meta)
        h_SI = self._apply_gate(h_SN) if has_gate else self.act_fn(h_SN)
    y_SH = grouped_linear(h_SI, _as_EKN(self, self.down_proj), meta)
    down_bias = self.down_proj_bias if has_bias else None
    if down_bias is not None and (post_norm or not use_triton):
        y_SH, down_bias = y_SH + _bias(self, "down_proj_bias", meta), None
    if post_norm:
        y_SH = self.post_expert_norm(y_SH)
    return _Combine.apply(y_SH, top_k_weights, down_bias, meta, use_triton).to(hidden_states.dtype)


def _as_EKN(module: torch.nn.Module, weight: torch.Tensor) -> torch.Tensor:
    """The weight as ``[E, in, out]``: GPT-OSS stores it so (``is_transposed``), Qwen3/Mixtral as ``[E, out, in]``."""
    return weight if getattr(module, "is_transposed", False) else weight.transpose(-2, -1)


def _bias(module: torch.nn.Module, name: str, meta: RoutingMetadata) -> torch.Tensor:
    return getattr(module, name).index_select(0, meta.expert_S)


def _eager_forward(module: torch.nn.Module) -> Any:
    """transformers' own per-expert loop: the undecorated class forward under the dispatch wrapper."""
    return getattr(type(module).forward, "__wrapped__", type(module).forward)


def _is_transformers_experts(module: torch.nn.Module) -> bool:
    """An experts module built with transformers' ``@use_experts_implementation`` 3-D weight layout."""
    return (
        hasattr(type(module).forward, "__wrapped__")
        and hasattr(module, "num_experts")
        and hasattr(module, "down_proj")
        and (hasattr(module, "gate_up_proj") or hasattr(module, "up_proj"))
        and hasattr(module, "is_transposed")
        and isinstance(module.down_proj, torch.Tensor)
        and module.down_proj.dim() == 3
    )


def experts_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """``(qualified name, module)`` of every experts module the grouped path handles."""
    return [
        (name, m)
        for name, m in model.named_modules()
        if _is_transformers_experts(m) and not getattr(m, "_is_expert_parallel", False)
    ]


def expert_lora_targets(model: torch.nn.Module) -> list[str]:
    """peft ``target_parameters`` for LoRA on the 3-D expert weights, e.g. ``["experts.gate_up_proj", "experts.down_proj"]``.

    ``target_modules="all-linear"`` never reaches them (they are parameters, not ``nn.Linear``).
    peft's ``ParamWrapper`` for them needs ``lora_dropout=0``.
    """
    targets: list[str] = []
    for name, module in experts_modules(model):
        leaf = [part for part in name.split(".") if part != "base_layer"][-1]  # also once peft wrapped it
        for weight in ("gate_up_proj" if getattr(module, "has_gate", True) else "up_proj", "down_proj"):
            target = f"{leaf}.{weight}"
            if target not in targets:
                targets.append(target)
    return targets


@dataclass(frozen=True)
class InstallResult:
    """What ``install`` did, for the plan's reason line."""

    enabled: bool
    blocks: int
    families: tuple[str, ...]
    backend: str
    """``grouped_mm`` (no host sync), ``loop`` (one host sync per layer) or ``eager`` (transformers' loop)."""
    triton: bool = False
    """Dispatch backward and combine run as Triton kernels."""
    fused_gate_blocks: int = 0
    """Blocks whose gate activation (and gate/up bias) runs as the Triton kernel."""

    def describe(self) -> str:
        if not self.enabled:
            return f"transformers' eager per-expert loop on {self.blocks} MoE blocks ({', '.join(self.families)})"
        how = "grouped_mm" if self.backend == "grouped_mm" else "per-expert slices, one host sync per layer"
        if self.triton:
            how += f", Triton combine{' + gate' if self.fused_gate_blocks else ''}"
        return f"grouped routing on {self.blocks} MoE blocks ({', '.join(self.families)}), {how}"


def install(model: torch.nn.Module, enabled: bool, triton: bool | None = None) -> InstallResult:
    """Patch every recognised experts module to the grouped forward, or (``enabled=False``) to eager.

    Per-instance ``forward`` overrides: safe to call again (the last call wins), and they survive
    peft wrapping (peft keeps the experts module as its ``base_layer``).

    Args:
        model: any module holding transformers experts modules (a causal LM, a peft model, one block).
        enabled: grouped routing (True) or transformers' eager loop (False).
        triton: run the combine (+ GPT-OSS's down bias), the dispatch's backward and, where the
            module's gate is one the kernel knows (GPT-OSS's clamped SwiGLU, SiLU-gated experts),
            the gate activation (+ gate/up bias) as Triton kernels instead of chains of
            element-wise torch ops. None (default): when it can run (CUDA weights, Triton
            installed); True insists; False keeps torch ops (the reference the kernels are tested against).

    Raises:
        ValueError: the model has no recognised experts module (check ``supported`` first), or
            ``triton=True`` where Triton cannot run.
    """
    found = experts_modules(model)
    if not found:
        raise ValueError(f"{type(model).__name__} has no recognised MoE experts module; {supported(model) or ''}".rstrip("; "))
    families: list[str] = []
    fused_blocks = 0
    for name, module in found:
        device = module.down_proj.device
        runs = _triton_runs(device)
        if triton and enabled and not runs:
            missing = "a CUDA device" if _has_triton() else "Triton (pip install triton) and a CUDA device"
            raise ValueError(
                f"triton=True: the Triton MoE kernels need {missing}; {name} is on {device}. "
                "Pass triton=None (use them where they run) or False"
            )
        use_triton = enabled and runs and triton is not False
        fn = grouped_experts_forward if enabled else _eager_forward(module)
        module.forward = types.MethodType(fn, module)
        setattr(module, _PATCHED, "grouped" if enabled else "eager")
        gate = _gate_kind(module) if use_triton else None
        setattr(module, _TRITON, use_triton)
        setattr(module, _GATE, gate)
        fused_blocks += gate is not None
        family = FAMILIES.get(type(module).__name__, type(module).__name__)
        if family not in families:
            families.append(family)
    weight = found[0][1].down_proj
    if not enabled:
        backend = "eager"
    elif grouped_mm_available(weight.device, weight.dtype):
        backend = "grouped_mm"
    else:
        backend = "loop"
    return InstallResult(
        enabled=enabled, blocks=len(found), families=tuple(families), backend=backend,
        triton=any(getattr(m, _TRITON, False) for _, m in found),
        fused_gate_blocks=fused_blocks,
    )


def supported(model_or_config: Any, device: torch.device | str | None = None) -> str | None:
    """Why grouped routing cannot run for this model (or config) on ``device``; None when it can.

    It runs on every device (the loop fallback needs nothing); what can stop it is the model:
    no MoE blocks, experts of another layout (quantized experts, custom code), or expert parallelism.
    ``device`` is accepted for the common ``supported(x, device)`` shape and only checked for validity.
    """
    if device is not None:
        torch.device(device)  # raises on a bad device string
    if isinstance(model_or_config, torch.nn.Module):
        if experts_modules(model_or_config):
            return None
        if any(_is_transformers_experts(m) for m in model_or_config.modules()):
            return "its experts are split for expert parallelism, which the grouped path does not handle"
        model_type = getattr(getattr(model_or_config, "config", None), "model_type", type(model_or_config).__name__)
        return f"{model_type} has no MoE experts module with transformers' 3-D expert weights"
    config = model_or_config
    model_type = getattr(config, "model_type", None)
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    if not experts:
        return f"{model_type} has no MoE blocks"
    if getattr(config, "quantization_config", None) is not None:
        return f"{model_type} has quantized experts; the grouped path needs bf16/fp32 3-D expert weights"
    return None


# --- The fused gate: one Triton kernel forward, one backward -------------------------------------
#
# Why: between the two grouped GEMMs, the gate is ~10 element-wise torch ops over [S, 2I] / [S, I]
# (bias gather + add, strided gate/up views, two clamps, sigmoid, three multiplies, an add), each
# a full pass over memory that autograd also keeps alive for backward. On a GPT-OSS-20B layer with
# 16k tokens (S = 65,536 rows, I = 2,880) each such tensor is 0.38-0.75 GB. The kernel reads the
# GEMM output (and the bias row of the row's expert) once, computes in fp32, writes [S, I] once;
# backward recomputes the activation from the saved GEMM output instead of keeping intermediates.


def _gate_kind(module: torch.nn.Module) -> tuple[int, bool] | None:
    """``(activation, interleaved)`` when the module's gate is one the kernel implements, else None."""
    if not getattr(module, "has_gate", True) or getattr(module, "has_post_expert_norm", False):
        return None
    apply_gate = getattr(type(module), "_apply_gate", None)
    if (
        type(module).__name__ == "GptOssExperts"
        and getattr(apply_gate, "__qualname__", "") == "GptOssExperts._apply_gate"
        and hasattr(module, "alpha")
        and hasattr(module, "limit")
    ):
        return ACT_GPT_OSS, True
    from transformers.integrations import moe as hf_moe

    act = getattr(module, "act_fn", None)
    if apply_gate is getattr(hf_moe, "_default_apply_gate", None) and type(act).__name__ in ("SiLUActivation", "SiLU"):
        return ACT_SILU, False
    return None


def _has_triton() -> bool:
    return triton is not None


def _triton_runs(device: torch.device) -> bool:
    return triton is not None and (device.type == "cuda" or _interpreting())


def _interpreting() -> bool:
    """True under ``TRITON_INTERPRET=1`` (tests run the kernels on CPU tensors then)."""
    if triton is None:
        return False
    from triton import knobs

    return bool(knobs.runtime.interpret)


def _clamp_params(module: torch.nn.Module, act: int) -> tuple[float, float]:
    if act == ACT_GPT_OSS:
        return float(module.limit), float(module.alpha)
    return 0.0, 1.0


if triton is not None:

    @triton.jit
    def _cols(I, INTERLEAVED: tl.constexpr, BLOCK: tl.constexpr):
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        if INTERLEAVED:  # GPT-OSS: gate, up, gate, up, ...
            g_col = 2 * cols
            u_col = 2 * cols + 1
        else:  # chunk(2): all gates, then all ups
            g_col = cols
            u_col = cols + I
        return cols, g_col, u_col

    @triton.jit
    def _load_gate_up(h_ptr, expert_ptr, bias_ptr, row, g_col, u_col, mask, I, HAS_BIAS: tl.constexpr):
        g = tl.load(h_ptr + row * 2 * I + g_col, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(h_ptr + row * 2 * I + u_col, mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            e = tl.load(expert_ptr + row).to(tl.int64)
            g += tl.load(bias_ptr + e * 2 * I + g_col, mask=mask, other=0.0).to(tl.float32)
            u += tl.load(bias_ptr + e * 2 * I + u_col, mask=mask, other=0.0).to(tl.float32)
        return g, u

    @triton.jit
    def gate_fwd(h_ptr, expert_ptr, bias_ptr, out_ptr, I, limit, alpha,
                 INTERLEAVED: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols, g_col, u_col = _cols(I, INTERLEAVED, BLOCK)
        mask = cols < I
        g, u = _load_gate_up(h_ptr, expert_ptr, bias_ptr, row, g_col, u_col, mask, I, HAS_BIAS)
        if ACT == 0:
            g = tl.minimum(g, limit)
            u = tl.minimum(tl.maximum(u, -limit), limit)
            out = (u + 1.0) * (g * tl.sigmoid(g * alpha))
        else:
            out = g * tl.sigmoid(g) * u
        tl.store(out_ptr + row * I + cols, out.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def gate_bwd(h_ptr, expert_ptr, bias_ptr, dout_ptr, dh_ptr, I, limit, alpha,
                 INTERLEAVED: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols, g_col, u_col = _cols(I, INTERLEAVED, BLOCK)
        mask = cols < I
        g, u = _load_gate_up(h_ptr, expert_ptr, bias_ptr, row, g_col, u_col, mask, I, HAS_BIAS)
        d = tl.load(dout_ptr + row * I + cols, mask=mask, other=0.0).to(tl.float32)
        if ACT == 0:
            # torch.clamp passes the gradient where min <= x <= max (inclusive): same masks here.
            gc = tl.minimum(g, limit)
            sig = tl.sigmoid(gc * alpha)
            uc = tl.minimum(tl.maximum(u, -limit), limit)
            du = tl.where((u >= -limit) & (u <= limit), d * gc * sig, 0.0)
            dg = tl.where(g <= limit, d * (uc + 1.0) * (sig + alpha * gc * sig * (1.0 - sig)), 0.0)
        else:
            sig = tl.sigmoid(g)
            du = d * g * sig
            dg = d * u * (sig + g * sig * (1.0 - sig))
        ty = dh_ptr.dtype.element_ty
        tl.store(dh_ptr + row * 2 * I + g_col, dg.to(ty), mask=mask)
        tl.store(dh_ptr + row * 2 * I + u_col, du.to(ty), mask=mask)


_GATE_BLOCK = 1024
"""Columns per program: the intermediate sizes we meet (768 - 2,880) take 1-3 programs per row."""


class _FusedGate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_SN, expert_S, bias_EN, act, interleaved, limit, alpha):
        h_SN = h_SN.contiguous()
        S, N = h_SN.shape
        out_SI = h_SN.new_empty(S, N // 2)
        ctx.save_for_backward(h_SN, expert_S, bias_EN)
        ctx.params = (act, interleaved, limit, alpha)
        if S:
            grid = (S, -(-(N // 2) // _GATE_BLOCK))
            gate_fwd[grid](h_SN, expert_S, bias_EN if bias_EN is not None else h_SN, out_SI, N // 2, limit, alpha,
                      INTERLEAVED=interleaved, HAS_BIAS=bias_EN is not None, ACT=act, BLOCK=_GATE_BLOCK)
        return out_SI

    @staticmethod
    def backward(ctx, grad_SI):
        h_SN, expert_S, bias_EN = ctx.saved_tensors
        act, interleaved, limit, alpha = ctx.params
        S, N = h_SN.shape
        grad_h = torch.empty_like(h_SN)
        if S:
            grid = (S, -(-(N // 2) // _GATE_BLOCK))
            gate_bwd[grid](h_SN, expert_S, bias_EN if bias_EN is not None else h_SN, grad_SI.contiguous(), grad_h,
                      N // 2, limit, alpha,
                      INTERLEAVED=interleaved, HAS_BIAS=bias_EN is not None, ACT=act, BLOCK=_GATE_BLOCK)
        grad_bias = None
        if bias_EN is not None and ctx.needs_input_grad[2]:
            # What autograd does for bias.index_select(0, expert_S): scatter-add the rows back.
            grad_bias = torch.zeros_like(bias_EN).index_add_(0, expert_S, grad_h.to(bias_EN.dtype))
        return grad_h if ctx.needs_input_grad[0] else None, None, grad_bias, None, None, None, None


def fused_gate(
    h_SN: torch.Tensor,
    expert_S: torch.Tensor,
    bias_EN: torch.Tensor | None,
    act: int,
    interleaved: bool,
    limit: float = 0.0,
    alpha: float = 1.0,
) -> torch.Tensor:
    """Gate activation of the grouped gate/up GEMM output in one Triton kernel (fp32 inside).

    Args:
        h_SN: ``[S, 2I]`` gate/up projections in grouped order (before bias).
        expert_S: ``[S]`` expert of each row, to pick its bias row.
        bias_EN: ``[E, 2I]`` gate/up bias, or None.
        act: ``ACT_GPT_OSS`` or ``ACT_SILU``.
        interleaved: gate and up alternate along the last dim (GPT-OSS) instead of being two halves.
        limit, alpha: GPT-OSS's clamp limit and sigmoid scale.
    Returns:
        ``[S, I]`` in ``h_SN``'s dtype.
    """
    return _FusedGate.apply(h_SN, expert_S, bias_EN, act, interleaved, float(limit), float(alpha))


# --- Routing kernels: combine, its backward, the dispatch's backward -------------------------------
#
# Why: in torch ops the combine is a gather of [S, H] into token order, a bias gather + add, then a
# bmm with K = 4 (a batched GEMM of 16k 1x4 by 4x2880 products); its backward and the dispatch's
# backward are gathers that materialise another [S, H] each before reducing. These kernels read
# each [S, H] row where it lies (rows addressed through ``inverse_S`` / ``token_S``), accumulate
# in fp32 and write the result once: out[t] = sum_j w[t, j] * (src[inverse[t*K + j]] + b[e_tj]).

_ROW_BLOCK = 1024
"""Columns per program for the row kernels (hidden sizes 2,048 - 7,168: 2-7 programs per row)."""

if triton is not None:

    @triton.jit
    def gather_sum_kernel(src_ptr, inverse_ptr, w_ptr, bias_ptr, slot_expert_ptr, out_ptr, H,
                          K: tl.constexpr, HAS_W: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < H
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for j in tl.static_range(K):
            row = tl.load(inverse_ptr + t * K + j).to(tl.int64)
            v = tl.load(src_ptr + row * H + cols, mask=mask, other=0.0).to(tl.float32)
            if HAS_BIAS:
                e = tl.load(slot_expert_ptr + t * K + j).to(tl.int64)
                v += tl.load(bias_ptr + e * H + cols, mask=mask, other=0.0).to(tl.float32)
            if HAS_W:
                v *= tl.load(w_ptr + t * K + j).to(tl.float32)
            acc += v
        tl.store(out_ptr + t * H + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def scale_rows_kernel(grad_ptr, token_ptr, sort_idx_ptr, w_ptr, out_ptr, H, BLOCK: tl.constexpr):
        s = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < H
        t = tl.load(token_ptr + s).to(tl.int64)
        w = tl.load(w_ptr + tl.load(sort_idx_ptr + s)).to(tl.float32)
        g = tl.load(grad_ptr + t * H + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + s * H + cols, (g * w).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def slot_dots_kernel(grad_ptr, src_ptr, inverse_ptr, bias_ptr, slot_expert_ptr, out_ptr, H,
                         K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, H_BLOCKS: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        for j in tl.static_range(K):
            row = tl.load(inverse_ptr + t * K + j).to(tl.int64)
            if HAS_BIAS:
                e = tl.load(slot_expert_ptr + t * K + j).to(tl.int64)
            acc = tl.zeros([BLOCK], dtype=tl.float32)
            for i in range(H_BLOCKS):  # a constexpr trip count (Triton's interpreter cannot range over an argument)
                cols = i * BLOCK + tl.arange(0, BLOCK)
                mask = cols < H
                g = tl.load(grad_ptr + t * H + cols, mask=mask, other=0.0).to(tl.float32)
                v = tl.load(src_ptr + row * H + cols, mask=mask, other=0.0).to(tl.float32)
                if HAS_BIAS:
                    v += tl.load(bias_ptr + e * H + cols, mask=mask, other=0.0).to(tl.float32)
                acc += g * v
            tl.store(out_ptr + t * K + j, tl.sum(acc, axis=0))


def _gather_sum(src_SH: torch.Tensor, meta: RoutingMetadata, weights_TK: torch.Tensor | None,
                bias_EH: torch.Tensor | None) -> torch.Tensor:
    """``out[t] = sum_j w[t, j] * (src[inverse[t*K + j]] + bias[e_tj])`` (w = 1 without weights)."""
    src_SH = src_SH.contiguous()
    H = src_SH.shape[1]
    out_TH = src_SH.new_empty(meta.num_tokens, H)
    weights = weights_TK.contiguous() if weights_TK is not None else src_SH
    bias = bias_EH.contiguous() if bias_EH is not None else src_SH
    grid = (meta.num_tokens, -(-H // _ROW_BLOCK))
    gather_sum_kernel[grid](src_SH, meta.inverse_S, weights, bias, meta.slot_expert_S, out_TH, H,
                            K=meta.top_k, HAS_W=weights_TK is not None, HAS_BIAS=bias_EH is not None,
                            BLOCK=_ROW_BLOCK)
    return out_TH


def _scale_rows(grad_TH: torch.Tensor, meta: RoutingMetadata, weights_TK: torch.Tensor) -> torch.Tensor:
    """``out[s] = w.flat[sort_idx[s]] * grad[token[s]]``: the combine's gradient in grouped order."""
    grad_TH = grad_TH.contiguous()
    H = grad_TH.shape[1]
    out_SH = grad_TH.new_empty(meta.num_slots, H)
    grid = (meta.num_slots, -(-H // _ROW_BLOCK))
    scale_rows_kernel[grid](grad_TH, meta.token_S, meta.sort_idx_S, weights_TK.contiguous(), out_SH, H,
                            BLOCK=_ROW_BLOCK)
    return out_SH


def _slot_dots(grad_TH: torch.Tensor, src_SH: torch.Tensor, meta: RoutingMetadata,
               bias_EH: torch.Tensor | None) -> torch.Tensor:
    """``out[t, j] = <grad[t], src[inverse[t*K + j]] + bias[e_tj]>`` in fp32: the routing weights' gradient."""
    grad_TH, src_SH = grad_TH.contiguous(), src_SH.contiguous()
    H = grad_TH.shape[1]
    out_TK = torch.empty(meta.num_tokens, meta.top_k, device=grad_TH.device, dtype=torch.float32)
    bias = bias_EH.contiguous() if bias_EH is not None else src_SH
    slot_dots_kernel[(meta.num_tokens,)](grad_TH, src_SH, meta.inverse_S, bias, meta.slot_expert_S, out_TK, H,
                                         K=meta.top_k, HAS_BIAS=bias_EH is not None, BLOCK=_ROW_BLOCK,
                                         H_BLOCKS=-(-H // _ROW_BLOCK))
    return out_TK
