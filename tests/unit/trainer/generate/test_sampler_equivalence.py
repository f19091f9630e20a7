"""The sampler against transformers' ``generate``: greedy tokens equal, logprobs close (fp32, CPU).

Tiny random-weight Llama, Qwen3 and GPT-OSS (sliding window 8 on one layer, shorter than most
sequences here, and attention sinks drawn non-zero), without and with a LoRA adapter on every
linear layer (``init_lora_weights=False``: B is not zero, so the adapter changes the logits) run
through the trainer's fused LoRA layers. Eight prompts of 2 to 30 tokens go through 3 slots, so
finished sequences' slots are refilled from the queue; ``max_len`` 36 cuts the long prompts
before ``max_tokens`` (each finishes at its own step). A tiny Gemma 2 adds attention logit
soft-capping and a window of 4.

The reference is ``model.generate(do_sample=False)`` one prompt at a time (no padding), with
peft's own LoRA forward; its raw ``output_logits`` give the logprobs. Tolerance: the sampler
computes the same fp32 ops in another order (a cached key instead of a recomputed one, fp32
scores): the logprobs agree within 1e-4, and the greedy tokens exactly (a flip would need two
logits of these models within ~1e-6 of each other).
"""

from __future__ import annotations

import pytest
import torch

from trainer.features.lora_kernel import fused as lora_fused
from trainer.generate.engine import Engine
from trainer.generate.params import FINISH_LENGTH, FINISH_STOP, Request, SamplingParams

from tests.fixtures.sampler_models import TEXTS, sampler_model

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    # peft 0.21 reads the attribute transformers 5.2x deprecated; not ours to fix.
    pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"),
]

SLOTS, MAX_LEN, MAX_TOKENS = 3, 36, 12
LOGPROB_ATOL = 1e-4


def _model(arch: str, lora: bool) -> tuple[torch.nn.Module, object]:
    return sampler_model(arch, lora)

def _reference(model: torch.nn.Module, prompt: list[int]) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' greedy tokens (a trailing eos dropped) and each step's raw logprobs."""
    new = min(MAX_TOKENS, MAX_LEN - len(prompt))
    with torch.no_grad():
        out = model.generate(
            input_ids=torch.tensor([prompt]), do_sample=False, max_new_tokens=new,
            return_dict_in_generate=True, output_logits=True,
        )
    tokens = out.sequences[0, len(prompt):].tolist()
    return tokens, [torch.log_softmax(step[0].float(), dim=-1) for step in out.logits]


@pytest.mark.parametrize("lora", [False, True], ids=["base", "lora"])
@pytest.mark.parametrize("arch", ["llama", "qwen3", "gpt_oss"])
def test_greedy_decoding_matches_transformers_generate(arch: str, lora: bool, monkeypatch) -> None:
    model, tokenizer = _model(arch, lora)
    prompts = [tokenizer(text)["input_ids"] for text in TEXTS]
    assert min(map(len, prompts)) <= 2 and max(map(len, prompts)) > MAX_LEN - MAX_TOKENS
    references = [_reference(model, p) for p in prompts]
    fused_calls = []
    fused_apply = lora_fused._FusedLoraLinear.apply
    monkeypatch.setattr(lora_fused._FusedLoraLinear, "apply", lambda *a: fused_calls.append(1) or fused_apply(*a))
    installed = lora_fused.install(model) if lora else None
    try:
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=True, top_logprobs=2)
        engine = Engine(model, tokenizer, slots=SLOTS, max_len=MAX_LEN)
        results = engine.generate([Request(tuple(p), params) for p in prompts])
    finally:
        if installed is not None:
            installed.uninstall()
    # every adapted linear of every forward ran the trainer's fused LoRA layer
    assert len(fused_calls) == (installed.fused_base * engine.stats.forwards if lora else 0) and (not lora or fused_calls)
    eos = tokenizer.eos_token_id
    finish_lengths = set()
    for prompt, (ref_tokens, ref_logprobs), result in zip(prompts, references, results):
        [completion] = result.completions
        stopped = ref_tokens[-1:] == [eos]
        assert completion.token_ids == (ref_tokens[:-1] if stopped else ref_tokens), prompt
        assert completion.finish_reason == (FINISH_STOP if stopped else FINISH_LENGTH)
        assert completion.text == tokenizer.decode(completion.token_ids, skip_special_tokens=True)
        for step, logprob in enumerate(completion.logprobs):
            want = ref_logprobs[step]
            assert logprob.logprob == pytest.approx(want[logprob.token_id].item(), abs=LOGPROB_ATOL)
            top_values, top_ids = want.topk(2)
            assert [t for t, _ in logprob.top] == top_ids.tolist()
            assert [v for _, v in logprob.top] == pytest.approx(top_values.tolist(), abs=LOGPROB_ATOL)
        finish_lengths.add(len(prompt) + len(completion.token_ids))
    assert MAX_LEN in finish_lengths and len(finish_lengths) > 2  # some cut by max_len, others by max_tokens
    assert engine.stats.caches_allocated == 1


def test_gemma2_soft_capping_and_a_short_window_match_transformers() -> None:
    """Attention logit soft-capping (which packed training attention refuses) and a window of 4."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    config = Gemma2Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=4, attn_logit_softcapping=0.5,
        query_pre_attn_scalar=8, pad_token_id=0, eos_token_id=None, bos_token_id=2,  # no eos: all run to the end
    )
    model = Gemma2ForCausalLM(config).eval()
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 256, (n,), generator=generator).tolist() for n in (3, 9, 2, 12)]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=True)
    results = Engine(model, None, slots=2, max_len=MAX_LEN).generate([Request(tuple(p), params) for p in prompts])
    for prompt, result in zip(prompts, results):
        with torch.no_grad():
            out = model.generate(input_ids=torch.tensor([prompt]), do_sample=False, max_new_tokens=MAX_TOKENS,
                                 return_dict_in_generate=True, output_logits=True)
        [completion] = result.completions
        assert completion.token_ids == out.sequences[0, len(prompt):].tolist()
        for step, logprob in enumerate(completion.logprobs):
            want = torch.log_softmax(out.logits[step][0].float(), dim=-1)[logprob.token_id].item()
            assert logprob.logprob == pytest.approx(want, abs=LOGPROB_ATOL)
