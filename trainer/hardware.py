"""What this machine can do, and which optimizations a run uses on it: ``detect`` then ``plan``.

``detect()`` probes once (cached, never at import) and returns a frozen ``Hardware``.
``plan(hardware, optimizations, config, model)`` is a small pure function from those facts to a
``Plan``: one ``Decision(name, enabled, backend, reason)`` per optimization switch, plus the
attention backend, the loss kernel and the compute dtype. Rules for every switch:

- ``off``  -> disabled, reason "off in the job".
- ``auto`` -> enabled when it can run here and is built; otherwise disabled with the reason.
- ``on``   -> enabled, or ``PlanError`` before any training, naming the hardware and the fix.

What a switch needs is written once in ``_requirement``; which optimizations exist in this build
is ``BUILT_OPTIMIZATIONS`` (the modules that implement them add their name there as they land),
so a plan never claims something the trainer would not actually run.

Attention: every model that ``trainer.attention`` can run (causal, no logit soft-capping) trains
through ``ftq_packed`` attention over per-batch packed metadata, on the fastest backend here (CUDA:
torch's ``varlen_attn``, else our Triton kernel, else SDPA with the block-diagonal mask; CPU: SDPA).
``packed_metadata_cache`` only decides whether that metadata is built once per batch (``on``) or
rebuilt in every layer from the device position ids (``off``, the honest "before"). A model packed
attention cannot run (Gemma 2's soft-capping, a bidirectional config) keeps transformers' own
attention with the packed block masks of ``trainer.model.packed_attention_masks``; then the cache
has nothing to cache (``auto`` -> off with that reason, ``on`` -> ``PlanError``).

Loss: ``fused_chunked_ce`` (``trainer.fused_loss``: chunked LM head + cross-entropy, no full
logits) when ``ModelFacts.fused_loss`` is None, else ``torch_cross_entropy`` on the full logits.

Activation offload and the reload (``_offload_decisions``): ``offload_activations`` ``auto`` is on
when plain checkpointing's layer inputs (``trainer.offload.estimate`` at ``data.batch_tokens``)
would not fit in ``ACTIVATION_SHARE`` of the GPU memory left after the weights, and host memory
holds them; ``double_buffered_reload`` goes with it unless asked off or the second buffer (whose
size the reason names) does not fit. MoE routing (``_moe_decision``): on for every recognised MoE
block, backend ``grouped_mm`` (bf16, CUDA sm80+) or ``loop``, Triton pieces only on CUDA; ``on``
for a dense model is a ``PlanError``.

``capabilities(hw, config)`` answers, per switch, whether ``on`` can be honoured here at all (for
any model); ``python -m trainer detect --json`` prints it, workers store it, and the API refuses a
job whose forced ``on`` no live worker can honour.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from dataclasses import dataclass
from functools import cache
from typing import Any

from trainer.config import Optimizations, TrainConfig
from trainer.errors import PlanError

BUILT_OPTIMIZATIONS: frozenset[str] = frozenset(
    {
        "packed_metadata_cache",
        "offload_activations",
        "double_buffered_reload",
        "moe_grouped_routing",
    }
)

SWITCHES: tuple[str, ...] = (
    "packed_metadata_cache",
    "double_buffered_reload",
    "moe_grouped_routing",
    "offload_activations",
)
"""Every optimization switch the plan decides (``Optimizations`` fields + ``offload_activations``)."""

PACKED_BACKENDS: tuple[str, ...] = ("triton", "torch_varlen", "sdpa", "flex")
"""Attention backends of ``ftq_packed`` (``trainer.packed_metadata.BACKENDS``, kept here so the
plan imports no torch)."""
TRITON_HEAD_DIMS: tuple[int, ...] = (64, 128)
"""Head dims our Triton kernel compiles for (``trainer.kernels.flash_varlen.SUPPORTED_HEAD_DIMS``)."""
LOSS_FUSED, LOSS_PLAIN = "fused_chunked_ce", "torch_cross_entropy"
LORA_FUSED, LORA_PEFT = "ftq_fused_lora", "peft"
"""LoRA linear kernels: ``trainer.lora_fused`` (compute dtype, update fused into the base matmul) or peft's."""
"""Optimization switches implemented in this build (names of ``trainer.config.Optimizations`` fields)."""

# Dense bf16 tensor-core peak in FLOP/s by GPU name, from the vendors' data sheets (no sparsity).
# Matched by substring in order, so the more specific names come first.
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("GB200", 2500e12),
    ("B200", 2250e12),
    ("H200", 989e12),
    ("GH200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),
    ("H800", 989e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("L40", 181e12),
    ("A6000", 155e12),
    ("L4", 121e12),
    ("A10G", 70e12),
    ("A10", 125e12),
    ("RTX 4090", 165e12),
    ("RTX 3090", 71e12),
)


@dataclass(frozen=True)
class Hardware:
    device: str
    """``cuda`` or ``cpu``: where training runs."""
    name: str
    """GPU name (``torch.cuda.get_device_name``) or the CPU's description."""
    capability: tuple[int, int] | None
    """CUDA compute capability, None on CPU."""
    gpu_count: int
    gpu_memory: int | None
    """Total memory of the training GPU in bytes, None on CPU."""
    host_memory: int
    """Total host RAM in bytes."""
    pinned_memory: bool
    """Page-locked host buffers can be allocated (needed for asynchronous copies)."""
    bf16: bool
    """The device computes in bfloat16 natively."""
    triton: bool
    """``import triton`` works."""
    attention_kernels: tuple[str, ...]
    """Attention kernels this torch has: ``sdpa`` always, ``flex_attention``, ``varlen``."""
    bitsandbytes: bool
    """``bitsandbytes`` is installed (QLoRA)."""
    cpu_count: int
    torch_version: str
    cuda_version: str | None
    peak_flops: float | None
    """Dense bf16 peak FLOP/s of the GPU when known (for MFU), None on CPU or an unknown GPU."""
    varlen_options: tuple[str, ...] = ()
    """Keyword options of ``torch.nn.attention.varlen.varlen_attn`` (``window_size``, ``return_aux``):
    a sliding window and attention sinks need them. Empty when torch has no varlen attention."""
    triton_varlen: str | None = "not probed"
    """Why our Triton varlen kernel (``trainer.kernels.flash_varlen``) cannot run on the training
    device, or None when it can (any head dim it supports)."""

    def to_dict(self) -> dict[str, Any]:
        raw = dataclasses.asdict(self)
        raw["capability"] = list(self.capability) if self.capability else None
        raw["attention_kernels"] = list(self.attention_kernels)
        return raw

    def describe(self) -> str:
        """One line for messages, e.g. ``NVIDIA H100 80GB HBM3 (cuda, sm90)`` or ``x86_64 (cpu, 2 cores)``."""
        if self.device == "cuda" and self.capability:
            return f"{self.name} (cuda, sm{self.capability[0]}{self.capability[1]})"
        return f"{self.name} (cpu, {self.cpu_count} cores)"


@dataclass(frozen=True)
class ModelFacts:
    """What the plan needs to know about the model, read from its config before loading weights.

    ``trainer.model.model_facts`` fills it from the real config; the defaults describe a plain
    causal LM that every kernel can run (what ``detect`` plans for when no job is given).
    """

    model_type: str
    is_moe: bool = False
    supports_sdpa: bool = True
    packed_attention: str | None = None
    """Why ``ftq_packed`` attention cannot run this model (soft-capping, bidirectional), or None."""
    head_dim: int | None = None
    """Attention head dim (our Triton kernel supports 64 and 128); None when unknown."""
    sliding_window: bool = False
    """Some layer attends through a sliding window (Mistral, GPT-OSS)."""
    attention_sinks: bool = False
    """Attention sinks (GPT-OSS): the kernel must return the log-sum-exp."""
    grouped_query: bool = False
    """Fewer key/value heads than query heads (GQA): torch's varlen_attn needs ``enable_gqa``."""
    fused_loss: str | None = None
    """Why ``trainer.fused_loss`` cannot stand in for the LM head + loss, or None."""
    num_layers: int | None = None
    """Decoder layers (the activation estimate for ``offload_activations``); None when unknown."""
    hidden_size: int | None = None
    param_count: int | None = None
    """Parameters of the base model (its weights' GPU memory); None when unknown."""
    moe_blocks: int = 0
    """Experts modules ``trainer.moe_routing`` recognises (0 for a dense model)."""
    moe_family: str | None = None
    """``gpt_oss``, ``qwen3_moe``, ``mixtral`` or the experts class name."""
    moe_routing: str | None = None
    """Why grouped routing cannot run this MoE model (quantized or custom experts), or None."""


ANY_MODEL = ModelFacts(model_type="any model", is_moe=True, moe_blocks=1)
"""The facts ``capabilities`` plans with: a model with MoE blocks that every kernel can run, so a
switch is reported impossible only for reasons of the machine or of this build."""


@dataclass(frozen=True)
class Decision:
    name: str
    enabled: bool
    backend: str | None
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Plan:
    device: str
    dtype: str
    """Compute dtype: ``bfloat16`` on a bf16-capable GPU, else ``float32``."""
    decisions: tuple[Decision, ...]
    attention: Decision
    """Backend ``triton`` / ``torch_varlen`` / ``sdpa`` (``ftq_packed`` attention, see
    ``PACKED_BACKENDS``), or ``transformers_sdpa`` / ``transformers_eager`` (the model's own
    attention with packed block masks, for models packed attention cannot run)."""
    loss: Decision
    hf_attention: str = "sdpa"
    lora: Decision = Decision("lora_kernel", False, None, "not planned")
    """How LoRA linear layers run: ``ftq_fused_lora`` (``trainer.lora_fused``) or ``peft``."""
    fused_ops: Decision = Decision("fused_ops", False, None, "not planned")
    """RMSNorm / SwiGLU / RoPE kernels (``trainer.fused_ops``): ``triton`` on a CUDA GPU, else off."""
    """The model's own attention implementation (``sdpa``, or ``eager`` where it has no SDPA path)."""

    @property
    def attention_backend(self) -> str:
        assert self.attention.backend is not None
        return self.attention.backend

    @property
    def packed_attention(self) -> bool:
        """The model trains through ``trainer.attention.PackedAttention`` (``ftq_packed``)."""
        return self.attention_backend in PACKED_BACKENDS

    @property
    def load_attn_implementation(self) -> str:
        """``attn_implementation`` for ``from_pretrained`` (``ftq_packed`` is installed afterwards)."""
        return self.hf_attention

    @property
    def loss_kernel(self) -> str:
        assert self.loss.backend is not None
        return self.loss.backend

    def decision(self, name: str) -> Decision:
        for d in self.decisions:
            if d.name == name:
                return d
        raise KeyError(
            f"no decision named {name!r}; have {[d.name for d in self.decisions]}"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "dtype": self.dtype,
            "decisions": [d.to_dict() for d in self.decisions],
            "attention_backend": self.attention_backend,
            "attention_reason": self.attention.reason,
            "loss_kernel": self.loss_kernel,
            "loss_reason": self.loss.reason,
            "model_attention": self.hf_attention,
            "lora_kernel": self.lora.backend,
            "lora_reason": self.lora.reason,
            "fused_ops": self.fused_ops.backend,
            "fused_ops_reason": self.fused_ops.reason,
        }


@cache
def detect(device: str = "auto") -> Hardware:
    """Probe the machine once per ``device`` choice (``auto``, ``cpu``, ``cuda``).

    Raises:
        PlanError: ``device="cuda"`` on a machine where torch sees no CUDA device.
    """
    import psutil
    import torch

    has_cuda = torch.cuda.is_available()
    if device == "cuda" and not has_cuda:
        raise PlanError(
            "device=cuda: torch sees no CUDA device here; set device to auto or cpu"
        )
    use_cuda = has_cuda and device != "cpu"
    kernels = ["sdpa"]
    if importlib.util.find_spec("torch.nn.attention.flex_attention") is not None:
        kernels.append("flex_attention")
    common = {
        "host_memory": psutil.virtual_memory().total,
        "triton": _importable("triton"),
        "attention_kernels": tuple(kernels),
        "bitsandbytes": importlib.util.find_spec("bitsandbytes") is not None,
        "cpu_count": os.cpu_count() or 1,
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda,
    }
    varlen_options = _varlen_options()
    # On CUDA "varlen" is listed only when a tiny real call runs (a build may ship the module
    # without the kernel for this GPU); on CPU it is listed when it imports (no CPU kernel exists).
    if varlen_options is not None and (not use_cuda or _varlen_runs()):
        kernels.append("varlen")
    common["varlen_options"] = varlen_options or ()
    common["attention_kernels"] = tuple(kernels)
    if not use_cuda:
        import platform

        return Hardware(
            device="cpu",
            name=platform.processor() or platform.machine() or "cpu",
            capability=None,
            gpu_count=0,
            gpu_memory=None,
            pinned_memory=False,
            bf16=False,
            peak_flops=None,
            triton_varlen="training runs on the CPU; the Triton kernel needs a CUDA GPU",
            **common,
        )
    index = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    return Hardware(
        device="cuda",
        name=props.name,
        capability=(props.major, props.minor),
        gpu_count=torch.cuda.device_count(),
        gpu_memory=props.total_memory,
        pinned_memory=_can_pin(),
        bf16=torch.cuda.is_bf16_supported(),
        peak_flops=peak_flops(props.name),
        triton_varlen=_triton_varlen_missing(torch.device("cuda", index)),
        **common,
    )


def peak_flops(gpu_name: str) -> float | None:
    """Dense bf16 peak FLOP/s for a GPU name from ``PEAK_BF16_FLOPS``; None if unknown."""
    for key, flops in PEAK_BF16_FLOPS:
        if key.lower() in gpu_name.lower():
            return flops
    return None


def plan(
    hw: Hardware,
    opts: Optimizations,
    config: TrainConfig,
    model: ModelFacts | None = None,
) -> Plan:
    """Decide every optimization, the attention backend and the loss kernel for a run.

    Pure: reads only its arguments (see the module docstring for the rules).

    Raises:
        PlanError: a switch is ``on`` but cannot run here, or ``method`` needs what is missing.
    """
    model = model or ModelFacts(model_type="unknown")
    if config.method == "qlora" and not (hw.device == "cuda" and hw.bitsandbytes):
        raise PlanError(
            f"method=qlora needs a CUDA GPU with bitsandbytes installed; this machine is {hw.describe()}"
            f"{'' if hw.bitsandbytes else ' without bitsandbytes'}. Use method=lora, or install bitsandbytes on a GPU worker"
        )
    attention = _attention(hw, model)
    dtype = _dtype(hw, config)
    decisions = tuple(
        _decide(name, _switch_value(name, opts, config), hw, config, model, attention)
        for name in SWITCHES
    )
    offload, double = _offload_decisions(
        {d.name: d for d in decisions}, opts, hw, config, model, dtype
    )
    decisions = tuple(
        {"offload_activations": offload, "double_buffered_reload": double}.get(
            d.name, d
        )
        for d in decisions
    )
    return Plan(
        device=hw.device,
        dtype=dtype,
        decisions=decisions,
        attention=attention,
        loss=_loss(model),
        hf_attention="sdpa" if model.supports_sdpa else "eager",
        lora=_lora_kernel(config),
        fused_ops=_fused_ops(hw),
    )


def capabilities(hw: Hardware, config: TrainConfig) -> dict[str, str | None]:
    """Per switch: None when ``on`` can be honoured on ``hw`` (for a model every kernel can run),
    else the one-line reason it cannot. What ``detect --json`` reports and the API checks."""
    attention = _attention(hw, ANY_MODEL)
    return {name: _why_not(name, hw, config, ANY_MODEL, attention) for name in SWITCHES}


def _switch_value(name: str, opts: Optimizations, config: TrainConfig) -> str:
    return (
        config.optimizations.offload_activations
        if name == "offload_activations"
        else getattr(opts, name)
    )


def _decide(
    name: str,
    value: str,
    hw: Hardware,
    config: TrainConfig,
    model: ModelFacts,
    attention: Decision,
) -> Decision:
    if value == "off":
        if name == "moe_grouped_routing" and model.is_moe and model.moe_blocks:
            return Decision(
                name,
                False,
                "eager",
                f"off in the job: transformers' eager per-expert loop on {model.moe_blocks} MoE blocks",
            )
        if name == "packed_metadata_cache" and attention.backend in PACKED_BACKENDS:
            return Decision(
                name,
                False,
                attention.backend,
                "off in the job: metadata rebuilt in every layer from the device position ids",
            )
        return Decision(name, False, None, "off in the job")
    if name == "moe_grouped_routing":
        return _moe_decision(value, hw, config, model)
    missing = _why_not(name, hw, config, model, attention)
    if missing is None:
        how = "on in the job" if value == "on" else "auto"
        if name == "packed_metadata_cache":
            return Decision(
                name,
                True,
                attention.backend,
                f"{how}: cu_seqlens, max_seqlen and positions built once per batch from host lengths, "
                f"reused by every layer ({attention.backend} attention)",
            )
        return Decision(
            name,
            True,
            hw.device,
            "available here" if value == "auto" else "on in the job",
        )
    if value == "on":
        raise PlanError(
            f"{name}=on cannot run: {missing} (machine: {hw.describe()}). Set {name} to auto or off"
        )
    return Decision(name, False, None, missing)


def _moe_decision(
    value: str, hw: Hardware, config: TrainConfig, model: ModelFacts
) -> Decision:
    """``moe_grouped_routing`` (not ``off``): on for every recognised MoE block of the model.

    The backend is what ``trainer.moe_routing.install`` will pick: ``grouped_mm`` (no host sync)
    for bf16 weights on a CUDA GPU of sm80+, else the per-expert-slice loop (one host sync per
    layer); its Triton combine/gate kernels only on CUDA with Triton installed.
    """
    name = "moe_grouped_routing"
    missing = None
    if not model.is_moe:
        missing = f"no MoE blocks in this model ({model.model_type})"
    elif model.moe_routing is not None:
        missing = model.moe_routing
    elif name not in BUILT_OPTIMIZATIONS:
        missing = "it is not implemented in this build of the trainer"
    if missing is not None:
        if value == "on":
            raise PlanError(
                f"{name}=on cannot run: {missing} (machine: {hw.describe()}). Set {name} to auto or off"
            )
        return Decision(name, False, None, missing)
    grouped = (
        hw.device == "cuda"
        and hw.capability is not None
        and hw.capability >= (8, 0)
        and _dtype(hw, config) == "bfloat16"
        and config.method != "qlora"
    )
    backend = "grouped_mm" if grouped else "loop"
    how = (
        "grouped_mm"
        if grouped
        else "per-expert slices, one host sync per layer (grouped_mm needs bf16 on a CUDA GPU of sm80+)"
    )
    if hw.device == "cuda" and hw.triton:
        how += ", Triton combine + gate"
    blocks = model.moe_blocks or "every"
    family = f" ({model.moe_family})" if model.moe_family else ""
    return Decision(
        name,
        True,
        backend,
        f"{'on in the job' if value == 'on' else 'auto'}: grouped routing on {blocks} MoE blocks{family}, {how}",
    )


_GIB = 1 << 30
_WEIGHT_BYTES = {"bfloat16": 2.0, "float16": 2.0, "float32": 4.0}


def _offload_decisions(
    first: dict[str, Decision],
    opts: Optimizations,
    hw: Hardware,
    config: TrainConfig,
    model: ModelFacts,
    dtype: str,
) -> tuple[Decision, Decision]:
    """``offload_activations`` and ``double_buffered_reload`` together (the second needs the first).

    ``first`` holds the per-switch decisions (machine requirements already applied: a CUDA GPU,
    pinned memory, gradient checkpointing). Where both can run, the activation estimate decides:
    ``auto`` offloads when plain checkpointing's layer inputs (``L x T x H`` at
    ``data.batch_tokens`` tokens) exceed ``trainer.offload.ACTIVATION_SHARE`` of the GPU memory
    left after the weights; host memory must hold the offloaded inputs plus headroom. Double
    buffering goes with offload unless asked off or its second buffer does not fit; the reason
    names that buffer's extra GPU memory.

    Double buffering is allowed on ``auto``: its stream race (a reload buffer fresh from the main
    stream's pool written before main's queued kernels were done with that memory, 1e11/NaN LoRA
    gradients at 8B) is fixed and was confirmed bit-identical to plain checkpointing on an H200
    (docs/bench-output/offload-h200.txt, docs/gpu-test-output/test_offload-h200.txt).
    """
    offload, double = first["offload_activations"], first["double_buffered_reload"]
    offload_value = config.optimizations.offload_activations
    double_value = opts.double_buffered_reload
    if not offload.enabled:
        return offload, double if not double.enabled else Decision(
            double.name,
            False,
            None,
            "offload_activations is off, so there is nothing to reload",
        )
    from trainer import offload as offload_module  # torch: only for a CUDA plan

    forced = offload_value == "on"
    if not (model.num_layers and model.hidden_size):
        if not forced:
            return (
                Decision(
                    offload.name,
                    False,
                    None,
                    "the model's layer count and hidden size are unknown: "
                    "cannot estimate its activations; plain gradient checkpointing",
                ),
                _no_reload(
                    double, double_value, "offload_activations stays off (auto)"
                ),
            )
        est = None
    else:
        est = offload_module.estimate(
            _Shape(model.num_layers, model.hidden_size), config.data.batch_tokens, dtype
        )
    weights = int(
        (model.param_count or 0)
        * (0.5 if config.method == "qlora" else _WEIGHT_BYTES.get(dtype, 2.0))
    )
    gpu_free = max(0, (hw.gpu_memory or 0) - weights)
    if est is not None:
        host_need = est.offloaded + offload_module.HOST_HEADROOM_BYTES
        if host_need > hw.host_memory:
            why = (
                f"offload needs {est.offloaded / _GIB:.1f} GiB of pinned host memory plus "
                f"{offload_module.HOST_HEADROOM_BYTES / _GIB:.0f} GiB headroom and the host has "
                f"{hw.host_memory / _GIB:.1f} GiB"
            )
            if forced:
                raise PlanError(
                    f"offload_activations=on cannot run: {why} (machine: {hw.describe()}). Lower "
                    "data.batch_tokens, or set offload_activations to auto or off"
                )
            return (
                Decision(
                    offload.name, False, None, f"{why}; plain gradient checkpointing"
                ),
                _no_reload(
                    double, double_value, "offload_activations stays off (auto)"
                ),
            )
        budget = gpu_free * offload_module.ACTIVATION_SHARE
        sizes = f"layer inputs {est.checkpointed / _GIB:.2f} GiB at {config.data.batch_tokens} tokens"
        if not forced and est.checkpointed <= budget:
            return (
                Decision(
                    offload.name,
                    False,
                    None,
                    f"auto: {sizes} fit in {budget / _GIB:.2f} GiB of GPU "
                    "memory after the weights; plain gradient checkpointing",
                ),
                _no_reload(
                    double,
                    double_value,
                    "offload_activations stays off (auto): the activations fit",
                ),
            )
        why = (
            f"on in the job ({sizes})"
            if forced
            else f"auto: {sizes} would not fit in {budget / _GIB:.2f} GiB of GPU memory after the weights"
        )
        why += f", {est.offloaded / _GIB:.2f} GiB to pinned host memory"
    else:
        why = "on in the job (model shape unknown: no estimate)"
    offload = Decision(offload.name, True, "cuda", why)
    if double_value == "off":
        return offload, Decision(
            double.name,
            False,
            "sync",
            "off in the job: synchronous reload into one buffer",
        )
    if not double.enabled:  # a machine requirement said no (already PlanError when on)
        return offload, double
    if est is not None:
        no_room = offload_module.double_buffer_supported(
            max(0, gpu_free - est.buffer), est.second_buffer
        )
        if no_room is not None:
            if double_value == "on":
                raise PlanError(
                    f"double_buffered_reload=on cannot run: {no_room} (machine: {hw.describe()}). "
                    "Set double_buffered_reload to auto or off"
                )
            return offload, Decision(double.name, False, "sync", no_room)
        extra = f"{est.second_buffer / _GIB:.3f} GiB"
    else:
        extra = "one layer input (size unknown)"
    return offload, Decision(
        double.name,
        True,
        "double",
        f"{'on in the job' if double_value == 'on' else 'auto'}: layer i-1's input copied into a second "
        f"GPU buffer while layer i recomputes; extra GPU memory for the second buffer: {extra}",
    )


def _no_reload(double: Decision, value: str, why: str) -> Decision:
    """``double_buffered_reload`` when offload stays off: nothing to reload (``on`` is an error)."""
    if value == "on":
        raise PlanError(
            f"double_buffered_reload=on needs offloaded activations, and {why}. Set "
            "offload_activations to on, or double_buffered_reload to auto or off"
        )
    return Decision(double.name, False, None, f"{why}, so there is nothing to reload")


@dataclass(frozen=True)
class _Shape:
    """The two sizes ``trainer.offload.estimate`` reads from a model config."""

    num_hidden_layers: int
    hidden_size: int


def _why_not(
    name: str, hw: Hardware, config: TrainConfig, model: ModelFacts, attention: Decision
) -> str | None:
    """Why switch ``name`` cannot be on here, or None."""
    missing = _requirement(name, hw, config)
    if (
        missing is None
        and name == "packed_metadata_cache"
        and attention.backend not in PACKED_BACKENDS
    ):
        missing = f"packed attention cannot run this model ({model.packed_attention})"
    if missing is None and name not in BUILT_OPTIMIZATIONS:
        missing = "it is not implemented in this build of the trainer"
    return missing


def _requirement(name: str, hw: Hardware, config: TrainConfig) -> str | None:
    """Why switch ``name`` cannot run on ``hw`` with ``config``, or None when it can."""
    if name in ("double_buffered_reload", "offload_activations"):
        if hw.device != "cuda":
            return "offloading activations needs a CUDA GPU"
        if not hw.pinned_memory:
            return "pinned host memory cannot be allocated on this machine"
        if not config.gradient_checkpointing:
            return "it offloads checkpointed layer inputs, and gradient_checkpointing is off"
        if name == "double_buffered_reload" and config.optimizations.offload_activations == "off":
            return "offload_activations is off, so there is nothing to reload"
    return None


def _attention(hw: Hardware, model: ModelFacts) -> Decision:
    """The fastest packed attention backend for ``model`` on ``hw``, or the model's own attention."""
    if model.packed_attention is not None:
        own = "transformers_sdpa" if model.supports_sdpa else "transformers_eager"
        return Decision(
            "attention",
            True,
            own,
            f"packed attention cannot run {model.model_type} ({model.packed_attention}); "
            f"its own {own.split('_')[1]} attention with packed block masks built from position ids",
        )
    if hw.device != "cuda":
        return Decision(
            "attention",
            True,
            "sdpa",
            f"{hw.device}: SDPA with the packed block-diagonal mask (the varlen kernels need CUDA)",
        )
    skipped = []
    why = _torch_varlen_missing(hw, model)
    if why is None:
        return Decision(
            "attention",
            True,
            "torch_varlen",
            "torch varlen_attn over cu_seqlens (no cross-sample block)",
        )
    skipped.append(f"not torch_varlen: {why}")
    why = hw.triton_varlen
    if (
        why is None
        and model.head_dim is not None
        and model.head_dim not in TRITON_HEAD_DIMS
    ):
        why = f"head dim {model.head_dim} is not one of {', '.join(map(str, TRITON_HEAD_DIMS))}"
    if why is None:
        return Decision(
            "attention",
            True,
            "triton",
            "our Triton flash attention over cu_seqlens (no cross-sample block; "
            + skipped[0]
            + ")",
        )
    skipped.append(f"not triton: {why}")
    return Decision(
        "attention",
        True,
        "sdpa",
        "SDPA with the packed block-diagonal mask (" + "; ".join(skipped) + ")",
    )


def _torch_varlen_missing(hw: Hardware, model: ModelFacts) -> str | None:
    if "varlen" not in hw.attention_kernels:
        return f"torch {hw.torch_version} has no torch.nn.attention.varlen (needs torch >= 2.12)"
    if model.sliding_window and "window_size" not in hw.varlen_options:
        return f"torch {hw.torch_version}'s varlen_attn has no window_size, and {model.model_type} uses a sliding window"
    if model.attention_sinks and "return_aux" not in hw.varlen_options:
        return f"torch {hw.torch_version}'s varlen_attn cannot return the log-sum-exp attention sinks need"
    if model.grouped_query and "enable_gqa" not in hw.varlen_options:
        return f"torch {hw.torch_version}'s varlen_attn has no enable_gqa, and {model.model_type} uses grouped-query attention"
    return None


def _loss(model: ModelFacts) -> Decision:
    if model.fused_loss is None:
        return Decision(
            "loss",
            True,
            LOSS_FUSED,
            "fused chunked LM head + cross-entropy: the full logits are never materialised",
        )
    return Decision(
        "loss",
        True,
        LOSS_PLAIN,
        f"full logits in float32: the fused loss cannot run this model ({model.fused_loss})",
    )


def _lora_kernel(config: TrainConfig) -> Decision:
    if config.method == "full":
        return Decision("lora_kernel", False, None, "method full: no adapters")
    if config.lora.dropout:
        return Decision(
            "lora_kernel",
            False,
            LORA_PEFT,
            f"peft's LoRA forward: lora.dropout={config.lora.dropout} (the fused path has no dropout)",
        )
    return Decision(
        "lora_kernel",
        True,
        LORA_FUSED,
        "LoRA in the compute dtype with the update fused into the base matmul: no fp32 copies of activations",
    )


def _fused_ops(hw: Hardware) -> Decision:
    if hw.device != "cuda":
        return Decision("fused_ops", False, None, "CPU: transformers' own RMSNorm, SwiGLU and RoPE ops")
    if not hw.triton:
        return Decision("fused_ops", False, None, "triton is not installed: transformers' own ops")
    if hw.capability is not None and hw.capability < (8, 0):
        return Decision(
            "fused_ops",
            False,
            None,
            f"sm{hw.capability[0]}{hw.capability[1]}: the Triton RMSNorm/SwiGLU/RoPE kernels need sm80 or newer",
        )
    return Decision(
        "fused_ops",
        True,
        "triton",
        "Triton RMSNorm, SwiGLU and RoPE kernels: one pass each instead of several elementwise ops",
    )


def _dtype(hw: Hardware, config: TrainConfig) -> str:
    if config.model.dtype != "auto":
        return config.model.dtype
    return "bfloat16" if hw.device == "cuda" and hw.bf16 else "float32"


def _varlen_options() -> tuple[str, ...] | None:
    """Keyword options of torch's ``varlen_attn``, or None when this torch has none."""
    import inspect

    try:
        from torch.nn.attention.varlen import varlen_attn
    except Exception:  # noqa: BLE001 - a broken module is as unusable as a missing one
        return None
    params = inspect.signature(varlen_attn).parameters
    return tuple(p for p in ("window_size", "return_aux", "enable_gqa") if p in params)


def _varlen_runs() -> bool:
    """torch's ``varlen_attn`` runs forward and backward on the current CUDA device."""
    import torch

    try:
        from torch.nn.attention.varlen import varlen_attn

        q = torch.randn(
            8, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True
        )
        cu = torch.tensor([0, 3, 8], device="cuda", dtype=torch.int32)
        varlen_attn(q, q, q, cu, cu, 5, 5).sum().backward()
        torch.cuda.synchronize()
    except Exception:  # noqa: BLE001 - whatever fails, the kernel is not usable here
        return False
    return True


def _triton_varlen_missing(device: Any) -> str | None:
    try:
        from trainer.kernels import flash_varlen
    except Exception as exc:  # noqa: BLE001 - any import failure makes the kernel unusable
        return f"the Triton varlen kernel does not import: {exc}"
    return flash_varlen.supported(device)


def _importable(module: str) -> bool:
    try:
        importlib.import_module(module)
    except Exception:  # noqa: BLE001 - a broken install is as unusable as a missing one
        return False
    return True


def _can_pin() -> bool:
    import torch

    try:
        torch.empty(1, pin_memory=True)
    except RuntimeError:
        return False
    return True
