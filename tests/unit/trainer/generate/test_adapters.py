"""Several adapters of one base in one batch: each request continues as with its adapter alone.

A tiny Llama with two random LoRA adapters (B non-zero) under the trainer's fused LoRA layers.
One call mixes requests for adapter ``first``, adapter ``second``, the base and the active adapter
(``first``);
each must give the tokens (exactly, greedy and seeded) and logprobs (1e-4: peft's per-adapter
path sums in another order than the fused one) of a call where the model runs that adapter alone.
"""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch

from trainer.features.lora_kernel import fused as lora_fused
from trainer.generate.engine import Engine
from trainer.generate.params import BASE_ADAPTER, Request, SamplingParams
from trainer.model.tiny import build_tiny_model

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"),
]

TEXTS = ("The cat", "Once upon a time", "A", "What is 4 plus one?")
LOGPROB_ATOL = 1e-4


def _two_adapters() -> tuple[torch.nn.Module, object]:
    import peft

    model, tokenizer = build_tiny_model("llama", seed=0)
    config = peft.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", init_lora_weights=False)
    torch.manual_seed(1)
    model = peft.get_peft_model(model, config, adapter_name="first")
    torch.manual_seed(2)
    model.add_adapter("second", config)
    model.set_adapter("first")
    return model.eval(), tokenizer


def _params(i: int) -> SamplingParams:
    if i % 2:
        return SamplingParams(max_tokens=8, temperature=0.8, seed=i, logprobs=True)
    return SamplingParams(max_tokens=8, temperature=0.0, logprobs=True)


def test_a_mixed_batch_gives_each_request_its_adapters_tokens() -> None:
    model, tokenizer = _two_adapters()
    prompts = [tuple(tokenizer(t)["input_ids"]) for t in TEXTS]
    installed = lora_fused.install(model)
    try:
        engine = Engine(model, tokenizer, slots=3, max_len=48)
        names = ["first", "second", BASE_ADAPTER, None] * 2
        mixed = engine.generate([Request(prompts[i % 4], _params(i), adapter=name) for i, name in enumerate(names)])
        alone = {}
        for name in ("first", "second", BASE_ADAPTER):
            if name != BASE_ADAPTER:
                model.set_adapter(name)
            with model.disable_adapter() if name == BASE_ADAPTER else nullcontext():
                alone[name] = engine.generate([Request(prompts[i % 4], _params(i)) for i in range(len(names))])
        model.set_adapter("first")
    finally:
        installed.uninstall()
    for i, name in enumerate(names):
        got, want = mixed[i].completions[0], alone[name or "first"][i].completions[0]
        assert got.token_ids == want.token_ids, (i, name)
        assert [e.logprob for e in got.logprobs] == pytest.approx([e.logprob for e in want.logprobs], abs=LOGPROB_ATOL)
    assert alone["first"][0].completions[0].token_ids != alone["second"][0].completions[0].token_ids  # the adapters matter


def test_requests_that_all_name_the_active_adapter_run_the_plain_path(monkeypatch) -> None:
    """A chat session on one tuned model names its adapter in every request: the step runs the
    fused LoRA layers (and, on CUDA, the decode graphs), not the per-token path, with the tokens of
    unnamed requests exactly."""
    model, tokenizer = _two_adapters()
    prompts = [tuple(tokenizer(t)["input_ids"]) for t in TEXTS]
    installed = lora_fused.install(model)
    paths: list[str | None] = []
    forward = Engine._forward
    monkeypatch.setattr(Engine, "_forward", lambda self, plan, state, active, ids=None: paths.append(active) or forward(
        self, plan, state, active, ids))
    try:
        engine = Engine(model, tokenizer, slots=3, max_len=48)
        runs = {}
        for adapter in ("second", "first"):
            model.set_adapter(adapter)
            for name in (adapter, None):
                paths.clear()
                runs[adapter, name] = engine.generate([Request(p, _params(i), adapter=name) for i, p in enumerate(prompts)])
                assert paths and set(paths) == {None}, (adapter, name)
        paths.clear()
        engine.generate([Request(prompts[0], _params(0), adapter="second")])  # not the active one
        assert set(paths) == {"first"}
    finally:
        installed.uninstall()
    for adapter in ("second", "first"):
        for named, unnamed in zip(runs[adapter, adapter], runs[adapter, None]):
            assert named.completions[0].token_ids == unnamed.completions[0].token_ids
            assert [e.logprob for e in named.completions[0].logprobs] == [e.logprob for e in unnamed.completions[0].logprobs]
    assert runs["first", None][0].completions[0].token_ids != runs["second", None][0].completions[0].token_ids


def test_naming_an_adapter_needs_a_peft_model() -> None:
    model, tokenizer = build_tiny_model("llama", seed=0)
    with pytest.raises(ValueError, match="carries no peft adapters"):
        Engine(model, tokenizer, slots=1, max_len=16).generate([Request((1, 2), adapter="first")])


def test_transformers_own_peft_integration_reads_its_active_adapter() -> None:
    """A plain transformers model given an adapter by ``model.add_adapter`` (transformers' own peft
    integration, which needs peft >= 0.22: the lock's peft is older, so its API is stood in for
    here) has ``active_adapter`` as a method and ``active_adapters()`` listing the active ones: the
    engine reads the one active adapter from it (CUDA graphs are keyed by it)."""
    from trainer.generate.engine import _active_adapter, _current_adapter

    class Integrated(torch.nn.Module):
        def __init__(self, names: list[str]) -> None:
            super().__init__()
            self.peft_config, self.names = dict.fromkeys(names), names

        def active_adapter(self) -> str:
            return self.names[0]

        def active_adapters(self) -> list[str]:
            if not self.names:
                raise ValueError("No adapter loaded. Please load an adapter first.")
            return self.names

    assert _current_adapter(Integrated(["tuned"])) == "tuned" == _active_adapter(Integrated(["tuned"]))
    assert _current_adapter(Integrated(["a", "b"])) is None and _current_adapter(Integrated([])) is None
    with pytest.raises(ValueError, match="has several active adapters"):
        _active_adapter(Integrated(["a", "b"]))
    model, _ = build_tiny_model("llama", seed=0)
    assert _current_adapter(model) is None
