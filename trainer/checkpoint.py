"""Resumable checkpoints: ``output_dir/checkpoints/step-NNNNNN/`` (``trainer.layout``).

Each holds the trained weights as ``save_pretrained`` writes them (for LoRA the peft adapter:
``adapter_model.safetensors`` + ``adapter_config.json``, loadable with ``PeftModel.from_pretrained``;
for full fine-tuning the whole model), ``trainer_state.pt`` (optimizer, scheduler, step, data
position, RNG states) and ``trainer_state.json`` (the same counters, human-readable).

A checkpoint is written to ``step-NNNNNN.tmp`` and renamed into place, so a run killed while
writing never leaves a half checkpoint that a resume would pick up.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainer import layout
from trainer.layout import checkpoint_dir


@dataclass(frozen=True)
class TrainingState:
    """Where training stands: restored into the loop on resume."""

    step: int
    """Optimizer steps completed."""
    data_position: int
    """Micro-batches consumed (the next one to train is this index)."""


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The complete checkpoint with the highest step in ``output_dir``, or None."""
    root = layout.checkpoints_dir(output_dir)
    if not root.is_dir():
        return None
    found = [
        (step, p)
        for p in root.iterdir()
        if (step := layout.parse_checkpoint_step(p.name)) is not None
        and (p / "trainer_state.json").is_file()
    ]
    return max(found)[1] if found else None


def save_checkpoint(
    output_dir: str | Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    state: TrainingState,
    final: bool = False,
) -> tuple[Path, int]:
    """Write a checkpoint for ``state.step``; returns ``(directory, total bytes)``."""
    final_dir = checkpoint_dir(output_dir, state.step)
    tmp = final_dir.with_name(final_dir.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp)
    torch.save(
        {
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "step": state.step,
            "data_position": state.data_position,
            "rng": _rng_state(),
        },
        tmp / "trainer_state.pt",
    )
    (tmp / "trainer_state.json").write_text(
        json.dumps(
            {"step": state.step, "data_position": state.data_position, "final": final},
            indent=2,
        )
    )
    if final_dir.exists():
        shutil.rmtree(final_dir)
    os.replace(tmp, final_dir)
    return final_dir, directory_bytes(final_dir)


def load_checkpoint(
    path: str | Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
) -> TrainingState:
    """Restore weights, optimizer, scheduler and RNG states from ``path``; returns the counters."""
    path = Path(path)
    _load_weights(path, model)
    raw = torch.load(path / "trainer_state.pt", map_location="cpu", weights_only=True)
    optimizer.load_state_dict(raw["optimizer"])
    scheduler.load_state_dict(raw["scheduler"])
    _set_rng_state(raw["rng"])
    return TrainingState(step=int(raw["step"]), data_position=int(raw["data_position"]))


def export_weights(model: torch.nn.Module, directory: str | Path) -> Path:
    """Save the trained weights alone (the adapter for LoRA) to ``directory``, replacing it."""
    directory = Path(directory)
    tmp = directory.with_name(directory.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    model.save_pretrained(tmp)
    if directory.exists():
        shutil.rmtree(directory)
    os.replace(tmp, directory)
    return directory


def directory_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _load_weights(path: Path, model: torch.nn.Module) -> None:
    from safetensors.torch import load_file

    adapter = path / "adapter_model.safetensors"
    if adapter.is_file():
        from peft import set_peft_model_state_dict

        result = set_peft_model_state_dict(model, load_file(adapter))
        unexpected = getattr(result, "unexpected_keys", [])
        if unexpected:
            raise RuntimeError(
                f"{adapter}: weights for modules this model lacks: {unexpected[:3]}"
            )
        return
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"{path}: no adapter_model.safetensors or model weights to resume from"
        )
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(f))
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {k for k in missing if "lm_head" in k or "embed" in k}
    if unexpected or set(missing) - tied:
        raise RuntimeError(
            f"{path}: checkpoint does not match the model (missing {missing[:3]}, unexpected {unexpected[:3]})"
        )


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "python": random.getstate(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
