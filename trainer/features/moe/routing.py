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
bias, and the backward passes of both and of the dispatch (``trainer/kernels/moe.py``).
``install(..., triton=False)`` keeps torch ops (the reference those kernels are tested against,
in Triton's interpreter on CPU).

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
from dataclasses import dataclass
from typing import Any

import torch

from trainer.features.moe.metadata import RoutingMetadata, build_routing
from trainer.kernels.moe import ACT_GPT_OSS, ACT_SILU, combine, dispatch, fused_gate, has_triton, triton_runs

FAMILIES = {
    "GptOssExperts": "gpt_oss",
    "Qwen3MoeExperts": "qwen3_moe",
    "MixtralExperts": "mixtral",
}
"""Experts classes proven equal to the eager loop in tests/unit/trainer/features/moe/test_moe_routing.py."""

_PATCHED = "_ftq_moe_routing"
"""Instance attribute marking a patched module (its value: ``grouped`` or ``eager``)."""
_TRITON = "_ftq_triton"
"""Instance attribute: run dispatch-backward, gate and combine as Triton kernels (else torch ops)."""
_GATE = "_ftq_gate"
"""Instance attribute: ``(activation, interleaved)`` when the Triton gate kernel implements the module's gate."""
INSTANCE_STATE = ("forward", _PATCHED, _TRITON, _GATE)
"""Every instance attribute ``install`` sets on an experts module (what an uninstall restores)."""


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

    x_SH = dispatch(hidden_states, meta, use_triton)
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
    return combine(y_SH, top_k_weights, down_bias, meta, use_triton).to(hidden_states.dtype)


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
        runs = triton_runs(device)
        if triton and enabled and not runs:
            missing = "a CUDA device" if has_triton() else "Triton (pip install triton) and a CUDA device"
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


def _clamp_params(module: torch.nn.Module, act: int) -> tuple[float, float]:
    if act == ACT_GPT_OSS:
        return float(module.limit), float(module.alpha)
    return 0.0, 1.0
