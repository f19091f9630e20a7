"""Fused elementwise ops on a loaded HF model: RMSNorm and the Llama-form MLP's SwiGLU.

Why: on the Llama-3.1-8B LoRA step, ``aten::mul`` was 12.5% and ``aten::add`` 7% of GPU time,
mostly HF's RMSNorm (fp32 upcast, pow, mean, rsqrt, mul, cast, mul weight) and the MLP's
``act_fn(gate_proj(x)) * up_proj(x)``. ``install`` routes both through one Triton kernel each
way (``trainer.kernels.rmsnorm``, ``trainer.kernels.swiglu``).

What is patched (per-instance ``forward`` overrides, so module names, state-dict keys and peft
wrapping are untouched; ``InstallResult.uninstall`` deletes them):

- RMSNorm modules whose class is in ``NORM_VARIANTS`` (read from each family's
  ``modeling_*.py`` in transformers 5.17-5.23: Llama, Mistral, Mixtral, Qwen2, Qwen2-MoE, Qwen3
  and Qwen3-MoE share ``weight * x_hat.to(in_dtype)``; GPT-OSS and OLMo-2 multiply in fp32 then
  cast; Gemma 1-3 scale by ``1 + weight`` in fp32), Qwen3's ``q_norm``/``k_norm`` (``H`` = head
  dim) included. Each module is also checked when installing: its own ``forward`` and the torch
  form of its variant must give the same bits on random rows in bf16 and in the weight's
  dtype, else it is left as it is (``InstallResult.skipped`` says why).
- MLP modules whose ``forward`` is, by syntax tree, ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``
  and whose ``act_fn`` computes ``F.silu`` exactly (Gemma's GELU MLPs are left as they are).
- RoPE, only when the kernels were chosen: the ``apply_rotary_pos_emb`` function of each
  attention module's modeling file (Llama, Mistral, Qwen2/3, ...: ``q * cos + rotate_half(q) *
  sin``), replaced by ``trainer.kernels.rope.apply_rotary_pos_emb`` when the two give the same
  bits on random CPU inputs (GPT-OSS's half-table form does not, and is left alone). This one is
  a module-level patch (the attention forwards look the function up by name), held by each
  install that made or joined it (``_RopePatches``) and restored when the last one is undone; on
  CPU the replacement runs transformers' formula.

Per call, the kernel runs when the install chose Triton and the tensors fit it (float dtypes,
``H <= 8192``, one device); otherwise the torch form runs, which is the family's eager code op
for op, so on CPU an installed model computes the very same bits as without. Under bf16
autocast the functions take the dtypes they are given (RMSNorm has no autocast op; the MLP's
``gate``/``up`` arrive in bf16 and the SwiGLU runs in bf16, as eager does).

Call after peft wrapping and ``model.to(device)``: ``fused_ops.install(model)``.
"""

from __future__ import annotations

import ast
import inspect
import sys
import textwrap
import types
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from trainer.kernels import rmsnorm, rope, swiglu
from trainer.kernels.rmsnorm import GEMMA, GPT_OSS, LLAMA, Variant

NORM_VARIANTS: dict[str, Variant] = {
    **dict.fromkeys(
        (
            "LlamaRMSNorm",
            "MistralRMSNorm",
            "MixtralRMSNorm",
            "Qwen2RMSNorm",
            "Qwen2MoeRMSNorm",
            "Qwen3RMSNorm",
            "Qwen3MoeRMSNorm",
        ),
        LLAMA,
    ),
    **dict.fromkeys(("GptOssRMSNorm", "Olmo2RMSNorm"), GPT_OSS),
    **dict.fromkeys(("GemmaRMSNorm", "Gemma2RMSNorm", "Gemma3RMSNorm"), GEMMA),
}
"""RMSNorm classes by the eager formula their ``forward`` implements (``trainer.kernels.rmsnorm``)."""

_LLAMA_MLP_FORWARDS = (
    (
        "def forward(self, x):\n"
        "    down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))\n"
        "    return down_proj\n"
    ),
    "def forward(self, x):\n    return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))\n",
)
_MLP_PARTS = ("gate_proj", "up_proj", "down_proj", "act_fn")
_PATCH_ATTR = "_ftq_fused_ops"


@dataclass(frozen=True)
class _Patch:
    """What a patched module's ``forward`` needs, kept on the module."""

    variant: Variant | None
    """The RMSNorm formula; None on an MLP."""
    eps: float
    triton: bool
    """Run the kernel whenever the tensors fit it; False: the torch form always."""


def _norm_forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """The patched ``forward`` of a recognised RMSNorm module."""
    patch: _Patch = getattr(self, _PATCH_ATTR)
    if patch.triton and rmsnorm.can_use_kernel(hidden_states, self.weight):
        return rmsnorm.rms_norm_triton(
            hidden_states, self.weight, patch.eps, patch.variant
        )
    return rmsnorm.rms_norm_torch(hidden_states, self.weight, patch.eps, patch.variant)


def _mlp_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The patched ``forward`` of a Llama-form MLP: gate and up projections, then one fused SwiGLU."""
    patch: _Patch = getattr(self, _PATCH_ATTR)
    # gate before up, as eager evaluates them: LoRA dropout then draws the same numbers
    gate = self.gate_proj(x)
    up = self.up_proj(x)
    if patch.triton and swiglu.can_use_kernel(gate, up):
        return self.down_proj(swiglu.swiglu_triton(gate, up))
    return self.down_proj(swiglu.swiglu_torch(gate, up))


@dataclass
class InstallResult:
    """What ``install`` patched and what it left alone; ``uninstall`` restores the modules."""

    norms: list[nn.Module] = field(default_factory=list)
    mlps: list[nn.Module] = field(default_factory=list)
    triton: bool = False
    """The kernels were chosen (each call still takes the torch form when its tensors do not fit)."""
    why_not_triton: str | None = None
    """Why the torch form was chosen, when ``triton`` is False."""
    skipped: dict[str, str] = field(default_factory=dict)
    """Candidate classes left as they are (class name -> reason)."""
    rope: list[types.ModuleType] = field(default_factory=list)
    """Modeling modules whose ``apply_rotary_pos_emb`` this install holds replaced (``_RopePatches``)."""

    def counts(self) -> dict[str, int]:
        """Patched modules per class name."""
        return dict(Counter(type(m).__name__ for m in (*self.norms, *self.mlps)))

    def uninstall(self) -> None:
        """Restore the original ``forward`` of every module this install patched, and let go of
        its RoPE patches (transformers' function is back once no install holds it)."""
        for module in (*self.norms, *self.mlps):
            _unpatch(module)
        for modeling in self.rope:
            _ROPE.release(modeling)
        self.norms, self.mlps, self.rope = [], [], []

    def describe(self) -> str:
        """One line for the run's log: counts per class, backend and what was left alone."""
        counts = (
            ", ".join(f"{name} {n}" for name, n in sorted(self.counts().items()))
            or "nothing"
        )
        backend = (
            "Triton kernels" if self.triton else f"torch form ({self.why_not_triton})"
        )
        line = (
            f"{len(self.norms)} RMSNorm + {len(self.mlps)} SwiGLU MLP modules fused ({counts}), "
            f"RoPE kernel in {len(self.rope)} modeling files, {backend}"
        )
        if self.skipped:
            line += "; left as they are: " + "; ".join(
                f"{k} ({v})" for k, v in sorted(self.skipped.items())
            )
        return line


def install(model: nn.Module, triton: bool | None = None) -> InstallResult:
    """Patch the recognised RMSNorm and Llama-form MLP modules of ``model`` (see the module docstring).

    Safe to call again: the last call's backend wins. Modules whose ``forward`` someone else
    already overrode on the instance (an accelerate hook, ``trainer.features.offload``) are left alone.

    Args:
        model: a causal LM, a peft model around one, or any module holding such blocks.
        triton: None (default): the kernels when Triton can run on the model's device
            (``rmsnorm.supported``); True: always the kernels (CUDA, or the CPU interpreter under
            ``TRITON_INTERPRET=1``); False: the torch form.

    Raises:
        ValueError: ``triton=True`` and Triton is not installed.
    """
    why_not = _why_not_triton(model, triton)
    result = InstallResult(triton=why_not is None, why_not_triton=why_not)
    for module in model.modules():
        name = type(module).__name__
        if name.endswith("RMSNorm"):
            reason = _patch_norm(module, result.triton)
            target = result.norms
        elif all(hasattr(module, part) for part in _MLP_PARTS):
            reason = _patch_mlp(module, result.triton)
            target = result.mlps
        else:
            continue
        if reason is None:
            target.append(module)
        else:
            result.skipped.setdefault(name, reason)
    if result.triton:
        _patch_rope(model, result)
    return result


def _patch_rope(model: nn.Module, result: InstallResult) -> None:
    """Replace ``apply_rotary_pos_emb`` in the modeling files of ``model``'s attention modules."""
    seen: set[str] = set()
    for module in model.modules():
        if not (type(module).__name__.endswith("Attention") and hasattr(module, "q_proj")):
            continue
        modeling = sys.modules.get(type(module).__module__)
        if modeling is None or modeling.__name__ in seen:
            continue
        seen.add(modeling.__name__)
        if modeling in result.rope:  # this install holds it already
            continue
        why_not = _ROPE.acquire(modeling)
        if why_not is None:
            result.rope.append(modeling)
        elif why_not:
            result.skipped.setdefault(f"{modeling.__name__.rsplit('.', 1)[-1]}.apply_rotary_pos_emb", why_not)


class _RopePatches:
    """transformers' own ``apply_rotary_pos_emb`` of each modeling file that installs replaced,
    and how many installs hold the replacement.

    The patch is process-wide by nature (transformers' attention looks the function up by name in
    its modeling module), so its record is too: one instance, ``_ROPE``. Two installs over models
    of one family share the patch; the last ``release`` puts transformers' function back.
    """

    def __init__(self) -> None:
        self._originals: dict[str, tuple[types.ModuleType, Any]] = {}
        self._holders: Counter[str] = Counter()

    def acquire(self, modeling: types.ModuleType) -> str | None:
        """Patch ``modeling`` (or join the patch in place); None when held, else why not ("" if it has none)."""
        name = modeling.__name__
        if name not in self._originals:
            original = getattr(modeling, "apply_rotary_pos_emb", None)
            if original is None:
                return ""
            if not _same_rope(original):
                return "not transformers' q * cos + rotate_half(q) * sin form"
            modeling.apply_rotary_pos_emb = rope.apply_rotary_pos_emb
            self._originals[name] = (modeling, original)
        self._holders[name] += 1
        return None

    def release(self, modeling: types.ModuleType) -> None:
        """One install lets go of ``modeling``'s patch; the last one restores the original."""
        name = modeling.__name__
        self._holders[name] -= 1
        if self._holders[name] <= 0:
            del self._holders[name]
            module, original = self._originals.pop(name)
            module.apply_rotary_pos_emb = original


_ROPE = _RopePatches()


def _same_rope(fn: Any) -> bool:
    """``fn`` gives the same bits as ``rope.apply_rotary_pos_emb``'s torch form on random inputs."""
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        q = torch.randn(2, 4, 5, 32, generator=gen).to(dtype)
        k = torch.randn(2, 2, 5, 32, generator=gen).to(dtype)
        cos = torch.randn(2, 5, 32, generator=gen).to(dtype)
        sin = torch.randn(2, 5, 32, generator=gen).to(dtype)
        try:
            theirs = fn(q, k, cos, sin)
        except Exception:  # noqa: BLE001 - another signature or shape contract: not this form
            return False
        ours = rope.apply_rotary_pos_emb(q, k, cos, sin)
        if not (
            isinstance(theirs, tuple)
            and len(theirs) == 2
            and all(torch.equal(a, b) for a, b in zip(theirs, ours, strict=True))
        ):
            return False
    return True


def _why_not_triton(model: nn.Module, triton: bool | None) -> str | None:
    if triton is False:
        return "triton=False"
    if triton and rmsnorm.triton is None:
        raise ValueError("triton=True: Triton is not installed (pip install triton)")
    if triton:
        return None
    param = next(model.parameters(), None)
    return rmsnorm.supported(param.device if param is not None else "cpu")


def _set_patch(module: nn.Module, patch: _Patch, forward: Any) -> str | None:
    own = vars(module).get("forward")
    if own is not None and _PATCH_ATTR not in vars(module):
        return "forward is already overridden on the instance"
    setattr(module, _PATCH_ATTR, patch)
    module.forward = types.MethodType(forward, module)
    return None


def _unpatch(module: nn.Module) -> None:
    if _PATCH_ATTR in vars(module):
        del module.forward
        delattr(module, _PATCH_ATTR)


def _patch_norm(module: nn.Module, triton: bool) -> str | None:
    """Patch one RMSNorm module, or say why it is left alone."""
    variant = NORM_VARIANTS.get(type(module).__name__)
    if variant is None:
        return "not a known RMSNorm formula"
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    weight = getattr(module, "weight", None)
    if (
        not isinstance(eps, float)
        or not isinstance(weight, torch.Tensor)
        or weight.dim() != 1
    ):
        return "no 1-D weight and float eps"
    if _PATCH_ATTR not in vars(module):  # a module patched before was checked then
        mismatch = _norm_mismatch(module.forward, weight, eps, variant)
        if mismatch is not None:
            return mismatch
    return _set_patch(module, _Patch(variant, eps, triton), _norm_forward)


def _norm_mismatch(
    forward: Any, weight: torch.Tensor, eps: float, variant: Variant
) -> str | None:
    """None when ``forward`` and the variant's torch form agree bit for bit on random rows.

    Rows in bf16 (where the variants round differently) and in the weight's dtype, with the
    module's own weight, outside autocast.
    """
    if weight.device.type == "meta":
        return "its weight is on the meta device"
    gen = torch.Generator().manual_seed(0)
    for dtype in dict.fromkeys((torch.bfloat16, weight.dtype)):
        x = (torch.randn(4, weight.shape[0], generator=gen) * 3).to(
            device=weight.device, dtype=dtype
        )
        with torch.no_grad(), torch.autocast(weight.device.type, enabled=False):
            want = forward(x)
            got = rmsnorm.rms_norm_torch(x, weight, eps, variant)
        if want.dtype != got.dtype or not torch.equal(want, got):
            return f"its forward differs from the {variant.name} RMSNorm formula on {dtype} rows"
    return None


def _patch_mlp(module: nn.Module, triton: bool) -> str | None:
    """Patch one Llama-form MLP module, or say why it is left alone."""
    if _PATCH_ATTR not in vars(module):
        if _forward_tree(type(module).forward) not in _LLAMA_MLP_TREES:
            return "its forward is not down_proj(act_fn(gate_proj(x)) * up_proj(x))"
        if not _is_silu(module.act_fn):
            return "act_fn is not SiLU"
    return _set_patch(module, _Patch(None, 0.0, triton), _mlp_forward)


def _is_silu(act_fn: Any) -> bool:
    x = torch.linspace(-12.0, 12.0, 97)
    try:
        with torch.no_grad():
            return bool(torch.equal(act_fn(x), F.silu(x)))
    except Exception:  # noqa: BLE001 - an activation that cannot take a CPU tensor is not SiLU to us
        return False


class _RenameArg(ast.NodeTransformer):
    def __init__(self, old: str) -> None:
        self.old = old

    def visit_Name(self, node: ast.Name) -> ast.Name:
        return ast.Name(id="x", ctx=node.ctx) if node.id == self.old else node


def _tree_of_source(source: str) -> str | None:
    """A function's syntax tree without docstring and annotations, its one argument named ``x``."""
    try:
        tree = ast.parse(textwrap.dedent(source))
    except SyntaxError:
        return None
    node = tree.body[0] if tree.body else None
    if not isinstance(node, ast.FunctionDef):
        return None
    args = node.args
    if (
        len(args.args) != 2
        or args.vararg
        or args.kwarg
        or args.kwonlyargs
        or args.defaults
    ):
        return None
    body = node.body
    first = body[0]
    if (
        isinstance(first, ast.Expr)
        and isinstance(first.value, ast.Constant)
        and isinstance(first.value.value, str)
    ):
        body = body[1:]
    renamer = _RenameArg(args.args[1].arg)
    return ast.dump(
        ast.Module(body=[renamer.visit(stmt) for stmt in body], type_ignores=[])
    )


def _forward_tree(fn: Any) -> str | None:
    """``_tree_of_source`` of ``fn``'s source; None when it has none (C, compiled, lambda)."""
    try:
        return _tree_of_source(inspect.getsource(fn))
    except (OSError, TypeError):
        return None


_LLAMA_MLP_TREES = frozenset(_tree_of_source(s) for s in _LLAMA_MLP_FORWARDS)
