"""Load the base model and tokenizer, and wrap them for the chosen method.

- ``model_facts``: what the plan needs (model type, MoE, SDPA support) from the config alone.
- ``load_tokenizer`` / ``load_model``: real ``from_pretrained``: a local directory, or a hub id
  that Hugging Face resolves as usual (cache, then the hub when online).
- ``prepare_for_training``: LoRA via peft (or every weight for ``full``; for ``qlora`` over the
  NF4 base ``load_model`` quantized, see ``freeze_quantized_base``), gradient checkpointing with
  ``use_reentrant=False``.
- ``packed_forward`` / ``packed_loss`` / ``loss_sum`` (the only ways the trainer calls the
  model) live in ``trainer.features.loss.packed_forward`` and are re-exported here.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from trainer.config import LoraConfig, TrainConfig
from trainer.errors import ConfigError, ModelNotFoundError
from trainer.features.loss.packed_forward import (  # re-exported: callers import the packed calls from here too
    LOSS_FUSED,
    LOSS_PLAIN,
    loss_sum,
    packed_attention_masks,
    packed_forward,
    packed_loss,
)
from trainer.plan.types import ModelFacts, Plan

__all__ = [
    "LOSS_FUSED",
    "LOSS_PLAIN",
    "apply_lora",
    "count_parameters",
    "enable_gradient_checkpointing",
    "freeze_quantized_base",
    "load_model",
    "load_tokenizer",
    "loss_sum",
    "model_facts",
    "nf4_config",
    "packed_attention_masks",
    "packed_forward",
    "packed_loss",
    "prepare_for_training",
]

_DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}


def _load_config(name_or_path: str, trust_remote_code: bool) -> Any:
    from transformers import AutoConfig

    looks_local = name_or_path.startswith((".", "/", "~")) or os.path.exists(
        name_or_path
    )
    if looks_local and not Path(name_or_path).expanduser().is_dir():
        raise ModelNotFoundError(
            f"model {name_or_path!r}: no such directory; point model.name_or_path at a model dir"
        )
    try:
        return AutoConfig.from_pretrained(
            name_or_path, trust_remote_code=trust_remote_code
        )
    except (OSError, ValueError) as exc:
        raise ModelNotFoundError(
            f"model {name_or_path!r}: cannot load its config.json ({exc}); name a local model directory "
            "or a hub id available in the Hugging Face cache"
        ) from exc


def model_facts(config: TrainConfig) -> ModelFacts:
    """Read the model's config (no weights) and say what the plan needs to know."""
    from transformers import AutoModelForCausalLM

    from trainer.features.attention import packed as attention
    from trainer.plan import memory

    hf_config = _load_config(config.model.name_or_path, config.model.trust_remote_code)
    experts = getattr(hf_config, "num_local_experts", None) or getattr(
        hf_config, "num_experts", None
    )
    try:
        model_class = AutoModelForCausalLM._model_mapping[type(hf_config)]
        supports_sdpa = bool(getattr(model_class, "_supports_sdpa", False))
    except KeyError:
        supports_sdpa = False  # remote code or an unknown class: eager always works
    shell, shell_error = _meta_shell(hf_config, config)
    text = (
        hf_config.get_text_config()
        if hasattr(hf_config, "get_text_config")
        else hf_config
    )
    params = None if shell is None else sum(p.numel() for p in shell.parameters())
    return ModelFacts(
        model_type=hf_config.model_type,
        shape=memory.Shape.from_config(hf_config, params),
        is_moe=bool(experts),
        num_layers=getattr(text, "num_hidden_layers", None),
        hidden_size=getattr(text, "hidden_size", None),
        param_count=params,
        **_moe_facts(hf_config, shell, shell_error, bool(experts)),
        supports_sdpa=supports_sdpa,
        packed_attention=attention.model_reason(hf_config),
        head_dim=attention.head_dim(hf_config),
        sliding_window=attention.uses_window(hf_config),
        attention_sinks=attention.has_sinks(hf_config),
        grouped_query=_grouped_query(hf_config),
        fused_loss=_fused_loss_reason(config, shell, shell_error),
    )


def _meta_shell(hf_config: Any, config: TrainConfig) -> tuple[Any, str | None]:
    """The model built on the meta device (no memory, no initialisation), or None and why not.

    The plan's checks read the real classes from it: the LM head (fused loss), the experts
    modules (grouped routing), the parameter count (weights' memory, offload estimate).
    """
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            shell = AutoModelForCausalLM.from_config(
                hf_config, trust_remote_code=config.model.trust_remote_code
            )
    except Exception as exc:  # noqa: BLE001 - a model we cannot build abstractly gets the safe paths
        return (
            None,
            f"its class cannot be built from the config ({type(exc).__name__}: {exc})",
        )
    return shell, None


def _moe_facts(
    hf_config: Any, shell: Any, shell_error: str | None, is_moe: bool
) -> dict[str, Any]:
    """``moe_blocks``, ``moe_family`` and ``moe_routing`` (why grouped routing cannot run) for the plan."""
    if not is_moe:
        return {}
    from trainer.features.moe import routing as moe_routing

    why = moe_routing.supported(hf_config)
    if why is not None:
        return {"moe_routing": why}
    if shell is None:
        return {"moe_routing": shell_error}
    found = moe_routing.experts_modules(shell)
    if not found:
        return {"moe_routing": moe_routing.supported(shell)}
    family = moe_routing.FAMILIES.get(
        type(found[0][1]).__name__, type(found[0][1]).__name__
    )
    return {"moe_blocks": len(found), "moe_family": family}


def _grouped_query(hf_config: Any) -> bool:
    text = (
        hf_config.get_text_config()
        if hasattr(hf_config, "get_text_config")
        else hf_config
    )
    heads = getattr(text, "num_attention_heads", None)
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    return bool(heads and kv_heads and kv_heads < heads)


def _fused_loss_reason(
    config: TrainConfig, shell: Any, shell_error: str | None
) -> str | None:
    """``trainer.features.loss.fused.supported`` on the model as the trainer will wrap it, without weights.

    ``shell`` is the model on the meta device (``_meta_shell``), so the check sees the real head
    class, bias and logit scaling. A LoRA adapter on the head (``lm_head`` among
    ``lora.target_modules``) makes it a peft layer, which the fused loss refuses.
    """
    from trainer.features.loss import fused as fused_loss

    if config.method != "full" and any(
        t.split(".")[-1] == "lm_head" for t in config.lora.target_modules
    ):
        return "lora.target_modules adapts lm_head, and the fused loss needs a plain Linear head"
    if shell is None:
        return f"{shell_error} to check the head"
    return fused_loss.supported(shell)


def load_tokenizer(config: TrainConfig) -> Any:
    from transformers import AutoTokenizer

    _load_config(
        config.model.name_or_path, config.model.trust_remote_code
    )  # same clear error as the model
    tokenizer = AutoTokenizer.from_pretrained(
        config.model.name_or_path, trust_remote_code=config.model.trust_remote_code
    )
    if tokenizer.eos_token_id is None:
        raise ModelNotFoundError(
            f"model {config.model.name_or_path!r}: its tokenizer has no eos token"
        )
    return tokenizer


def load_model(
    config: TrainConfig, plan: Plan, device: torch.device
) -> torch.nn.Module:
    """``from_pretrained`` in the plan's dtype and attention backend, on ``device``, in train mode.

    ``qlora`` loads every linear layer but the head as a bitsandbytes NF4 ``Linear4bit``
    (``quantization_config``), quantized one tensor at a time while loading, straight onto
    ``device``; the rest (embeddings, norms, head) stays in the plan's dtype.

    Full fine-tuning sharded with FSDP2 loads in float32: the shards are the fp32 master weights
    AdamW updates, gathered in the plan's dtype for compute (``trainer.parallel.strategy.apply_fsdp``).
    """
    from transformers import AutoModelForCausalLM

    kwargs: dict[str, Any] = {
        "dtype": torch.float32 if _fp32_masters(config, plan) else _DTYPES[plan.dtype],
        "attn_implementation": plan.hf_attention,
        "trust_remote_code": config.model.trust_remote_code,
    }
    if config.method == "qlora":
        kwargs["quantization_config"] = nf4_config(_DTYPES[plan.dtype])
        kwargs["device_map"] = {"": _device_map_target(device)}
    model = AutoModelForCausalLM.from_pretrained(config.model.name_or_path, **kwargs)
    if config.method != "qlora":
        model.to(device)
    model.config.use_cache = False
    model.train()
    return model


def _fp32_masters(config: TrainConfig, plan: Plan) -> bool:
    """Full fine-tuning under FSDP2 (the plan's ``parallelism`` backend): fp32 master weights."""
    sharded = any(d.name == "parallelism" and d.backend == "fsdp2" for d in plan.decisions)
    return sharded and config.method == "full"


def nf4_config(compute_dtype: torch.dtype) -> Any:
    """The QLoRA quantization (Dettmers et al. 2023): NF4 weights, double-quantized block scales.

    NF4 with blocks of 64 and 8-bit double-quantized absmax costs ~4.13 bits per weight; the
    4-bit matmuls dequantize to ``compute_dtype`` (the plan's dtype: bf16 on a bf16 GPU).
    """
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=compute_dtype,
    )


def _device_map_target(device: torch.device) -> int | str:
    """``device`` as a device map names it: a GPU by its index (``cuda`` alone names none), else its type."""
    if device.type == "cuda":
        return torch.cuda.current_device() if device.index is None else device.index
    return device.type


def prepare_for_training(
    model: torch.nn.Module, config: TrainConfig
) -> torch.nn.Module:
    """Apply the method (LoRA adapters or full fine-tuning); ``gradient_checkpointing: on`` also
    checkpoints every layer here (for callers without a plan). Under a plan, the activation policy
    (``trainer.features.checkpointing.policy``, installed after this) sets each layer's checkpointing."""
    if config.gradient_checkpointing == "on":
        enable_gradient_checkpointing(model)
    if config.method == "full":
        for p in model.parameters():
            p.requires_grad_(True)
        return model
    if config.method == "qlora":
        freeze_quantized_base(model)
    return apply_lora(model, config.lora)


def enable_gradient_checkpointing(model: torch.nn.Module) -> None:
    """Recompute each decoder layer in backward, non-reentrant.

    Non-reentrant checkpointing gives the LoRA weights inside a layer their gradients even when
    the layer's input needs none (frozen embeddings), so no input-requires-grad hook is needed.
    """
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def freeze_quantized_base(model: torch.nn.Module) -> torch.nn.Module:
    """Ready a 4-bit base for LoRA: every base weight frozen, every dtype left as loaded.

    This replaces peft's ``prepare_model_for_kbit_training``, which does three things that hurt
    here. It casts every bf16 weight that is not 4-bit (embeddings, head, norms) to fp32: +3.1 GB
    for Qwen3-14B's embeddings and head, and fp32 hidden states out of every fp32 norm. It
    re-enables gradient checkpointing without ``use_reentrant``, replacing ours: torch then runs
    the reentrant variant, warning on every call. And it hooks the embeddings so that their
    output requires grad, without which reentrant checkpointing would give the LoRA weights no
    gradients; non-reentrant checkpointing needs no such hook. The fp32 upcast is a
    float16-era stability measure: bf16 has fp32's range, the frozen norms compute their
    statistics in fp32 inside the module anyway, and the loss is fp32 (``trainer.features.loss.fused``).

    LoRA weights stay what peft makes them, fp32 master weights (AdamW state in fp32, so
    updates far below a weight's bf16 spacing are not lost), and are computed in the bf16
    compute dtype: by ``trainer.features.lora_kernel.fused`` (update-only path over the 4-bit base) or by peft
    under autocast.

    Raises:
        ValueError: ``model`` has no 4-bit layers (it was not loaded with ``nf4_config``).
    """
    if not any(type(p).__name__ == "Params4bit" for p in model.parameters()):
        raise ValueError(
            "method=qlora: the loaded model has no bitsandbytes 4-bit weights; load it with "
            "quantization_config=trainer.model.load.nf4_config(...)"
        )
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def apply_lora(model: torch.nn.Module, lora: LoraConfig) -> torch.nn.Module:
    """Wrap ``model`` with peft LoRA adapters; only the adapters are trainable afterwards.

    ``all-linear`` means every linear projection but the head AND, on a MoE model, the 3-D expert
    weights (``experts.gate_up_proj`` / ``down_proj``, via peft ``target_parameters`` from
    ``trainer.features.moe.routing.expert_lora_targets``): they are most of a MoE model's weights, but
    not ``nn.Linear``, so ``all-linear`` alone would leave them frozen. Explicit module names
    adapt exactly those modules (experts only if named through their own config elsewhere).

    Dropout: peft's parameter LoRA cannot apply dropout (``B @ A @ dropout(x)`` cannot be folded
    into the weight it parametrizes) and refuses ``lora_dropout != 0``, and one peft config has
    one dropout for every target. So ``all-linear`` on a MoE model needs ``lora.dropout == 0``;
    a nonzero dropout is refused with the two ways out, rather than silently leaving the
    experts untrained.

    Raises:
        ConfigError: a target module is missing, or the dropout/expert conflict above.
    """
    import peft

    from trainer.features.moe import routing as moe_routing

    all_linear = lora.target_modules == ("all-linear",)
    targets: str | list[str] = "all-linear" if all_linear else list(lora.target_modules)
    expert_targets = moe_routing.expert_lora_targets(model) if all_linear else []
    if expert_targets and lora.dropout:
        raise ConfigError(
            f"lora.dropout={lora.dropout} with target_modules all-linear on a MoE model: LoRA on the "
            f"expert weights ({', '.join(expert_targets)}) cannot use dropout. Set lora.dropout to 0, "
            "or list lora.target_modules explicitly (e.g. q_proj, k_proj, v_proj, o_proj) to leave "
            "the experts frozen"
        )
    extra: dict[str, Any] = (
        {"target_parameters": expert_targets} if expert_targets else {}
    )
    peft_config = peft.LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=targets,
        task_type="CAUSAL_LM",
        **extra,
    )
    try:
        with _known_peft_warnings_ignored():
            return peft.get_peft_model(model, peft_config)
    except ValueError as exc:  # peft: "Target modules {...} not found in the base model"
        raise ConfigError(f"lora.target_modules: {exc}") from exc


@contextlib.contextmanager
def _known_peft_warnings_ignored() -> Iterator[None]:
    """Silence the two warnings peft's ``get_peft_model`` gives on our path (neither is ours to fix)."""
    with warnings.catch_warnings():
        # peft <= 0.21 reads the deprecated `is_gradient_checkpointing` (transformers >= 5.2x warns).
        warnings.filterwarnings(
            "ignore",
            message=".*is_gradient_checkpointing.*",
            category=FutureWarning,
        )
        # peft 0.21 converts all-linear on Qwen3-MoE-style fused experts itself (gate_up_proj
        # at rank 2r), then checks that rank/alpha pattern against module names only and
        # warns it was ignored; it is applied (the expert wrappers get the 2r rank).
        warnings.filterwarnings(
            "ignore",
            message=r"The following (rank|alpha)_pattern keys did not match any targeted module",
            category=RuntimeWarning,
        )
        yield


def count_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """``(all parameters, trainable parameters)``; a 4-bit weight counts its logical elements."""
    from trainer.training.metrics import param_numel

    total = trainable = 0
    for p in model.parameters():
        n = param_numel(p)
        total += n
        if p.requires_grad:
            trainable += n
    return total, trainable
