"""What makes a job's adapter download self-describing: the base's portable name, a model card
and the tokenizer the job trained with.

``base_model_name_or_path`` in a trained ``adapter_config.json`` is the path the trainer loaded
the base from: a directory on this box, useless anywhere else. The download names the base as
the user named it, portably: a hub id as it is, a local model by its directory under the model
root (``FTQ_MODEL_ROOT``). Another machine that has the base under that name (its own model
root, or its Hugging Face cache) loads the adapter with ``PeftModel.from_pretrained``.

The card (``README.md``, a Hugging Face model card with YAML front matter) says what was trained
on what and how: base model, dataset (file name, sha256, records, tokens trained), method and
hyperparameters, final and best losses, and the ftq version.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session

from core.errors import InvalidInput
from core.files.service import find_file
from core.jobs.model_source import resolve_model
from core.jobs.models import Job
from core.jobs.summary import eval_losses, step_totals
from core.settings import Settings

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "chat_template.json", "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json")
"""Files of a Hugging Face tokenizer (whichever the base has), the chat template included."""


@dataclass(frozen=True)
class AdapterCard:
    base_name: str
    """The base as another machine names it: hub id, or directory under the model root."""
    base_dir: Path | None
    """Where the base is on this box (to copy its tokenizer); None when it cannot be found."""
    base_kind: str
    """``hub`` or ``local`` (a directory under the model root)."""
    readme: str


def portable_base_name(job: Job, settings: Settings) -> tuple[str, Path | None, str]:
    """``(name, local directory or None, kind)`` of the job's base model (see the module docstring)."""
    root = settings.model_root.expanduser().resolve()
    try:
        source = resolve_model(job.model, model_root=root, allow_hub=True)
    except InvalidInput:  # the base was removed since: name it as the job did
        return job.model, None, "hub" if "/" in job.model else "local"
    if source.kind == "local":
        return Path(source.name_or_path).resolve().relative_to(root).as_posix(), Path(source.name_or_path), "local"
    return job.model, _hub_snapshot(job.model), "hub"


def _hub_snapshot(repo_id: str) -> Path | None:
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, local_files_only=True, allow_patterns=list(TOKENIZER_FILES)))
    except Exception:  # noqa: BLE001 - not in the local cache: the zip goes without the tokenizer
        return None


def build_card(session: Session, job: Job, settings: Settings) -> AdapterCard:
    base, base_dir, kind = portable_base_name(job, settings)
    spec: dict[str, Any] = job.spec or {}
    train = _file_lines(session, job.training_file_id, "Training")
    valid = _file_lines(session, job.validation_file_id, "Validation") if job.validation_file_id else []
    steps, final_loss, best_loss, tokens = step_totals(session, job.job_id)
    evals = eval_losses(session, job.job_id)
    hyper = {"method": job.method, **({"lora": spec.get("lora")} if job.method != "full" else {}),
             "hyperparameters": spec.get("hyperparameters"), "objective": spec.get("objective", "sft")}
    lines = [
        "---", f"base_model: {base}", "library_name: peft" if job.method != "full" else "library_name: transformers",
        f"tags: [ftq, {job.method}]", "---", "",
        f"# {job.name or job.job_id}: {'LoRA adapter' if job.method != 'full' else 'fine-tuned model'} for {base}",
        "", f"Trained by ftq {ftq_version()} (job `{job.job_id}`, finished "
        f"{job.finished_at.isoformat() if job.finished_at else 'unknown'}).", "",
        "## Base model", "", f"`{base}` ({'a Hugging Face hub id' if kind == 'hub' else 'a directory under the model root'}); "
        "the tokenizer files here, chat template included, are the ones the job trained with.", "",
        "## Data", "", *train, *valid, f"- Tokens trained: {tokens:,} (real tokens, no padding, over {steps} steps)", "",
        "## Method and hyperparameters", "", "```json", json.dumps(hyper, indent=2, sort_keys=True), "```", "",
        "## Results", "", f"- Final train loss: {_fmt(final_loss)}; best: {_fmt(best_loss)}",
        f"- Final eval loss: {_fmt(evals[-1] if evals else None)}; best: {_fmt(min(evals) if evals else None)}", "",
        "## Use", "", "```python", "from peft import PeftModel", "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "", f"base = AutoModelForCausalLM.from_pretrained({base!r})", 'model = PeftModel.from_pretrained(base, "path/to/unzipped")',
        'tokenizer = AutoTokenizer.from_pretrained("path/to/unzipped")', "```", "",
    ]
    if job.method == "qlora":
        lines += ["Trained with QLoRA against the 4-bit (NF4) base; load the base in 4-bit for the same outputs, "
                  "or in 16-bit for close ones.", ""]
    return AdapterCard(base, base_dir, kind, "\n".join(lines))


def ftq_version() -> str:
    try:
        return metadata.version("ftq")
    except metadata.PackageNotFoundError:
        return "0.1.0+source"


def _file_lines(session: Session, file_id: str, label: str) -> list[str]:
    row = find_file(session, file_id)
    if row is None:
        return [f"- {label} file `{file_id}` (no longer in the store)"]
    return [f"- {label} file: `{row.filename}` (`{row.file_id}`), sha256 `{row.sha256}`, "
            f"{row.num_records:,} records, {row.format} format, {row.bytes:,} bytes"]


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4f}"
