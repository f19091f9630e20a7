"""Tiny models: loadable with the Auto classes, deterministic, fast."""

from __future__ import annotations

import time

import pytest
import torch

from trainer.model.tiny import ARCHITECTURES, build_tokenizer, make_tiny_model


class TestTinyModel:
    @pytest.mark.parametrize("arch", ARCHITECTURES)
    def test_saved_model_and_tokenizer_load_with_auto_classes(self, tmp_path, arch):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        start = time.perf_counter()
        make_tiny_model(tmp_path, arch, seed=0)
        assert time.perf_counter() - start < 15
        model = AutoModelForCausalLM.from_pretrained(tmp_path)
        tokenizer = AutoTokenizer.from_pretrained(tmp_path)
        assert model.config.hidden_size == 64 and model.config.num_hidden_layers == 2
        ids = tokenizer(
            "The engineer checks the report.", return_tensors="pt"
        ).input_ids
        assert ids[0, 0].item() == tokenizer.bos_token_id
        assert model(input_ids=ids).logits.shape == (1, ids.shape[1], len(tokenizer))
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}],
            tokenize=False,
            add_generation_prompt=True,
        )
        assert text == "<|bos|><|user|>\nhi<|eos|>\n<|assistant|>\n"

    def test_same_seed_same_weights_and_tokenizer(self, tmp_path):
        from transformers import AutoModelForCausalLM

        a = AutoModelForCausalLM.from_pretrained(
            make_tiny_model(tmp_path / "a", "qwen3", seed=5)
        )
        b = AutoModelForCausalLM.from_pretrained(
            make_tiny_model(tmp_path / "b", "qwen3", seed=5)
        )
        for (name, pa), (_, pb) in zip(
            a.state_dict().items(), b.state_dict().items(), strict=True
        ):
            assert torch.equal(pa, pb), name
        assert build_tokenizer().get_vocab() == build_tokenizer().get_vocab()
