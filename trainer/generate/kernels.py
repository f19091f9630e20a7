"""The trainer's kernels on a model that serves: what generation jobs, chat sessions and the
benchmarks install before the sampler runs it.

- ``trainer.features.lora_kernel.fused``: the LoRA layers computed in the compute dtype with the
  update fused into the base matmul (when the model carries peft adapters), their compute-dtype
  copies of the adapters kept (``AdapterCache.keep``: nothing trains a served model), and the
  layers that read one input (q/k/v, gate/up) computed as one: their ``x @ A^T`` in one matmul, their
  base weights put into one matrix (each layer's weight a view of its rows) for one base matmul
  and one block-diagonal update (``trainer.features.lora_kernel.siblings``; ``uninstall`` gives
  each weight its own storage again);
- ``trainer.features.fused_ops``: RMSNorm, the Llama-form SwiGLU and RoPE as one Triton kernel each
  (on CUDA; on the CPU their torch form, the eager code op for op, so the CPU path's bits are
  unchanged). A decode step of a Llama-3.1-8B shape runs ~65 RMSNorms and 32 RoPEs: eager, each
  is 6-12 small kernels; the fused ones are one each, which a CUDA graph replays in less time.

The training model (GRPO's rollouts, checkpoint samples) has them already: the trainer installed
them with its features.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class ServingKernels:
    """What ``install`` patched; ``uninstall`` restores the model."""

    installed: list[Any] = field(default_factory=list)

    def uninstall(self) -> None:
        for item in reversed(self.installed):
            item.uninstall()
        self.installed.clear()

    def describe(self) -> str:
        return "; ".join(item.describe() for item in self.installed)


@dataclass
class _Ungroup:
    layers: list[Any]

    def uninstall(self) -> None:
        from trainer.features.lora_kernel import siblings

        siblings.ungroup(self.layers)

    def describe(self) -> str:
        groups = {id(group): group for layer in self.layers if (group := vars(layer).get("_ftq_siblings"))}
        fused = sum(group.weight is not None for group in groups.values())
        return (f"{len(groups)} groups of LoRA layers sharing one input take x @ A^T in one matmul "
                f"({fused} with their base weights as one matrix: one base matmul and one update for the group)")


def install(model: torch.nn.Module) -> ServingKernels:
    """Install the fused LoRA layers (a peft model only) and the fused elementwise ops on ``model``
    (after peft wrapping and ``.to(device)``)."""
    from trainer.features.fused_ops import patch as fused_ops

    kernels = ServingKernels()
    if hasattr(model, "peft_config"):
        from trainer.features.lora_kernel import fused as lora_fused

        from trainer.features.lora_kernel import siblings

        lora = lora_fused.install(model)
        lora.cache.keep()  # serving: each adapter cast to the compute dtype once, not every step
        kernels.installed.append(lora)
        siblings.group_siblings(model, lora.layers, fuse=True)  # q/k/v and gate/up: one matmul each
        kernels.installed.append(_Ungroup(list(lora.layers)))
    kernels.installed.append(fused_ops.install(model))
    return kernels
