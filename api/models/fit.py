"""Whether a local model trains on this box's GPUs, for LoRA and for full fine-tuning.

The trainer's own memory model (``trainer.plan.memory``: weights, gradients and optimizer state,
saved activations and workspace, from config.json alone) at the job defaults (``batch_tokens``,
``max_seq_len`` and the LoRA rank of ``core.jobs.spec``), under the leanest activation policy
the trainer can fall to (every layer checkpointed, and on one GPU offloaded to host memory),
against each live GPU host's card (the ``trainer detect`` report a worker stores) minus the
plan's margin (``trainer.plan.memory.Budget``). One GPU first; then, on a host with more, FSDP2 over
2..N of its GPUs, as the plan shards a base too big for one card. The answer is the fewest GPUs
of one host that fit. Several machines (a job's ``nodes``) are not counted, so a model that
needs them says ``no`` here; a job may still lower ``batch_tokens`` or use QLoRA to fit.

Unknown (``fits: null``) when no live worker has a GPU, or config.json lacks a size the
estimate needs.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from sqlalchemy.orm import Session

from core.db import utcnow
from core.jobs.spec import Hyperparameters, LoraSpec
from core.workers import pool, registry
from trainer.plan import memory

METHODS = ("lora", "full")
BATCH_TOKENS: int = Hyperparameters.model_fields["batch_tokens"].default
MAX_SEQ_LEN: int = Hyperparameters.model_fields["max_seq_len"].default
LORA_RANK: int = LoraSpec.model_fields["r"].default


@dataclass(frozen=True)
class GpuHost:
    """A live worker host with GPUs, as its ``trainer detect`` report describes them."""

    worker_id: str
    gpus: int
    gpu_memory: int
    """Bytes of one GPU."""
    bf16: bool


@dataclass(frozen=True)
class Fit:
    fits: bool | None
    """None: unknown (no live GPU host, or config.json lacks a size the estimate needs)."""
    gpus: int | None
    """The fewest GPUs of one live host it trains on; None when it does not fit or is unknown."""
    peak_bytes: int | None
    """Estimated peak on each GPU at that count (when it does not fit: on all of the host's GPUs)."""
    reason: str


def live_gpu_hosts(session: Session, heartbeat_timeout_s: float) -> list[GpuHost]:
    """Workers with a fresh heartbeat whose report shows a CUDA device, with their pool's size."""
    cutoff = utcnow() - dt.timedelta(seconds=heartbeat_timeout_s)
    slots = {host.worker_id: len(host.slots) for host in pool.live_hosts(session, cutoff=cutoff)}
    hosts = []
    for worker in registry.live_workers(session, cutoff=cutoff):
        report = worker.hardware if isinstance(worker.hardware, dict) else {}
        hardware = report.get("hardware") if isinstance(report.get("hardware"), dict) else report
        memory_bytes = hardware.get("gpu_memory")
        if hardware.get("device") == "cuda" and isinstance(memory_bytes, int) and slots.get(worker.worker_id):
            hosts.append(GpuHost(worker.worker_id, slots[worker.worker_id], memory_bytes, hardware.get("bf16") is True))
    return hosts


def shape_of(config: Mapping[str, Any], params: int | None) -> memory.Shape | None:
    """``trainer.plan.memory.Shape`` from a parsed config.json (its ``text_config`` for a multimodal one)."""
    text = config.get("text_config") if isinstance(config.get("text_config"), Mapping) else config
    fields = {**text, "tie_word_embeddings": config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))}
    try:
        return memory.Shape.from_config(SimpleNamespace(**{k: v for k, v in fields.items() if isinstance(k, str)}), params)
    except (TypeError, ValueError, ZeroDivisionError):  # sizes of the wrong type in a hand-written config
        return None


def fit(shape: memory.Shape | None, hosts: Sequence[GpuHost], method: str) -> Fit:
    """Whether ``method`` (``lora`` or ``full``) trains a model of ``shape`` on one of ``hosts``."""
    if shape is None:
        return Fit(None, None, None, "config.json lacks a size the estimate needs "
                   "(num_hidden_layers, hidden_size, num_attention_heads, intermediate_size, vocab_size)")
    if not hosts:
        return Fit(None, None, None, "no live worker has a GPU to fit against; start one with `ftq worker --gpus all`")
    closest: tuple[float, GpuHost, memory.Estimate] | None = None
    for host in sorted(hosts, key=lambda h: (h.gpus, h.gpu_memory, h.worker_id)):
        usable = memory.Budget(free=host.gpu_memory).usable
        for gpus in range(1, host.gpus + 1):
            est = _estimate(shape, method, host, gpus)
            if est.peak <= usable:
                return Fit(True, gpus, est.peak, f"{_gpus(gpus)} of {host.worker_id}: {est.describe()}, "
                           f"within {_card(host)}")
        short = est.peak / max(usable, 1)
        if closest is None or short < closest[0]:
            closest = (short, host, est)
    assert closest is not None, f"{len(hosts)} hosts gave no estimate"
    _, host, est = closest
    fix = "use QLoRA, lower batch_tokens, or add GPUs" if method == "lora" else "use LoRA, or add GPUs or machines"
    return Fit(False, None, est.peak, f"not on {_gpus(host.gpus)} of {host.worker_id} (the closest): "
               f"{est.describe()} per GPU, over {_card(host)}; {fix}")


def _estimate(shape: memory.Shape, method: str, host: GpuHost, gpus: int) -> memory.Estimate:
    work = memory.Workload(
        tokens=BATCH_TOKENS, max_seq_len=MAX_SEQ_LEN, method=method,
        dtype="bfloat16" if host.bf16 else "float32",  # the trainer's dtype "auto"
        lora_rank=LORA_RANK, world_size=gpus, sharded=gpus > 1,
    )
    return memory.estimate(shape, work, "full+offload" if gpus == 1 else "full")  # offload runs on one rank


def _card(host: GpuHost) -> str:
    """``80.0 GiB a GPU - 4.4 GiB margin``."""
    return f"{host.gpu_memory / memory.GIB:.1f} GiB a GPU - {memory.margin(host.gpu_memory) / memory.GIB:.1f} GiB margin"


def _gpus(count: int) -> str:
    return f"{count} GPU" if count == 1 else f"{count} GPUs"
