"""Bench variants as plans: every ftq row installs ``trainer.training.install.install(model, plan)``.

A variant is the plan ``trainer.plan.planner.plan`` makes for the bench workload (``bench_config``)
on this machine and the built model (``bench_facts``), with the variant's switches in
``TrainConfig.optimizations`` and, where a variant turns a kernel choice off (peft's LoRA
forward, transformers' own norm and MLP), that decision replaced (``variant_plan``). The bench
installs it, times the steps, and undoes it with ``Installation.remove()``; only the stock rows
(transformers' own attention and loss, the baseline) are not plans.

Each result records which plan ran: ``Installation.describe()`` (the installed pieces) and
``changes`` (the decisions that differ from the all-``auto`` plan).
"""

from __future__ import annotations

import dataclasses
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch

from bench.workload import TOKENS_PER_STEP, ModelShape
from trainer.config import DataConfig, LoraConfig, ModelConfig, OptimConfig, Optimizations, TrainConfig
from trainer.plan.hardware import Hardware
from trainer.training.install import Installation
from trainer.data.packing import PackedBatch
from trainer.plan.types import Decision, ModelFacts, Plan
from trainer.plan.planner import plan

OFF_IN_VARIANT = "off in this variant"
KERNELS_OFF = {
    "lora_kernel": Decision("lora_kernel", "off", False, "peft", OFF_IN_VARIANT),
    "fused_ops": Decision("fused_ops", "off", False, None, OFF_IN_VARIANT),
}
"""The kernel choices a variant may turn off (they have no switch), and what runs instead."""
CPU_OFFLOAD = "bench on the CPU: the offloader over its synchronous CPU streams (the plan offloads only on CUDA)"


def bench_config(
    shape: ModelShape, *, method: str = "lora", tokens: int = TOKENS_PER_STEP, gradient_checkpointing: str = "on",
    **switches: str
) -> TrainConfig:
    """The job the bench workload is (``bench.workload``): bf16, LoRA r=16 alpha 16 without dropout
    on ``shape.lora_targets``, ``tokens`` per packed step, ``switches`` in ``optimizations``.
    ``gradient_checkpointing`` ``on`` keeps the component benches on full checkpointing (``auto``
    would keep every activation where they fit: ``bench.memory_estimate`` compares the policies).

    ``model.name_or_path`` is a placeholder; ``bench_facts`` reads the built model's own config.
    """
    return TrainConfig(
        model=ModelConfig(f"bench/{shape.name}", dtype="bfloat16"),
        data=DataConfig("bench.jsonl", max_seq_len=min(4096, tokens), batch_tokens=tokens),
        optim=OptimConfig(max_steps=1),
        output_dir="bench-out",
        lora=LoraConfig(r=16, alpha=16, dropout=0.0, target_modules=tuple(shape.lora_targets)),
        optimizations=Optimizations(**switches),
        method=method,
        gradient_checkpointing=gradient_checkpointing,
    )


def bench_facts(model: torch.nn.Module, config: TrainConfig) -> ModelFacts:
    """``trainer.model.load.model_facts`` of the built model: its config (the base model's under peft)
    saved to a temporary directory and read back as the trainer reads a checkpoint's."""
    from trainer.model.load import model_facts

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    with tempfile.TemporaryDirectory(prefix="ftq-bench-") as tmp:
        base.config.save_pretrained(tmp)
        return model_facts(dataclasses.replace(config, model=dataclasses.replace(config.model, name_or_path=tmp)))


def variant_plan(hw: Hardware, config: TrainConfig, facts: ModelFacts, off: Iterable[str] = ()) -> Plan:
    """``plan(hw, config, facts)`` with the kernel choices named in ``off`` (``KERNELS_OFF``) turned off.

    On the CPU, ``offload_activations=on`` (which the plan refuses there) runs the offloader's
    CPU twin, with the reload mode ``double_buffered_reload`` asks for: the smoke runs of
    ``--device cpu`` keep every row's pieces.

    Raises:
        KeyError: ``off`` names a decision without a stand-in.
        trainer.errors.PlanError: a switch is ``on`` but cannot run here.
    """
    replaced = {name: KERNELS_OFF[name] for name in off}
    opts = config.optimizations
    if hw.device != "cuda" and opts.offload_activations == "on":
        double = opts.double_buffered_reload != "off"
        mode = "double" if double else "sync"
        replaced["offload_activations"] = Decision("offload_activations", "on", True, mode, CPU_OFFLOAD)
        replaced["double_buffered_reload"] = Decision(
            "double_buffered_reload", opts.double_buffered_reload, double, mode, CPU_OFFLOAD
        )
        opts = dataclasses.replace(opts, offload_activations="off", double_buffered_reload="off")
    base = plan(hw, dataclasses.replace(config, optimizations=opts), facts)
    return dataclasses.replace(base, decisions=tuple(replaced.get(d.name, d) for d in base.decisions))


def changes(chosen: Plan, default: Plan) -> list[str]:
    """The decisions of ``chosen`` that differ from ``default`` (the all-``auto`` plan), one line each."""
    before = {d.name: (d.enabled, d.backend) for d in default.decisions}
    return [
        f"{d.name}: {'on' if d.enabled else 'off'}{f' ({d.backend})' if d.backend else ''}: {d.reason}"
        for d in chosen.decisions
        if before[d.name] != (d.enabled, d.backend)
    ]


@dataclass(frozen=True)
class Planner:
    """The plans of one built bench model on this machine: ``plan(**switches)`` per variant."""

    hw: Hardware
    config: TrainConfig
    """``bench_config`` with every switch ``auto``."""
    facts: ModelFacts

    @classmethod
    def for_model(
        cls, model: torch.nn.Module, shape: ModelShape, device: torch.device, *, method: str = "lora",
        tokens: int = TOKENS_PER_STEP,
    ) -> Planner:
        from trainer.plan.hardware import detect

        config = bench_config(shape, method=method, tokens=tokens)
        return cls(detect(device.type), config, bench_facts(model, config))

    @cached_property
    def default(self) -> Plan:
        """What ``python -m trainer run`` would install for this job (every switch ``auto``)."""
        return plan(self.hw, self.config, self.facts)

    def plan(self, off: Iterable[str] = (), **switches: str) -> Plan:
        """The variant with ``switches`` in ``optimizations`` and the kernels in ``off`` turned off."""
        opts = dataclasses.replace(self.config.optimizations, **switches)
        return variant_plan(self.hw, dataclasses.replace(self.config, optimizations=opts), self.facts, off)

    def changes(self, chosen: Plan) -> list[str]:
        return changes(chosen, self.default)


def attention_line(chosen: Plan) -> str:
    """The attention kernel the plan chose and why, for the bench's output."""
    d = chosen.decision("attention")
    return f"attention kernel: {d.backend} ({d.reason})"


def ftq_loss(
    installation: Installation, model: torch.nn.Module, batch: Any, device: torch.device
) -> torch.Tensor:
    """The plan's loss (``Installation.loss``) of a ``bench.workload.PackedBatch`` already on
    ``device``, its metadata built from the host lengths (no device sync)."""
    lengths = list(batch.lengths)
    meta = installation.attention.metadata(lengths, device)
    packed = PackedBatch(batch.input_ids, batch.position_ids, batch.targets, lengths, batch.num_label_tokens)
    return installation.loss(model, packed, meta, batch.num_label_tokens)
