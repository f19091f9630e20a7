"""TRL's DPOTrainer and ftq's DPO loss on the same pairs, the same LoRA model: one JSON report.

Run as a script in a child process with ``TRITON_INTERPRET=1`` (TRL 1.15's DPO forward always
takes its Triton chunked log-prob kernel, which runs on CPU only in Triton's interpreter, chosen
when triton is imported)::

    python tests/unit/trainer/dpo_trl_reference.py MODEL_DIR OUT.json [BETA]

TRL's side is its own pipeline: ``DPOTrainer`` tokenizes the conversational pairs, its collator
pads them into one batch of chosen-then-rejected rows, ``compute_loss`` runs the policy and the
reference (the same peft model with the adapter disabled) and its sigmoid loss, then backward.
The adapter starts with random B (peft starts it at 0, which would make policy = reference and
every A gradient zero), so the loss and every gradient are non-trivial.
ftq's side tokenizes OpenAI-format records with ``trainer.objectives.preference``, packs them into one row
with the packed-attention metadata and runs ``trainer.objectives.dpo.DpoLoss`` on the fused kernel.
"""

from __future__ import annotations

import copy
import json
import sys
import warnings
from pathlib import Path

import torch

from tests.fixtures.trl_models import lora_model

QUESTIONS = ("What is one plus one?", "Name a colour.", "Say hello to the model.", "Count to three.")
GOOD = ("Two.", "Blue is a colour.", "Hello, model!", "One, two, three.")
BAD = ("I do not know, sorry.", "No.", "Goodbye then, I think.", "Many.")


def records() -> list[dict]:
    """The pairs in OpenAI's DPO format."""
    return [
        {"input": {"messages": [{"role": "user", "content": q}]},
         "preferred_output": [{"role": "assistant", "content": good}],
         "non_preferred_output": [{"role": "assistant", "content": bad}]}
        for q, good, bad in zip(QUESTIONS, GOOD, BAD)
    ]


def trl_side(model: torch.nn.Module, tokenizer, beta: float, out_dir: str) -> dict:
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    rows = [{"prompt": r["input"]["messages"], "chosen": r["preferred_output"], "rejected": r["non_preferred_output"]}
            for r in records()]
    args = DPOConfig(output_dir=out_dir, beta=beta, per_device_train_batch_size=len(rows), bf16=False,
                     use_cpu=True, report_to=[], gradient_checkpointing=False)
    trainer = DPOTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tokenizer)
    # Given a peft model with an adapter, TRL copies it as a "ref" adapter (re-training an existing
    # adapter). ftq trains a new adapter, whose reference is the base: TRL's own path for that is
    # no "ref" adapter (adapters disabled), so remove the copy.
    trainer.model.delete_adapter("ref")
    examples = [trainer.train_dataset[i] for i in range(len(rows))]
    batch = trainer.data_collator(examples)
    trainer.model.train()
    loss = trainer.compute_loss(trainer.model, batch)
    loss.backward()
    margins = trainer._metrics["train"].get("rewards/margins", [None])
    return {
        "loss": loss.item(),
        "tokens": [e["prompt_ids"] + e["chosen_ids"] for e in examples] + [e["prompt_ids"] + e["rejected_ids"] for e in examples],
        "grads": {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad},
        "margin": margins[-1],
    }


def ftq_side(model: torch.nn.Module, tokenizer, beta: float, shared: bool) -> dict:
    """ftq's DPO loss on the batch ``Dpo.pack`` lays out: each pair's two whole sequences, or
    ``shared`` (the prompt once, both answers continuing it as their prefix)."""
    from trainer.features.attention.packed import PackedAttention
    from trainer.config import DpoConfig
    from trainer.objectives.dpo import DpoLoss, step_fields
    from trainer.features.loss.packed_forward import LOSS_FUSED
    from trainer.objectives.preference import pack_pairs, tokenize_pair

    pairs = [tokenize_pair(r, tokenizer) for r in records()]
    attn = PackedAttention("sdpa", cache=True)
    attn.install(model)
    batch = pack_pairs(pairs, shared)
    assert (batch.prefixes is not None) == shared
    assert not shared or all(p >= 0 for p in batch.prefixes[1::3]), batch.prefixes  # every prompt shared
    dpo = DpoLoss(DpoConfig(beta=beta), LOSS_FUSED)
    model.train()
    loss = dpo(model, batch, attn.metadata(batch.lengths, "cpu", batch.prefixes), len(pairs))
    loss.backward()
    return {
        "loss": loss.item(),
        "tokens": [p.chosen.input_ids for p in pairs] + [p.rejected.input_ids for p in pairs],
        "grads": {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad},
        "margin": step_fields(dpo.last)["reward_margin"],
    }


def compare(model_dir: str, beta: float, out_dir: str) -> dict:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = lora_model(model_dir)
    twins = [copy.deepcopy(model) for _ in range(2)]
    trl = trl_side(model, tokenizer, beta, out_dir)
    norm = lambda grads: torch.sqrt(sum(g.double().pow(2).sum() for g in grads.values())).item()
    report = {"trl_loss": trl["loss"], "trl_margin": trl["margin"], "trl_grad_norm": norm(trl["grads"])}
    for layout, twin, shared in (("", twins[0], False), ("shared_", twins[1], True)):
        ftq = ftq_side(twin, tokenizer, beta, shared)
        rel = {
            name: ((ftq["grads"][name] - g).norm() / g.norm().clamp_min(1e-30)).item()
            for name, g in trl["grads"].items()
        }
        report |= {
            f"{layout}same_tokens": trl["tokens"] == ftq["tokens"],
            f"{layout}ftq_loss": ftq["loss"], f"{layout}ftq_margin": ftq["margin"],
            f"{layout}ftq_grad_norm": norm(ftq["grads"]),
            f"{layout}grad_names_match": trl["grads"].keys() == ftq["grads"].keys(),
            f"{layout}max_grad_rel_l2": max(rel.values()), f"{layout}worst_grad": max(rel, key=rel.get),
        }
    return report


if __name__ == "__main__":
    warnings.simplefilter("ignore")
    model_dir, out = sys.argv[1], Path(sys.argv[2])
    beta = float(sys.argv[3]) if len(sys.argv) > 3 else 0.1
    out.write_text(json.dumps(compare(model_dir, beta, str(out.parent / "trl-run"))))
