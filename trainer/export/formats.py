"""Exports of a finished run: ``merged`` (base + adapter, safetensors) and ``gguf`` (llama.cpp).

``python -m trainer export JOB.json --format merged|gguf [--quantization f16] --out DIR`` reads the
run's ``job.json`` (the base model as the trainer loaded it, the method) and its final weights
(``trainer.training.layout.export_dir``), writes the export into ``DIR`` (through ``DIR.tmp``, renamed
when complete) and reports on stdout as JSON lines: ``progress`` events (stage, fraction) and a
final ``done`` (status, path, bytes, or an error code and message). The worker runs it as it runs
training, so it needs only torch, transformers and peft (plus ``gguf`` for format gguf).

Merging: the base is loaded in its own dtype (``config.json``'s, bf16 for most hub models), the
adapter applied with peft and folded in (``merge_and_unload``; peft computes the update in fp32
on the CPU). A QLoRA adapter is merged into the base loaded *unquantized*: the adapter was trained
against the NF4-rounded weights, so the merged model is close to, not bit-equal with, the 4-bit
model the job trained. Method ``full`` has nothing to merge: its weights are cast to the base dtype.
The tokenizer files (chat template included) are copied from the base, so the export is served
with the template the job trained with.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.training import layout
from trainer.catalog import DEFAULT_QUANTIZATION, EXPORT_FORMATS, QUANTIZATIONS
from trainer.config import TrainConfig

STAGES = ("load", "merge", "save", "convert")
"""Stages in order; a merged export ends after ``save``."""

Report = Callable[..., Any]
"""The emitter: ``report("progress", stage=..., fraction=...)``."""


@dataclass(frozen=True)
class ExportResult:
    path: Path
    bytes: int
    seconds: float


def run_export(config: TrainConfig, fmt: str, out: str | Path, report: Report, *,
               quantization: str = DEFAULT_QUANTIZATION, device: str = "auto",
               weights: str | Path | None = None) -> ExportResult:
    """Write the ``fmt`` export of ``config``'s run into ``out`` (replaced if present).

    ``weights``: the adapter (or full model) directory; default the run's final one.
    """
    if fmt not in EXPORT_FORMATS:
        raise ValueError(f"format: {fmt!r} is not one of {', '.join(EXPORT_FORMATS)}")
    started = time.perf_counter()
    out = Path(out)
    tmp = out.with_name(out.name + layout.PARTIAL_SUFFIX)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    weights = Path(weights) if weights is not None else layout.export_dir(config.output_dir, config.method)
    try:
        if fmt == "merged":
            merge(config, weights, tmp, report, device=device)
        else:
            write_gguf_export(config, weights, tmp, report, quantization=quantization, device=device)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    return ExportResult(out, size, time.perf_counter() - started)


def merge(config: TrainConfig, weights: Path, out: Path, report: Report, *, device: str = "auto") -> Path:
    """Save base + adapter merged (or the full model) in the base's dtype, with the tokenizer, to ``out``."""
    model = load_merged(config, weights, report, device=device)
    report("progress", stage="save", fraction=0.0)
    model.save_pretrained(out)
    copy_tokenizer(config.model.name_or_path, out, trust_remote_code=config.model.trust_remote_code)
    report("progress", stage="save", fraction=1.0)
    return out


def load_merged(config: TrainConfig, weights: Path, report: Report, *, device: str = "auto") -> Any:
    """The merged model in the base's dtype (on ``device``; ``auto``: CUDA when present)."""
    import torch
    from transformers import AutoModelForCausalLM

    if not weights.is_dir():
        raise FileNotFoundError(f"{weights}: the run's final weights are not on disk")
    dev = "cuda" if device == "auto" and torch.cuda.is_available() else ("cpu" if device == "auto" else device)
    report("progress", stage="load", fraction=0.0)
    base_dtype = base_torch_dtype(config.model.name_or_path)
    source = weights if config.method == "full" else config.model.name_or_path
    model = AutoModelForCausalLM.from_pretrained(
        source, dtype=base_dtype, device_map={"": dev}, trust_remote_code=config.model.trust_remote_code
    )
    report("progress", stage="load", fraction=1.0)
    report("progress", stage="merge", fraction=0.0)
    if config.method != "full":
        import warnings

        from peft import PeftModel

        with warnings.catch_warnings():
            # peft <= 0.21 reads transformers' deprecated `is_gradient_checkpointing` (not ours to fix).
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            model = PeftModel.from_pretrained(model, weights).merge_and_unload()
    model.config.dtype = base_dtype
    report("progress", stage="merge", fraction=1.0)
    return model.eval()


def base_torch_dtype(name_or_path: str) -> Any:
    """The dtype the base's ``config.json`` names (``dtype`` or ``torch_dtype``); float32 if none."""
    import torch
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(name_or_path)
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


def copy_tokenizer(name_or_path: str, out: Path, *, trust_remote_code: bool = False) -> None:
    """The base's tokenizer files, chat template included, into ``out``."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    tokenizer.save_pretrained(out)


def write_gguf_export(config: TrainConfig, weights: Path, out: Path, report: Report, *,
                      quantization: str = DEFAULT_QUANTIZATION, device: str = "auto") -> Path:
    """Merge into ``out/merged.work`` (removed after), then write ``out/model-<quantization>.gguf``."""
    from trainer.export.gguf import GgufError, write_gguf

    if quantization not in QUANTIZATIONS:
        raise GgufError(f"quantization: {quantization!r} is not one of {', '.join(QUANTIZATIONS)}")
    work = out / "merged.work"
    merge(config, weights, work, report, device=device)
    report("progress", stage="convert", fraction=0.0)
    path = out / gguf_name(quantization)
    write_gguf(work, path, quantization, name=f"{Path(config.model.name_or_path).name} ({config.job_id or 'ftq'})",
               progress=lambda done, total: report("progress", stage="convert", fraction=round(done / total, 4)))
    shutil.rmtree(work)
    return path


def gguf_name(quantization: str) -> str:
    return f"model-{quantization}.gguf"
