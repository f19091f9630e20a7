"""Helpers shared by the trainer tests (imported by name: pytest puts this folder on sys.path)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[3]


def write_jsonl(path: Path, records: list[object]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def repetitive_chat(n: int = 40) -> list[dict]:
    """A dataset a tiny model can fit within a few dozen steps: five questions with fixed answers."""
    return [
        {
            "messages": [
                {"role": "user", "content": f"What is {i % 5} plus one?"},
                {
                    "role": "assistant",
                    "content": f"The answer is {i % 5 + 1}. The model trains.",
                },
            ]
        }
        for i in range(n)
    ]


def make_job(tmp_path: Path, model_dir: Path, **overrides: object):
    """A TrainConfig for a short CPU run on the repetitive chat set; ``overrides`` replace top-level fields."""
    from trainer.config import (
        DataConfig,
        LoraConfig,
        ModelConfig,
        OptimConfig,
        TrainConfig,
    )

    train = write_jsonl(tmp_path / "train.jsonl", repetitive_chat())
    fields: dict[str, object] = {
        "model": ModelConfig(str(model_dir)),
        "data": DataConfig(str(train), max_seq_len=64, batch_tokens=256),
        "optim": OptimConfig(max_steps=30, learning_rate=1e-2, warmup_steps=2),
        "lora": LoraConfig(r=8, alpha=16),
        "output_dir": str(tmp_path / "out"),
        "gradient_checkpointing": False,
        "device": "cpu",  # unit tests hold CPU numbers (exact resume, no MFU) even on a GPU machine
    }
    fields.update(overrides)
    return TrainConfig(**fields)  # type: ignore[arg-type]


def run_cli(
    *args: str, timeout: float = 120, **popen: object
) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "PYTHONWARNINGS": "ignore"}
    return subprocess.run(
        [sys.executable, "-m", "trainer", *args],
        cwd=REPO_ROOT,
        env=env,
        check=False,
        capture_output=True,
        text=True,
        timeout=timeout,
        **popen,
    )


def events_of(stdout: str) -> list[dict]:
    from trainer.events import parse_line

    return [e for e in map(parse_line, stdout.splitlines()) if e is not None]
