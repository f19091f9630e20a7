"""The names the trainer, the worker, the API, the CLI and the dashboard agree on, each list once.

Standard library only, like ``trainer.config``: the worker (no torch), core's job spec and the
API's schemas (pydantic ``Literal[...]`` of these tuples, so ``/openapi.json`` lists them as
enums), the CLI's argparse choices and the trainer itself import them; the dashboard reads them
from ``/openapi.json``. No other module spells one of these lists
(``tests/unit/test_catalog_contracts.py`` walks the code for a copy).

    METHODS          what a job trains (``trainer.config.TrainConfig.method``)
    SCHEDULERS       the learning-rate decay after warm-up (``trainer.config.OptimConfig``)
    EXPORT_FORMATS   what an export of a finished job writes (``trainer.export.formats``)
    QUANTIZATIONS    the GGUF tensor types ``trainer.export.gguf`` writes
    TRACKERS         the experiment trackers a worker sends a job's metrics to (``worker.tracking``)

Each lives here rather than beside its implementation because the implementations import torch
(export, GGUF), pydantic (the tracking servers' settings) or both, and the trainer may import
nothing of ``core/``.
"""

from __future__ import annotations

METHODS = ("lora", "qlora", "full")
"""A LoRA adapter, a LoRA adapter over a 4-bit (NF4) base, or every weight."""
SCHEDULERS = ("cosine", "linear", "constant")
"""Learning-rate decay after the linear warm-up."""

EXPORT_FORMATS = ("merged", "gguf")
"""``merged``: base + adapter in the base's dtype (safetensors); ``gguf``: one llama.cpp file."""
QUANTIZATIONS = ("f32", "f16", "bf16", "q8_0")
"""GGUF tensor types: gguf-py quantizes these in numpy (llama.cpp's ``--outtype``); format gguf only."""
DEFAULT_QUANTIZATION = "f16"
GGUF_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
"""``config.json`` model types ``trainer.export.gguf`` writes (its ``ARCHITECTURES`` by class name)."""

TRACKERS = {"mlflow": "MLflow", "tensorboard": "TensorBoard", "wandb": "W&B"}
"""Each tracker, by its job spec ``tracking`` field and Python package (the same name), and its
name for people."""
SERVER_TRACKERS = ("mlflow", "wandb")
"""The trackers that send to a server (``core.settings.TrackingServer.kind``); TensorBoard writes files."""
