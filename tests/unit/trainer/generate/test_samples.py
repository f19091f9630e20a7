"""Checkpoint samples through the sampler: transformers' greedy answers, the model left as it was.

The ``sample`` events of a training run are held by tests/unit/trainer/training/test_trainer_guards.py
(``TestEvaluationAndSamples``) and tests/unit/trainer/test_dpo.py.
"""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch

from trainer.generate.samples import Prompt, Sampler
from trainer.model.tiny import build_tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


class TestSampler:
    def test_greedy_answers_equal_transformers_and_the_model_is_restored(self) -> None:
        model, tokenizer = build_tiny_model("llama", seed=0)
        model.train()
        implementation = model.config._attn_implementation
        texts = ["The cat", "Once upon a time", "A", "What is 4 plus one?"]
        prompts = [Prompt(t, tokenizer(t)["input_ids"]) for t in texts]
        got = Sampler(prompts, tokenizer, max_new_tokens=6).generate(model, torch.device("cpu"), nullcontext())
        assert model.training and model.config._attn_implementation == implementation
        for text, prompt, sample in zip(texts, prompts, got):
            with torch.no_grad():
                out = model.eval().generate(torch.tensor([prompt.ids]), do_sample=False, max_new_tokens=6)
            new = [t for t in out[0, len(prompt.ids):].tolist() if t != tokenizer.eos_token_id]
            assert sample == {"prompt": text, "completion": tokenizer.decode(new, skip_special_tokens=True),
                              "tokens": len(new)}
