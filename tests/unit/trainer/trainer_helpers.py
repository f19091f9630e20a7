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


class Recorder:
    """An ``emit`` for ``trainer.training.train.run`` that keeps the events in memory."""

    def __init__(self) -> None:
        self.events: list[dict] = []

    def __call__(self, type_: str, **payload: object) -> dict:
        from trainer.events import make_event

        event = make_event(type_, **payload)
        self.events.append(event)
        return event

    def of(self, type_: str) -> list[dict]:
        return [e for e in self.events if e["type"] == type_]

    def logs(self) -> list[str]:
        return [e["message"] for e in self.of("log")]


def train_lora(out_dir: Path, model_dir: Path, monkeypatch, *, steps: int, facts: dict | None = None,
               **overrides: object) -> tuple[Recorder, dict]:
    """``steps`` optimizer steps of 2 micro-batches at lr 1e-2 with gradient checkpointing through
    ``trainer.training.train.run``; returns the events and the saved LoRA weights.

    ``facts``: ``ModelFacts`` fields the plan is handed instead of the model's (e.g. a reason in
    ``fused_loss`` switches the fused loss off). ``monkeypatch`` is undone after the run, so
    whatever the caller patched for this run (the plan) is undone too. ``overrides`` replace
    top-level ``TrainConfig`` fields, as in ``make_job``.
    """
    import dataclasses

    from safetensors.torch import load_file

    from trainer.training import train as train_module
    from trainer.config import OptimConfig
    from trainer.model.load import model_facts

    out_dir.mkdir(parents=True)
    config = make_job(
        out_dir,
        model_dir,
        optim=OptimConfig(max_steps=steps, learning_rate=1e-2, grad_accum=2),
        **{"gradient_checkpointing": True, **overrides},
    )
    if facts:
        monkeypatch.setattr(
            train_module, "model_facts", lambda cfg: dataclasses.replace(model_facts(cfg), **facts)
        )
    recorder = Recorder()
    result = train_module.run(config, recorder)
    monkeypatch.undo()
    assert result.status == "succeeded", result.message
    return recorder, load_file(Path(result.adapter_path) / "adapter_model.safetensors")


def rel_l2(a, b) -> float:
    """Relative L2 error of tensor ``a`` against reference ``b``, in float64."""
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def lora_model(arch: str, seed: int = 0):
    """A tiny ``arch`` with peft LoRA on q,k,v,o,gate,up,down; norm weights and LoRA B made random."""
    import torch

    from trainer.config import LoraConfig
    from trainer.model.load import apply_lora
    from trainer.model.tiny import build_tiny_model

    model, _ = build_tiny_model(arch, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # HF starts norm weights at 1 (Gemma 0): make the weight's rounding matter
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn(p.shape, generator=g) * 0.3)
    model = apply_lora(model, LoraConfig(r=4, alpha=8))
    for name, p in model.named_parameters():
        if "lora_B" in name:  # peft starts B at zero, which would make every dA zero
            p.data = torch.randn(p.shape, generator=g) * 0.05
    return model


def loss_and_grads(model, ids, autocast: bool) -> tuple:
    """The causal-LM loss on ``ids`` (labels = inputs) and every trainable parameter's gradient,
    in fp32 or under CPU bf16 autocast."""
    import torch

    model.zero_grad(set_to_none=True)
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else torch.autocast("cpu", enabled=False)
    with ctx:
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    assert grads and all(g.abs().sum() > 0 for g in grads.values()), "every LoRA weight must get a gradient"
    return loss.detach(), grads


def random_ids(seed: int = 0):
    """A (2, 24) batch of token ids in [6, 500), seeded."""
    import torch

    return torch.randint(6, 500, (2, 24), generator=torch.Generator().manual_seed(seed))


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


def tiny_model_for_gpu(directory: Path, arch: str = "llama") -> Path:
    """``trainer.model.tiny``'s model at head dim 64 (its default 16 is below what the Triton
    varlen kernel takes), saved with its tokenizer: what the GPU tests train with every switch on
    ``auto``."""
    import torch
    from transformers import AutoModelForCausalLM

    from trainer.model.tiny import build_config, build_tokenizer

    tokenizer = build_tokenizer()
    config = build_config(arch, len(tokenizer), tokenizer.pad_token_id, tokenizer.bos_token_id,
                          tokenizer.eos_token_id)
    config.head_dim = 64
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
