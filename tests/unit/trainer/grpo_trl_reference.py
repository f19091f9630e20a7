"""TRL 1.15's GRPOTrainer and ftq's GRPO loss on the same completions: one JSON report per variant.

Run as a script in a child process with ``TRITON_INTERPRET=1`` (TRL's GRPO forward scores the
completion tokens through its Triton chunked log-prob head, ``add_fused_lm_head``, which runs on
CPU only in Triton's interpreter, chosen when triton is imported)::

    python tests/unit/trainer/grpo_trl_reference.py MODEL_DIR OUT.json

``tests/unit/trainer/test_grpo_loss.py`` says what is compared and why.
"""

from __future__ import annotations

import copy
import json
import sys
import warnings
from pathlib import Path

import torch

from tests.fixtures.trl_models import lora_model

from trainer.objectives.grpo_loss import GrpoLossConfig, denominator, group_advantages, policy_loss

PROMPTS = ([5, 9], [7, 3, 11, 4, 8], [6, 6, 10])
COMPLETIONS = ([12, 13, 14], [15, 16, 17, 18, 19, 20, 21], [22, 23, 24, 25], [26, 27, 28, 29, 30],
               [31, 32, 33], [34, 35, 36, 37, 38, 39])
REWARDS = torch.tensor([1.0, 0.0, 0.5, 0.25, 2.0, -1.0])
GROUP = 2
MAX_COMPLETION = 8
NOISE = 0.3

VARIANTS = {
    "grpo": GrpoLossConfig(loss_type="grpo"),
    "bnpo": GrpoLossConfig(loss_type="bnpo"),
    "dr_grpo": GrpoLossConfig(loss_type="dr_grpo"),
    "dapo-asymmetric": GrpoLossConfig(loss_type="dapo", epsilon_high=0.28),
    "gspo": GrpoLossConfig(loss_type="grpo", importance_sampling_level="sequence", epsilon_low=3e-4,
                           epsilon_high=4e-4),
    "grpo-delta-kl": GrpoLossConfig(loss_type="grpo", delta=1.3, beta=0.04),
    "dapo-kl": GrpoLossConfig(loss_type="dapo", beta=0.1),
    "dapo-kl-uncorrected": GrpoLossConfig(loss_type="dapo", beta=0.1, kl_bias_correction=False),
}


def _noise(seed: int) -> list[list[float]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(len(c), generator=g) * NOISE).tolist() for c in COMPLETIONS]


def _padded_inputs(advantages: torch.Tensor) -> dict[str, torch.Tensor]:
    prompts = [PROMPTS[i // GROUP] for i in range(len(COMPLETIONS))]
    width_p, width_c = max(map(len, prompts)), max(map(len, COMPLETIONS))
    prompt_ids = torch.tensor([[0] * (width_p - len(p)) + list(p) for p in prompts])
    prompt_mask = torch.tensor([[0] * (width_p - len(p)) + [1] * len(p) for p in prompts])
    completion_ids = torch.tensor([list(c) + [0] * (width_c - len(c)) for c in COMPLETIONS])
    completion_mask = torch.tensor([[1] * len(c) + [0] * (width_c - len(c)) for c in COMPLETIONS])
    return {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
            "completion_mask": completion_mask, "advantages": advantages,
            "num_items_in_batch": completion_mask.sum()}


def _pad(rows: list[list[float]], width: int) -> torch.Tensor:
    return torch.tensor([r + [0.0] * (width - len(r)) for r in rows])


def trl_trainer(tiny_model_dir: str, out_dir: str):
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    args = GRPOConfig(output_dir=out_dir, per_device_train_batch_size=len(COMPLETIONS),
                      num_generations=GROUP, max_completion_length=MAX_COMPLETION, use_cpu=True, bf16=False,
                      report_to=[], gradient_checkpointing=False)
    trainer = GRPOTrainer(model=lora_model(tiny_model_dir), reward_funcs=[lambda completions, **_: [0.0] * len(completions)],
                          args=args, train_dataset=Dataset.from_list([{"prompt": "Hi"}] * len(COMPLETIONS)),
                          processing_class=tokenizer)
    trainer.current_gradient_accumulation_steps = 1
    return trainer


def trl_side(trainer, state: dict, config: GrpoLossConfig, advantages: torch.Tensor) -> tuple[float, dict]:
    """TRL's loss and LoRA gradients, on the trainer's own model (TRL patched its head) set to ``state``."""
    model = trainer.model
    model.load_state_dict(state)
    model.zero_grad(set_to_none=True)
    trainer.loss_type, trainer.beta = config.loss_type, config.beta
    trainer.epsilon_low, trainer.epsilon_high = config.epsilon_low, config.epsilon_high
    trainer.importance_sampling_level = config.importance_sampling_level
    trainer.max_completion_length = MAX_COMPLETION
    trainer.args.delta = config.delta
    trainer.args.use_bias_correction_kl = config.kl_bias_correction
    inputs = _padded_inputs(advantages)
    width = inputs["completion_ids"].shape[1]
    with torch.no_grad():
        current, _, _ = trainer._get_per_token_logps_and_entropies(
            model, torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1),
            torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1), width)
    inputs["old_per_token_logps"] = current + _pad(_noise(1), width)
    inputs["ref_per_token_logps"] = current + _pad(_noise(2), width)
    model.train()
    loss = trainer._compute_loss(model, inputs)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def ftq_side(model, config: GrpoLossConfig, advantages: torch.Tensor, shared: bool) -> tuple[float, dict]:
    """ftq's loss and LoRA gradients on the batch ``Grpo.pack`` lays out: the six sequences whole
    (positions restarting), or ``shared`` (each prompt but its last token once, its two completions
    seeing it as their prefix)."""
    from trainer.features.attention.packed import PackedAttention
    from trainer.features.loss.packed_forward import LOSS_FUSED, packed_token_logprobs
    from trainer.objectives.grpo import Grpo, PromptItem, sequence_advantages

    items = []
    for p, prompt in enumerate(PROMPTS):
        item = PromptItem(p, list(prompt), {}, GROUP, MAX_COMPLETION, shared=shared)
        item.completions = [list(c) for c in COMPLETIONS[p * GROUP:(p + 1) * GROUP]]
        item.advantages = advantages[p * GROUP:(p + 1) * GROUP].tolist()
        items.append(item)
    batch = Grpo().pack(items)
    assert (batch.prefixes is not None) == shared
    attn = PackedAttention("sdpa", cache=True)
    attn.install(model)
    model.train()
    meta = attn.metadata(batch.lengths, "cpu", batch.prefixes)
    mask_T = batch.targets[0] != -100
    seq_T, advantages = sequence_advantages(batch)
    with torch.no_grad():
        current = packed_token_logprobs(model, batch, attn.metadata(batch.lengths, "cpu", batch.prefixes),
                                        LOSS_FUSED)
    noise_old = torch.zeros(batch.num_tokens)
    noise_ref = torch.zeros(batch.num_tokens)
    noise_old[mask_T] = torch.tensor([x for row in _noise(1) for x in row])
    noise_ref[mask_T] = torch.tensor([x for row in _noise(2) for x in row])
    logp_T = packed_token_logprobs(model, batch, meta, LOSS_FUSED)
    numerator, stats = policy_loss(logp_T, current + noise_old, current + noise_ref, advantages, seq_T, mask_T, config)
    loss = numerator / denominator(config, len(COMPLETIONS), int(mask_T.sum()), MAX_COMPLETION)
    assert int(mask_T.sum()) == sum(map(len, COMPLETIONS))
    loss.backward()
    assert stats[2].item() == mask_T.sum().item()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return loss.item(), grads, stats[:2].sum().item()


def compare(model_dir: str, out_dir: str) -> dict:
    advantages, _ = group_advantages(REWARDS, GROUP)
    fresh = lora_model(model_dir)
    state = copy.deepcopy(fresh.state_dict())
    trainer = trl_trainer(model_dir, out_dir)
    report = {}
    for name, config in VARIANTS.items():
        trl_loss, trl_grads = trl_side(trainer, state, config, advantages)
        report[name] = {"trl_loss": trl_loss}
        for layout, shared in (("", False), ("shared_", True)):
            ftq_loss, ftq_grads, clipped = ftq_side(copy.deepcopy(fresh), config, advantages, shared)
            rel = {n: ((ftq_grads[n] - g).norm() / g.norm().clamp_min(1e-30)).item() for n, g in trl_grads.items()
                   if n in ftq_grads}
            report[name] |= {
                f"{layout}ftq_loss": ftq_loss, f"{layout}clipped_tokens": clipped,
                f"{layout}grad_names_match": sorted(trl_grads) == sorted(ftq_grads),
                f"{layout}max_grad_rel_l2": max(rel.values()), f"{layout}worst_grad": max(rel, key=rel.get),
            }
    return report


if __name__ == "__main__":
    warnings.simplefilter("ignore")
    model_dir, out = sys.argv[1], Path(sys.argv[2])
    out.write_text(json.dumps(compare(model_dir, str(out.parent / "trl-run")), indent=1))
