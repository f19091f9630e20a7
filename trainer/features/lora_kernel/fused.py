"""LoRA linear layers computed in the compute dtype, with the low-rank update fused into the base matmul.

Why: peft's ``lora.Linear.forward`` casts every adapted layer's input to the adapters' dtype
(fp32 by default), so under bf16 autocast each of the 7 adapted projections per decoder layer
pays a full ``[tokens, in]`` bf16 -> fp32 copy, autocast's copy back to bf16, a separate
``* scaling`` pass and a separate ``result + ...`` pass over ``[tokens, out]`` — each again in
backward, and the fp32 copies are what autograd saves. On the Llama-3.1-8B benchmark step these
casts alone were 18% of GPU time (docs/benchmarks.md). Here:

* forward: ``out = x @ W^T (+ bias)``, then ``out += (x @ A^T) @ (s * B)^T`` in place (one
  ``addmm_`` into the base output; the ``[tokens, r]`` middle is tiny), every matmul in the
  compute dtype (autocast's, else the base weight's). Only the small adapter matrices are cast;
  the fp32 master weights and their fp32 gradients stay as they are (AdamW still updates fp32).
* backward: ``dx = g @ W + (g @ (s * B)) @ A`` (one ``addmm_``), ``dA = (g @ sB)^T @ x``,
  ``dB = s * g^T @ (x @ A^T)``; saved for backward: the input (the same tensor every consumer
  of it saves) and ``x @ A^T``, nothing of size ``[tokens, out]``.

A base layer that is not a plain ``nn.Linear`` (a bitsandbytes 4-bit layer under QLoRA) keeps
its own forward and backward; only the update is fused, as one out-of-place ``addmm`` onto the
base output.

Served (``AdapterCache.keep``, no autograd: ``trainer.generate.kernels``): through
``siblings.serve_forward``: q/k/v and gate/up each run as one layer (one ``x @ A^T``, one base
matmul over their weights put into one matrix, one block-diagonal update).

``install`` patches each peft LoRA layer's ``forward`` on the instance. The patched forward
falls back to peft's own whenever the layer is not in the plain state this covers: adapters
disabled or merged, several active adapters, per-call ``adapter_names``, a LoRA variant
(DoRA, ...) or a nonzero dropout. Numerics: the same matmuls as peft under autocast, with the
update accumulated in the matmul's fp32 accumulator instead of a separate bf16 multiply and add.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from trainer.features.lora_kernel.siblings import base_plus_update, serve_forward
from trainer.features.lora_kernel.siblings import plain_linear as _plain_linear

KERNEL_NAME = "ftq_fused_lora"


def _compute_dtype(x: torch.Tensor, weight_dtype: torch.dtype) -> torch.dtype:
    """The dtype the matmuls run in: autocast's when it is on for ``x``'s device, else the base weight's."""
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return weight_dtype if weight_dtype.is_floating_point else x.dtype


class _FusedLoraLinear(torch.autograd.Function):
    """``x @ W^T + b + (x @ A^T) @ sB^T`` for a plain linear base (``W`` frozen or not).

    ``a`` and ``sb`` are ``A`` and ``s * B`` in the compute dtype (``AdapterCache``); the
    gradients go to the master weights ``lora_a`` / ``lora_b`` (in their own dtype).
    """

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        lora_a: torch.Tensor,
        lora_b: torch.Tensor,
        scaling: float,
        dtype: torch.dtype,
        a: torch.Tensor,
        sb: torch.Tensor,
    ) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).to(dtype)
        xa = x2 @ a.t()
        out = base_plus_update(x2, weight, bias, dtype, xa, sb)
        ctx.save_for_backward(x2, weight, a, sb, xa)
        ctx.scaling, ctx.dtype, ctx.shape, ctx.x_dtype = scaling, dtype, shape, x.dtype
        ctx.a_dtype, ctx.b_dtype = lora_a.dtype, lora_b.dtype
        ctx.has_bias = bias is not None
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return out.view(*shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x2, weight, a, sb, xa = ctx.saved_tensors
        dtype, s = ctx.dtype, ctx.scaling
        g = grad_out.reshape(-1, grad_out.shape[-1]).to(dtype)
        gb = g @ sb  # [tokens, r]
        need = ctx.needs_input_grad
        dx = dw = dbias = da = db = None
        if need[0]:
            dx = g @ weight.to(dtype)
            dx.addmm_(gb, a)
            dx = dx.view(ctx.shape).to(ctx.x_dtype)
        if need[1]:
            dw = (g.t() @ x2).to(weight.dtype)
        if ctx.has_bias and need[2]:
            dbias = g.sum(0).to(ctx.bias_dtype)
        if need[3]:
            da = (gb.t() @ x2).to(ctx.a_dtype)
        if need[4]:
            # s folded into the matmul's alpha: one kernel, not a matmul and a multiply
            db = torch.addmm(_ZERO.get(g), g.t(), xa, beta=0, alpha=s).to(ctx.b_dtype)
        return dx, dw, dbias, da, db, None, None, None, None


class _Zero:
    """A 0-dim zero per (device, dtype): ``addmm``'s ignored input when ``beta=0`` (no kernel)."""

    def __init__(self) -> None:
        self._zeros: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

    def get(self, like: torch.Tensor) -> torch.Tensor:
        key = (like.device, like.dtype)
        zero = self._zeros.get(key)
        if zero is None:
            zero = self._zeros[key] = torch.zeros((), device=like.device, dtype=like.dtype)
        return zero


_ZERO = _Zero()


class AdapterCache:
    """Each layer's ``A`` and ``s * B`` cast to the compute dtype once per optimizer step.

    Without it every adapted layer casts its fp32 master adapters in the forward, again in the
    recompute of a checkpointed layer and again in the backward: ~9 small kernels per layer and
    step, ~1,800 per step on a 28-layer model, each costing host time where the step is
    host-bound (Qwen3-0.6B). The copies are valid until the weights change: ``watch`` hooks an
    optimizer whose every ``step()`` clears them (fused AdamW does not bump a tensor's version
    counter, so versions alone cannot tell), and each entry also keys on the masters' versions
    and data pointers (a ``load_state_dict`` copy or an FSDP2 re-gather is seen). Until an
    optimizer is watched the cache stays off and every call casts, as before: a caller that
    updates weights some other way cannot read stale copies.

    A model that serves and never trains (``trainer.generate.kernels``) calls ``keep``: one copy per
    layer and adapter (a session's adapters each keep theirs), cast once, refreshed in place when
    the masters change in place (a ``load_state_dict``): a CUDA graph captured over them reads them
    where they are, and sees the new values.
    Without it every decode step cast all of them again: on the Llama-3.1-8B shape 676 of a step's
    ~2,000 kernels.
    """

    def __init__(self) -> None:
        self._entries: dict[Any, tuple[tuple[Any, ...], torch.Tensor, torch.Tensor]] = {}
        self._hooks: list[Any] = []
        self._kept = False

    @property
    def enabled(self) -> bool:
        return bool(self._hooks) or self._kept

    @property
    def kept(self) -> bool:
        """Whether ``keep`` turned it on (a served model: nothing trains it)."""
        return self._kept

    def keep(self) -> None:
        """Turn the cache on for weights no optimizer updates (serving); see the class docstring."""
        self._kept = True

    def watch(self, optimizer: torch.optim.Optimizer) -> None:
        """Clear the copies after every ``optimizer.step()``; turns the cache on."""
        self._hooks.append(optimizer.register_step_post_hook(lambda *_: self.clear()))

    def clear(self) -> None:
        self._entries.clear()

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self._kept = False
        self.clear()

    def get(
        self, layer: nn.Module, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``A`` and ``s * B`` in ``dtype``, cast now or reused from earlier in this step."""
        stamp = (lora_a._version, lora_b._version, lora_a.data_ptr(), lora_b.data_ptr(), dtype, scaling)
        # kept (serving): one entry per layer and adapter; watched (training): one per layer, replaced
        key = (id(layer), lora_a.data_ptr(), dtype) if self._kept else id(layer)
        entry = self._entries.get(key) if self.enabled else None
        if entry is not None and entry[0] == stamp:
            return entry[1], entry[2]
        if entry is not None and self._kept:
            # kept (serving): the masters changed in place; refresh the copies where they are, so a
            # CUDA graph captured over them reads the new values, not freed memory
            with torch.no_grad():
                entry[1].copy_(lora_a.detach())
                entry[2].copy_(torch.mul(lora_b.detach(), scaling))
            self._entries[key] = (stamp, entry[1], entry[2])
            return entry[1], entry[2]
        with torch.no_grad():
            a = lora_a.detach().to(dtype)
            sb = torch.mul(lora_b.detach(), scaling).to(dtype)
        if self.enabled:
            self._entries[key] = (stamp, a, sb)
        return a, sb


class _LoraUpdate(torch.autograd.Function):
    """``base_out + (x @ A^T) @ sB^T`` for a base layer with its own autograd (e.g. 4-bit);
    ``a`` / ``sb`` as in ``_FusedLoraLinear``."""

    @staticmethod
    def forward(
        ctx: Any,
        base_out: torch.Tensor,
        x: torch.Tensor,
        lora_a: torch.Tensor,
        lora_b: torch.Tensor,
        scaling: float,
        dtype: torch.dtype,
        a: torch.Tensor,
        sb: torch.Tensor,
    ) -> torch.Tensor:
        x_shape, out_shape = x.shape, base_out.shape
        x2 = x.reshape(-1, x_shape[-1]).to(dtype)
        xa = x2 @ a.t()
        out = torch.addmm(base_out.reshape(-1, out_shape[-1]).to(dtype), xa, sb.t())
        ctx.save_for_backward(x2, a, sb, xa)
        ctx.scaling, ctx.dtype, ctx.x_shape = scaling, dtype, x_shape
        ctx.base_dtype, ctx.x_dtype = base_out.dtype, x.dtype
        ctx.a_dtype, ctx.b_dtype = lora_a.dtype, lora_b.dtype
        return out.view(*out_shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x2, a, sb, xa = ctx.saved_tensors
        dtype, s = ctx.dtype, ctx.scaling
        need = ctx.needs_input_grad
        g = grad_out.reshape(-1, grad_out.shape[-1]).to(dtype)
        gb = g @ sb
        dbase = grad_out.to(ctx.base_dtype) if need[0] else None
        dx = (gb @ a).view(ctx.x_shape).to(ctx.x_dtype) if need[1] else None
        da = (gb.t() @ x2).to(ctx.a_dtype) if need[2] else None
        db = torch.addmm(_ZERO.get(g), g.t(), xa, beta=0, alpha=s).to(ctx.b_dtype) if need[3] else None
        return dbase, dx, da, db, None, None, None, None


def _plain_adapter(layer: nn.Module, kwargs: dict[str, Any]) -> str | None:
    """The one active adapter when ``layer`` is in the plain state the fused path covers, else None."""
    if kwargs or layer.disable_adapters or layer.merged:
        return None
    active = [a for a in layer.active_adapters if a in layer.lora_A]
    if len(active) != 1:
        return None
    name = active[0]
    if name in getattr(layer, "lora_variant", {}) or layer.lora_B[name].bias is not None:
        return None  # DoRA & co., or peft's lora_bias: peft's forward has them
    dropout = layer.lora_dropout[name]
    if not isinstance(dropout, nn.Identity) and not (
        isinstance(dropout, nn.Dropout) and (dropout.p == 0 or not dropout.training)
    ):
        return None
    return name


def fused_forward(layer: nn.Module, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """The patched ``forward`` of a peft LoRA linear layer (see the module docstring)."""
    name = _plain_adapter(layer, kwargs) if not args else None
    if name is None:
        return layer._ftq_peft_forward(x, *args, **kwargs)
    base = layer.get_base_layer()
    lora_a = layer.lora_A[name].weight
    lora_b = layer.lora_B[name].weight
    scaling = float(layer.scaling[name])
    if _plain_linear(base):
        dtype = _compute_dtype(x, base.weight.dtype)
        a, sb = layer._ftq_adapter_cache.get(layer, lora_a, lora_b, scaling, dtype)
        if layer._ftq_adapter_cache.kept and not torch.is_grad_enabled():
            out = serve_forward(layer, vars(layer).get("_ftq_siblings"), x, name, dtype, a, sb)
            if out is not None:
                return out
        return _FusedLoraLinear.apply(x, base.weight, base.bias, lora_a, lora_b, scaling, dtype, a, sb)
    base_out = base(x)
    dtype = _compute_dtype(x, base_out.dtype)
    a, sb = layer._ftq_adapter_cache.get(layer, lora_a, lora_b, scaling, dtype)
    return _LoraUpdate.apply(base_out, x, lora_a, lora_b, scaling, dtype, a, sb).to(base_out.dtype)


@dataclass
class InstallResult:
    """What ``install`` patched; ``uninstall`` restores peft's forwards."""

    layers: list[nn.Module] = field(default_factory=list)
    fused_base: int = 0
    """Layers whose base is a plain ``nn.Linear`` (base + update in one function)."""
    cache: AdapterCache = field(default_factory=AdapterCache)
    """The layers' compute-dtype adapter copies (off until ``cache.watch(optimizer)``)."""

    def uninstall(self) -> None:
        self.cache.close()
        for layer in self.layers:
            layer.__dict__.pop("_ftq_adapter_cache", None)
            previous = layer.__dict__.pop("_ftq_peft_forward", None)
            layer.__dict__.pop("forward", None)
            if previous is not None and layer.__dict__.pop("_ftq_had_forward", False):
                layer.forward = previous  # an instance-level forward someone set before install
        self.layers = []

    def describe(self) -> str:
        other = len(self.layers) - self.fused_base
        return (
            f"{len(self.layers)} LoRA linear layers fused in the compute dtype "
            f"({self.fused_base} with the base matmul, {other} update-only over their own base)"
        )


def lora_linear_layers(model: nn.Module) -> list[nn.Module]:
    """Every peft LoRA layer of ``model`` that adapts a linear map (``lora_A``/``lora_B`` are linears)."""
    try:
        from peft.tuners.lora.layer import LoraLayer
    except ImportError:  # peft missing: nothing to patch
        return []
    found = []
    for module in model.modules():
        if not isinstance(module, LoraLayer) or not hasattr(module, "lora_A"):
            continue
        if getattr(module, "fan_in_fan_out", False):
            continue  # Conv1D-style (GPT-2) weights: stored transposed
        if not all(isinstance(m, nn.Linear) for m in module.lora_A.values()):
            continue  # embeddings, convolutions
        base = module.get_base_layer()
        if not hasattr(base, "in_features") or isinstance(base, nn.Embedding):
            continue
        if hasattr(module, "parameter_name"):
            continue  # peft's parameter LoRA (expert weights): trainer.features.moe.routing handles those
        found.append(module)
    return found


def install(model: nn.Module) -> InstallResult:
    """Patch every plain peft LoRA linear layer of ``model`` to the fused path (idempotent)."""
    result = InstallResult()
    for layer in lora_linear_layers(model):
        if "_ftq_peft_forward" not in vars(layer):
            layer._ftq_had_forward = "forward" in vars(layer)
            layer._ftq_peft_forward = layer.forward
            layer.forward = types.MethodType(fused_forward, layer)
        layer._ftq_adapter_cache = result.cache
        result.layers.append(layer)
        if _plain_linear(layer.get_base_layer()):
            result.fused_base += 1
    return result
