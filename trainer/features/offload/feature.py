"""Offloaded activation checkpoints and their double-buffered reload.

Two switches (two features: ``FEATURE`` and ``RELOAD_FEATURE``), one install. ``offload_activations`` ``auto`` offloads when plain checkpointing's
layer inputs (``trainer.features.offload.estimate`` at ``data.batch_tokens``) would not fit in
``ACTIVATION_SHARE`` of the GPU memory left after the weights, and the host holds them;
``double_buffered_reload`` goes with it unless asked off or its second buffer (whose size the
reason names) does not fit. The applied decision is ``offload_activations``: its backend is the
reload mode (``double``: layer i-1's input copied into a second buffer while layer i recomputes;
``sync``: one buffer, copied on demand); the ``double_buffered_reload`` decision says the same
for people reading the plan.

Double buffering is allowed on ``auto``: its stream race (a reload buffer fresh from the main
stream's pool written before main's queued kernels were done with that memory, 1e11/NaN LoRA
gradients at 8B) is fixed and was confirmed bit-identical to plain checkpointing on an H200
(docs/bench-output/offload-h200.txt, docs/gpu-test-output/test_offload-h200.txt).
"""

from __future__ import annotations

import torch

from trainer.errors import PlanError
from trainer.features import offload
from trainer.features.checkpointing import policy as checkpointing
from trainer.features.offload.estimate import estimate_for, host_too_small, machine_missing
from trainer.plan.feature import Context, Job, Target, how, off, unavailable
from trainer.plan.hardware import Hardware
from trainer.plan.types import Decision, ModelFacts

NAME, RELOAD = "offload_activations", "double_buffered_reload"
_GIB = 1 << 30
_WEIGHT_BYTES = {"bfloat16": 2.0, "float16": 2.0, "float32": 4.0}
QLORA_WEIGHT_BYTES = 0.5
"""Bytes per base parameter of a 4-bit QLoRA model (NF4; embeddings and head are counted alike)."""


def unavailable_for(hw: Hardware, job: Job) -> str | None:
    """Why offloading cannot run for this job on ``hw`` (for any model): the machine, or no
    checkpointed layers to offload."""
    missing = machine_missing(hw)
    if missing is None and job.gradient_checkpointing == "off":
        missing = "it offloads checkpointed layer inputs, and gradient_checkpointing is off"
    return missing


def reload_unavailable_for(hw: Hardware, job: Job) -> str | None:
    """Why ``double_buffered_reload=on`` cannot be honoured for this job on ``hw``, or None."""
    missing = unavailable_for(hw, job)
    if missing is None and job.switch(NAME) == "off":
        missing = "offload_activations is off, so there is nothing to reload"
    return missing


def decide_pair(ctx: Context) -> tuple[Decision, Decision]:
    """The ``offload_activations`` and ``double_buffered_reload`` decisions (see the module docstring).

    Reads the ``parallelism`` decision: FSDP2's layers are units whose parameters are gathered by
    hooks the offloaded recompute (a layer's forward called inside backward) would bypass, so no
    offload. And the activation policy when it was estimated (``checkpointing.estimates``):
    ``auto`` then offloads exactly when the policy is ``full+offload``, instead of this module's
    own share-of-the-GPU rule (which stays for runs the policy could not estimate).
    """
    hw, facts, job = ctx.hw, ctx.facts, ctx.job
    requested, reload = job.switch(NAME), job.switch(RELOAD)
    if requested == "off":
        return off(NAME), _reload_unavailable(reload, "offload_activations is off, so there is nothing to reload", hw)
    missing = unavailable_for(hw, job)
    if missing is None and ctx.decision("parallelism").backend == "fsdp2":
        missing = "the layers are sharded with FSDP2, whose gathers the offloaded recompute would bypass"
    if missing is not None:
        double = _reload_unavailable(reload, missing, hw)
        return unavailable(NAME, requested, missing, hw), double
    stays_off = "offload_activations stays off (auto)"
    est = estimate_for(facts, job.batch_tokens, ctx.dtype)
    if est is None:
        if requested == "auto":
            return Decision(
                NAME, requested, False, None,
                "the model's layer count and hidden size are unknown: cannot estimate its activations; "
                "plain gradient checkpointing",
            ), _no_reload(reload, stays_off)
        return _with_reload(requested, reload, hw, "on in the job (model shape unknown: no estimate)", None, 0)
    gpu_free = max(0, (hw.gpu_memory or 0) - _weight_bytes(job.method, facts, ctx.dtype))
    host_why = host_too_small(est, hw)
    if host_why is not None:
        if requested == "on":
            raise PlanError(
                f"offload_activations=on cannot run: {host_why} (machine: {hw.describe()}). Lower "
                "data.batch_tokens, or set offload_activations to auto or off"
            )
        return Decision(NAME, requested, False, None, f"{host_why}; plain gradient checkpointing"), _no_reload(
            reload, stays_off
        )
    if requested == "auto" and checkpointing.estimates(ctx):
        return _follow(ctx.decision(checkpointing.NAME), reload, hw, est, gpu_free)
    budget = gpu_free * offload.ACTIVATION_SHARE
    sizes = f"layer inputs {est.checkpointed / _GIB:.2f} GiB at {job.batch_tokens} tokens"
    if requested == "auto" and est.checkpointed <= budget:
        return Decision(
            NAME, requested, False, None,
            f"auto: {sizes} fit in {budget / _GIB:.2f} GiB of GPU memory after the weights; "
            "plain gradient checkpointing",
        ), _no_reload(reload, f"{stays_off}: the activations fit")
    why = (
        f"on in the job ({sizes})"
        if requested == "on"
        else f"auto: {sizes} would not fit in {budget / _GIB:.2f} GiB of GPU memory after the weights"
    )
    why += f", {est.offloaded / _GIB:.2f} GiB to pinned host memory"
    return _with_reload(requested, reload, hw, why, est, max(0, gpu_free - est.buffer))


def _follow(
    policy: Decision, reload: str, hw: Hardware, est: offload.ActivationEstimate, gpu_free: int
) -> tuple[Decision, Decision]:
    """``auto`` under an estimated activation policy: offload when (and only when) it says so."""
    if policy.backend != "full+offload":
        why = f"the activation policy ({policy.name}) is {policy.backend}"
        return Decision(NAME, "auto", False, None, f"auto: {why}"), _no_reload(reload, f"offload_activations stays off: {why}")
    why = (
        f"auto: full checkpointing alone does not fit (see {policy.name}), "
        f"{est.offloaded / _GIB:.2f} GiB to pinned host memory"
    )
    return _with_reload("auto", reload, hw, why, est, max(0, gpu_free - est.buffer))


def _with_reload(
    requested: str, reload: str, hw: Hardware, why: str, est: offload.ActivationEstimate | None, gpu_free: int
) -> tuple[Decision, Decision]:
    """Offload is on: decide the reload, and name its mode in the offload decision's backend."""
    if reload == "off":
        double = off(RELOAD, "sync", "off in the job: synchronous reload into one buffer")
    elif est is not None and (no_room := offload.double_buffer_supported(gpu_free, est.second_buffer)):
        if reload == "on":
            raise PlanError(
                f"double_buffered_reload=on cannot run: {no_room} (machine: {hw.describe()}). "
                "Set double_buffered_reload to auto or off"
            )
        double = Decision(RELOAD, reload, False, "sync", no_room)
    else:
        extra = "one layer input (size unknown)" if est is None else f"{est.second_buffer / _GIB:.3f} GiB"
        double = Decision(
            RELOAD, reload, True, "double",
            f"{how(reload)}: layer i-1's input copied into a second GPU buffer while layer i recomputes; "
            f"extra GPU memory for the second buffer: {extra}",
        )
    return Decision(NAME, requested, True, double.backend, why), double


def _reload_unavailable(reload: str, why: str, hw: Hardware) -> Decision:
    """``double_buffered_reload`` where offloading itself cannot run (``on`` is an error)."""
    return off(RELOAD) if reload == "off" else unavailable(RELOAD, reload, why, hw)


def _no_reload(reload: str, why: str) -> Decision:
    """``double_buffered_reload`` when offload stays off: nothing to reload (``on`` is an error)."""
    if reload == "on":
        raise PlanError(
            f"double_buffered_reload=on needs offloaded activations, and {why}. Set "
            "offload_activations to on, or double_buffered_reload to auto or off"
        )
    if reload == "off":
        return off(RELOAD)
    return Decision(RELOAD, reload, False, None, f"{why}, so there is nothing to reload")


def _weight_bytes(method: str, facts: ModelFacts, dtype: str) -> int:
    per_param = QLORA_WEIGHT_BYTES if method == "qlora" else _WEIGHT_BYTES.get(dtype, 2.0)
    return int((facts.param_count or 0) * per_param)


class OffloadHandle:
    """An ``ActivationOffloader`` (or its no-op twin) applied to the model's decoder layers."""

    def __init__(self, model: torch.nn.Module, device: torch.device, mode: str | None) -> None:
        self.offloader = offload.build(device, offload=mode is not None, double_buffer=mode == "double")
        self.offloader.apply(model)

    def remove(self) -> None:
        self.offloader.remove()

    def describe(self) -> str | None:
        if not self.offloader.enabled:
            return None
        how_ = "double-buffered reload" if self.offloader.double_buffer else "synchronous reload"
        return f"activation offload: {self.offloader.num_layers} decoder layers, {how_}"


class OffloadActivations:
    """The ``offload_activations`` switch; its applied decision's backend is the reload mode."""

    name = NAME

    def supported(self, ctx: Context) -> str | None:
        return unavailable_for(ctx.hw, ctx.job)

    def decide(self, ctx: Context) -> Decision:
        return decide_pair(ctx)[0]

    def apply(self, model: torch.nn.Module, decision: Decision, target: Target) -> OffloadHandle:
        """Offload the decoder layers' checkpointed inputs as ``decision`` says (backend: reload mode).

        Wraps the layers after peft (so the adapters are inside the recompute), replacing
        transformers' checkpoint wrapper for them; disabled keeps plain gradient checkpointing.
        ``target.device`` defaults to the model's.
        """
        device = torch.device(target.device) if target.device else next(model.parameters()).device
        return OffloadHandle(model, device, decision.backend if decision.enabled else None)


class DoubleBufferedReload:
    """The ``double_buffered_reload`` switch: decided with the offload (``decide`` is pure, so
    each of the two features takes its half of ``decide_pair``), installed by it through the offload's backend."""

    name = RELOAD

    def supported(self, ctx: Context) -> str | None:
        return reload_unavailable_for(ctx.hw, ctx.job)

    def decide(self, ctx: Context) -> Decision:
        return decide_pair(ctx)[1]


FEATURE, RELOAD_FEATURE = OffloadActivations(), DoubleBufferedReload()
