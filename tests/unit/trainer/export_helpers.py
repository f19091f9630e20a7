"""A finished LoRA run on disk without training it: a tiny model and a random (non-zero) adapter."""

from __future__ import annotations

from pathlib import Path

from trainer.training import layout

PROMPT = [{"role": "user", "content": "What is the name of the river?"}]


def fake_finished_run(tmp_path: Path, model_dir: Path, *, seed: int = 1):
    """A TrainConfig whose ``output_dir/adapter`` holds a LoRA adapter with random A and B (an
    untrained one has B = 0 and would merge to the base: the test could not tell)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from tests.unit.trainer.trainer_helpers import make_job

    config = make_job(tmp_path, model_dir)
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    torch.manual_seed(seed)
    lora = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", init_lora_weights=False)
    peft_model = get_peft_model(base, lora)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.mul_(4.0)  # large enough that greedy tokens differ from the base's
    peft_model.save_pretrained(layout.export_dir(config.output_dir, "lora"))
    return config


def prompt_ids(model_dir: Path) -> list[int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return list(tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=True, return_dict=False))


def greedy(model, ids: list[int], n: int = 12) -> list[int]:
    """``n`` argmax tokens, EOS included (no stopping: llama.cpp's ``generate`` does not stop either)."""
    import torch

    seq = list(ids)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(ids):]


def adapter_model(config):
    """Base + the run's adapter, unmerged (what the exports must reproduce)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(config.model.name_or_path)
    return PeftModel.from_pretrained(base, layout.export_dir(config.output_dir, "lora")).eval()


def adapter_greedy(config, ids: list[int], n: int = 12) -> list[int]:
    return greedy(adapter_model(config), ids, n)


def adapter_logits(config, ids: list[int]):
    """The prompt's logits (tokens x vocab, numpy): RoPE or a permutation gone wrong shows here
    even where a random tiny model's argmax does not move."""
    import torch

    with torch.no_grad():
        return adapter_model(config)(torch.tensor([ids])).logits[0].numpy()
