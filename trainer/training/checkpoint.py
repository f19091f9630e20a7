"""Resumable checkpoints: ``output_dir/checkpoints/step-NNNNNN/`` (``trainer.layout``).

Two kinds, by what the ranks hold (``uses_dcp``):

- Adapters (LoRA / QLoRA, replicated by DDP or on one rank): rank 0 writes the peft adapter as
  ``save_pretrained`` does (``adapter_model.safetensors`` + ``adapter_config.json``, loadable with
  ``PeftModel.from_pretrained``) and ``trainer_state.pt`` with the optimizer state. Every rank
  holds the same state, so any number of ranks resumes from it.
- Method ``full`` (on any number of ranks) and FSDP2: the model and optimizer state go through
  ``torch.distributed.checkpoint`` into ``dcp/``, each rank writing its own shards; the files
  name every tensor's global shape, so a checkpoint written by W ranks loads on any number of
  ranks, one included (a single process loads without a process group). Under FSDP2 only the
  trained parameters are saved (a LoRA base sharded for size is not copied into every checkpoint).

Both also hold ``trainer_state.pt`` (scheduler, step, data position, rank 0's RNG states) and
``trainer_state.json`` (the same counters, human-readable). A checkpoint is written to
``step-NNNNNN.tmp`` and renamed into place by rank 0 once every rank has written its part, so a
run killed while writing never leaves a half checkpoint that a resume would pick up.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainer.training import layout
from trainer.parallel.distributed import Comm
from trainer.training.layout import checkpoint_dir


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


def uses_dcp(method: str, strategy: str | None) -> bool:
    """Whether a run's checkpoints go through ``torch.distributed.checkpoint`` (see the docstring)."""
    return method == "full" or strategy == "fsdp2"


def save(
    output_dir: str | Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    state: TrainingState,
    comm: Comm,
    *,
    sharded: bool,
    final: bool = False,
) -> tuple[Path, int]:
    """Write the checkpoint of ``state.step``; every rank calls it and returns when it is in place.

    ``sharded`` (``uses_dcp``): every rank writes its part; else rank 0 writes the adapters.
    Returns ``(directory, total bytes)``; the bytes are counted on rank 0 only (0 elsewhere).
    """
    if sharded:
        return save_sharded_checkpoint(output_dir, model, optimizer, scheduler, state, comm, final=final)
    written = (checkpoint_dir(output_dir, state.step), 0)
    if comm.world.is_main:
        written = save_checkpoint(output_dir, model, optimizer, scheduler, state, final=final)
    comm.barrier()  # no rank runs ahead of a checkpoint that is not there yet
    return written


def save_checkpoint(
    output_dir: str | Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    state: TrainingState,
    final: bool = False,
) -> tuple[Path, int]:
    """Write an adapter checkpoint for ``state.step`` (one process); returns ``(directory, bytes)``."""
    final_dir = checkpoint_dir(output_dir, state.step)
    tmp = layout.partial_checkpoint_dir(output_dir, state.step)
    _fresh(tmp)
    model.save_pretrained(tmp)
    _write_trainer_state(tmp, scheduler, state, final, optimizer)
    _publish(tmp, final_dir)
    return final_dir, directory_bytes(final_dir)


def save_sharded_checkpoint(
    output_dir: str | Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    state: TrainingState,
    comm: Comm,
    final: bool = False,
) -> tuple[Path, int]:
    """Every rank writes its shards of the model and optimizer state (DCP) into ``step-N.tmp``;
    rank 0 adds the trainer state and renames the directory once every rank has finished."""
    from torch.distributed import checkpoint as dcp

    final_dir = checkpoint_dir(output_dir, state.step)
    tmp = layout.partial_checkpoint_dir(output_dir, state.step)
    if comm.world.is_main:
        _fresh(tmp)
    comm.barrier()  # the directory is there (and empty) before any rank writes into it
    model_state, optim_state = _trained_state(model, optimizer)
    with _single_process_quiet():
        dcp.save(
            {"model": model_state, "optimizer": optim_state},
            checkpoint_id=layout.sharded_state_dir(tmp),
            no_dist=not comm.world.is_distributed,
        )
    comm.barrier()  # every rank's files are on disk
    size = 0
    if comm.world.is_main:
        _write_trainer_state(tmp, scheduler, state, final)
        _publish(tmp, final_dir)
        size = directory_bytes(final_dir)
    comm.barrier()  # the checkpoint is in place for every rank
    return final_dir, size


def _fresh(directory: Path) -> None:
    """An empty ``directory`` (a leftover of a killed write is removed first)."""
    if directory.exists():
        shutil.rmtree(directory)
    directory.mkdir(parents=True)


def _publish(tmp: Path, final_dir: Path) -> None:
    """Rename the complete ``tmp`` into place (replacing a checkpoint of the same step)."""
    if final_dir.exists():
        shutil.rmtree(final_dir)
    os.replace(tmp, final_dir)


def _write_trainer_state(
    directory: Path,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    state: TrainingState,
    final: bool,
    optimizer: torch.optim.Optimizer | None = None,
) -> None:
    """``trainer_state.pt`` (+ the optimizer's state for an adapter checkpoint) and its JSON twin."""
    raw: dict[str, Any] = {
        "scheduler": scheduler.state_dict(),
        "step": state.step,
        "data_position": state.data_position,
        "rng": _rng_state(),
    }
    if optimizer is not None:
        raw["optimizer"] = optimizer.state_dict()
    torch.save(raw, directory / "trainer_state.pt")
    (directory / "trainer_state.json").write_text(
        json.dumps({"step": state.step, "data_position": state.data_position, "final": final}, indent=2)
    )


def _trained_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The model's trained entries (frozen parameters left out) and the optimizer's state, keyed
    by parameter name whatever the sharding (``get_state_dict``), as DCP saves and loads them."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    frozen = {n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    return {k: v for k, v in model_state.items() if k not in frozen}, optim_state


@contextmanager
def _single_process_quiet() -> Iterator[None]:
    """DCP warns that it assumes one process whenever there is no process group: we mean it."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="torch.distributed is disabled, unavailable or uninitialized", category=UserWarning
        )
        yield


def load_checkpoint(
    path: str | Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
) -> TrainingState:
    """Restore weights, optimizer, scheduler and RNG states from ``path``; returns the counters.

    Every rank calls it: a DCP checkpoint is read collectively (each rank its own shards) when a
    process group is up, else by this one process.
    """
    path = Path(path)
    raw = torch.load(path / "trainer_state.pt", map_location="cpu", weights_only=True)
    sharded = layout.sharded_state_dir(path)
    if sharded.is_dir():
        _load_sharded(sharded, model, optimizer)
    else:
        _load_weights(path, model)
        optimizer.load_state_dict(raw["optimizer"])
    scheduler.load_state_dict(raw["scheduler"])
    _set_rng_state(raw["rng"])
    return TrainingState(step=int(raw["step"]), data_position=int(raw["data_position"]))


def _load_sharded(directory: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Read a DCP checkpoint into the model and optimizer as this run holds them (resharded)."""
    import torch.distributed as dist
    from torch.distributed import checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    model_state, optim_state = _trained_state(model, optimizer)  # initialises AdamW's state
    with _single_process_quiet():
        dcp.load(
            {"model": model_state, "optimizer": optim_state},
            checkpoint_id=directory,
            no_dist=not (dist.is_available() and dist.is_initialized()),
        )
    set_state_dict(
        model,
        optimizer,
        model_state_dict=model_state,
        optim_state_dict=optim_state,
        options=StateDictOptions(strict=False),  # frozen weights are not in the checkpoint
    )


def export(model: torch.nn.Module, directory: str | Path, comm: Comm, *, sharded: bool,
           tokenizer: Any | None = None) -> Path:
    """The trained weights to ``directory`` (``export_weights``); every rank calls it.

    ``sharded`` (FSDP2 parameters): every rank joins the gather of the full state dict first,
    which rank 0 alone receives (on the CPU) and saves; for full fine-tuning those are the fp32
    master weights.
    """
    state = None
    if sharded:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if comm.world.is_main:
        export_weights(model, directory, state, tokenizer=tokenizer)
    comm.barrier()
    return Path(directory)


def export_weights(
    model: torch.nn.Module, directory: str | Path, state_dict: dict[str, Any] | None = None,
    *, tokenizer: Any | None = None,
) -> Path:
    """Save the trained weights alone (the adapter for LoRA) to ``directory``, replacing it.

    ``state_dict``: the weights to save instead of the model's own (the gathered full state of
    sharded parameters). ``tokenizer``: saved beside them (a full fine-tune's ``model/``, which a
    generation job or session on ``job:<id>`` loads as a whole model, tokenizer included; an
    adapter's tokenizer is its base's).
    """
    directory = Path(directory)
    tmp = directory.with_name(directory.name + layout.PARTIAL_SUFFIX)
    _fresh(tmp)
    model.save_pretrained(tmp, **({} if state_dict is None else {"state_dict": state_dict}))
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    _publish(tmp, directory)
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
