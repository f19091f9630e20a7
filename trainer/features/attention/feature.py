"""Packed attention (``ftq_packed``) and its per-batch metadata cache.

Two decisions (two features), one install. ``KERNEL`` picks the attention kernel (the
``attention`` decision, ``choose``):
on CUDA torch's ``varlen_attn``, else our Triton kernel, else SDPA with the block-diagonal mask;
on the CPU SDPA (the varlen kernels need CUDA). ``flex`` is never picked by ``auto`` (its first
step compiles for minutes) but runs when a decision names it. A model packed attention cannot run
(Gemma 2's soft-capping, a bidirectional config) keeps its own attention with packed block masks:
the decision is disabled with backend ``transformers_sdpa`` / ``transformers_eager``.

``CACHE`` turns ``packed_metadata_cache`` into a decision whose backend is that kernel
(``decide_cache``) and installs it (``CACHE.apply``): ``ftq_packed`` attention on the named kernel, with the
metadata built once per batch (enabled) or rebuilt in every layer from the device position ids
(disabled: the honest "before"). The handle builds each micro-batch's metadata from the host
lengths (``metadata``); without packed attention it returns None and ``trainer.model.load`` passes
positions and block masks instead.
"""

from __future__ import annotations

from typing import Any

import torch

from trainer.features.attention.packed import PackedAttention, head_dim, unwrap_model
from trainer.plan.feature import Context, Target, how, off, unavailable
from trainer.plan.hardware import Hardware
from trainer.kernels.attention import SUPPORTED_HEAD_DIMS
from trainer.data.packed_metadata import BACKENDS as PACKED_BACKENDS
from trainer.data.packed_metadata import PREFIX_BACKENDS
from trainer.data.packed_metadata import AnyPackedMetadata
from trainer.plan.types import Decision, ModelFacts

NAME = "packed_metadata_cache"
AUTO_ORDER_CUDA = ("torch_varlen", "triton", "sdpa")
"""Kernels ``choose`` tries on CUDA, in order: torch's varlen_attn (FA-class, torch >= 2.12),
our Triton kernel (head dims 64 and 128), SDPA with the block mask."""


def supported(hw: Hardware, facts: ModelFacts) -> str | None:
    """Why packed attention cannot run this model (SDPA runs it on any machine), or None."""
    if facts.packed_attention is not None:
        return f"packed attention cannot run this model ({facts.packed_attention})"
    return None


def backend_missing(backend: str, hw: Hardware, facts: ModelFacts) -> str | None:
    """Why attention kernel ``backend`` cannot run this model on ``hw``, or None when it can."""
    if backend not in PACKED_BACKENDS:
        return f"unknown attention backend {backend!r}; use one of {', '.join(PACKED_BACKENDS)}"
    if backend == "sdpa":
        return None
    if hw.device != "cuda":
        return f"the {backend} backend needs a CUDA device, training runs on {hw.device}"
    if backend == "flex":
        if "flex_attention" not in hw.attention_kernels:
            return f"torch {hw.torch_version} has no flex attention"
        return None
    if backend == "triton":
        if hw.triton_varlen is not None:
            return hw.triton_varlen
        if facts.head_dim is not None and facts.head_dim not in SUPPORTED_HEAD_DIMS:
            return f"head dim {facts.head_dim} is not one of {', '.join(map(str, SUPPORTED_HEAD_DIMS))}"
        return None
    return _torch_varlen_missing(hw, facts)


def _torch_varlen_missing(hw: Hardware, facts: ModelFacts) -> str | None:
    torch_ = f"torch {hw.torch_version}"
    if "varlen" not in hw.attention_kernels:
        return f"{torch_} has no torch.nn.attention.varlen (needs torch >= 2.12)"
    if facts.sliding_window and "window_size" not in hw.varlen_options:
        return f"{torch_}'s varlen_attn has no window_size, and {facts.model_type} uses a sliding window"
    if facts.attention_sinks and "return_aux" not in hw.varlen_options:
        return f"{torch_}'s varlen_attn cannot return the log-sum-exp attention sinks need"
    if facts.grouped_query and "enable_gqa" not in hw.varlen_options:
        return f"{torch_}'s varlen_attn has no enable_gqa, and {facts.model_type} uses grouped-query attention"
    return None


def choose(hw: Hardware, facts: ModelFacts) -> Decision:
    """The ``attention`` decision: the fastest packed kernel here, or the model's own attention."""
    if facts.packed_attention is not None:
        own = "transformers_sdpa" if facts.supports_sdpa else "transformers_eager"
        return Decision(
            "attention",
            "auto",
            False,
            own,
            f"packed attention cannot run {facts.model_type} ({facts.packed_attention}); "
            f"its own {own.split('_')[1]} attention with packed block masks built from position ids",
        )
    if hw.device != "cuda":
        return Decision(
            "attention",
            "auto",
            True,
            "sdpa",
            f"{hw.device}: SDPA with the packed block-diagonal mask (the varlen kernels need CUDA)",
        )
    skipped: list[str] = []
    for backend in AUTO_ORDER_CUDA:
        missing = backend_missing(backend, hw, facts)
        if missing is None:
            return Decision("attention", "auto", True, backend, _why(backend, skipped))
        skipped.append(f"not {backend}: {missing}")
    raise AssertionError(f"sdpa always runs; skipped {skipped}")


def _why(backend: str, skipped: list[str]) -> str:
    what = {
        "torch_varlen": "torch varlen_attn over cu_seqlens (no cross-sample block",
        "triton": "our Triton flash attention over cu_seqlens (no cross-sample block",
        "sdpa": "SDPA with the packed block-diagonal mask (",
    }[backend]
    rest = "; ".join(skipped)
    if backend == "sdpa":
        return what + rest + ")"
    return what + (f"; {rest})" if rest else ")")


def decide_cache(requested: str, hw: Hardware, facts: ModelFacts, kernel: Decision) -> Decision:
    """The ``packed_metadata_cache`` decision; its backend is the kernel the metadata feeds."""
    packed = kernel.backend in PACKED_BACKENDS
    if requested == "off":
        if packed:
            return off(
                NAME, kernel.backend, "off in the job: metadata rebuilt in every layer from the device position ids"
            )
        return off(NAME)
    missing = supported(hw, facts)
    if missing is not None or not packed:
        return unavailable(NAME, requested, missing or f"{kernel.backend} attention has no packed metadata", hw)
    return Decision(
        NAME,
        requested,
        True,
        kernel.backend,
        f"{how(requested)}: cu_seqlens, max_seqlen and positions built once per batch from host lengths, "
        f"reused by every layer ({kernel.backend} attention)",
    )


class PackedAttentionHandle:
    """``ftq_packed`` attention installed on a model; builds each micro-batch's metadata."""

    def __init__(self, model: torch.nn.Module, backend: str, cache: bool) -> None:
        self._attention = PackedAttention(backend, cache=cache)
        self._attention.install(model)
        self._head_dim = head_dim(unwrap_model(model).config)

    @property
    def takes_prefixes(self) -> bool:
        """Whether micro-batches may share prefixes (``trainer.data.packed_metadata.PREFIX_BACKENDS``;
        ``torch_varlen`` runs them on the Triton kernel, which must run here and take the head dim)."""
        if not self._attention.cache or self._attention.backend not in PREFIX_BACKENDS:
            return False
        if self._attention.backend == "torch_varlen":
            try:  # a broken Triton install must cost the sharing only, as hardware.detect treats it
                from trainer.kernels.attention import supported as triton_supported

                return triton_supported(None, self._head_dim) is None
            except Exception:  # noqa: BLE001
                return False
        return True

    def metadata(self, lengths: Any, device: torch.device, prefixes: Any = None) -> AnyPackedMetadata:
        """One packed row's metadata from its host lengths (no device sync)."""
        return self._attention.metadata(lengths, device, prefixes)

    def remove(self) -> None:
        self._attention.uninstall()

    def describe(self) -> str:
        how_built = "once per batch" if self._attention.cache else "in every layer"
        return f"packed attention: {self._attention.backend}, metadata built {how_built}"


class ModelAttention:
    """The twin for a model that keeps its own attention: no metadata, nothing installed."""

    takes_prefixes = False

    def metadata(self, lengths: Any, device: torch.device, prefixes: Any = None) -> None:
        if prefixes is not None:
            raise ValueError("shared prefixes need packed attention; this model runs its own")
        return None

    def remove(self) -> None:
        pass

    def describe(self) -> None:
        return None


class AttentionKernel:
    """The ``attention`` decision: which kernel packed attention runs on (installed by ``CACHE``)."""

    name = "attention"

    def supported(self, ctx: Context) -> str | None:
        return None  # SDPA, or the model's own attention, always runs

    def decide(self, ctx: Context) -> Decision:
        return choose(ctx.hw, ctx.facts)


class PackedMetadataCache:
    """The ``packed_metadata_cache`` switch and the install of packed attention on its kernel."""

    name = NAME

    def supported(self, ctx: Context) -> str | None:
        return supported(ctx.hw, ctx.facts)

    def decide(self, ctx: Context) -> Decision:
        return decide_cache(ctx.job.switch(NAME), ctx.hw, ctx.facts, ctx.decision(KERNEL.name))

    def apply(
        self, model: torch.nn.Module, decision: Decision, target: Target
    ) -> PackedAttentionHandle | ModelAttention:
        """Install what a ``packed_metadata_cache`` decision says (see the module docstring)."""
        if decision.backend not in PACKED_BACKENDS:
            return ModelAttention()
        return PackedAttentionHandle(model, decision.backend, cache=decision.enabled)


KERNEL, CACHE = AttentionKernel(), PackedMetadataCache()
