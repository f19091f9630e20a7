"""``trainer.features.lora_kernel.siblings``: q/k/v (and gate/up) take ``x @ A^T`` in one matmul
when a served model runs without autograd; the outputs are the separate matmuls' (fp32 on the CPU,
within 1e-6: another GEMM shape may sum in another order), and training never takes the path."""

from __future__ import annotations

import pytest
import torch

from tests.fixtures.sampler_models import TEXTS, sampler_model
from trainer.features.lora_kernel import fused as lora_fused
from trainer.features.lora_kernel import siblings
from trainer.generate import kernels
from trainer.generate.engine import Engine
from trainer.generate.params import Request, SamplingParams

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"),
]


@pytest.fixture
def stacked_calls(monkeypatch) -> list[int]:
    calls: list[int] = []
    stack = siblings.SiblingGroup._stack
    monkeypatch.setattr(siblings.SiblingGroup, "_stack", lambda self, a: calls.append(len(a)) or stack(self, a))
    return calls


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


def _served_logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """``_logits`` with ``trainer.generate.kernels`` installed for the call."""
    served = kernels.install(model)
    try:
        return _logits(model, ids)
    finally:
        served.uninstall()


def test_a_served_forward_takes_each_groups_a_side_once_and_gives_the_same_logits(stacked_calls) -> None:
    model, _ = sampler_model("llama", True)
    ids = torch.randint(3, 500, (2, 9), generator=torch.Generator().manual_seed(0))
    alone = lora_fused.install(model)
    alone.cache.keep()
    want = _logits(model, ids)
    alone.uninstall()
    got = _served_logits(model, ids)
    layers = model.config.num_hidden_layers
    assert stacked_calls == [3, 2] * layers  # one stacked matmul for q/k/v, one for gate/up, per layer
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert not any("_ftq_siblings" in vars(layer) for layer in lora_fused.lora_linear_layers(model))


def test_training_and_grad_enabled_forwards_never_take_it(stacked_calls) -> None:
    model, _ = sampler_model("llama", True)
    served = kernels.install(model)
    try:
        ids = torch.randint(3, 500, (1, 6), generator=torch.Generator().manual_seed(1))
        model(input_ids=ids).logits.sum().backward()  # grad enabled: the autograd path
    finally:
        served.uninstall()
    assert stacked_calls == []
    assert all(p.grad is not None for n, p in model.named_parameters() if "lora_A" in n)


def test_the_sampler_gives_the_ungrouped_tokens_and_logprobs(stacked_calls) -> None:
    model, tokenizer = sampler_model("llama", True)
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=True)
    requests = [Request(tuple(tokenizer(t)["input_ids"]), params) for t in TEXTS]
    runs = []
    for grouped in (False, True):
        installed = kernels.install(model)
        if not grouped:
            siblings.ungroup(lora_fused.lora_linear_layers(model))
        try:
            runs.append([r.completions[0] for r in Engine(model, tokenizer, slots=3, max_len=40).generate(requests)])
        finally:
            installed.uninstall()
    assert stacked_calls  # the grouped run took it
    for a, b in zip(*runs):
        assert a.token_ids == b.token_ids
        assert [t.logprob for t in a.logprobs] == pytest.approx([t.logprob for t in b.logprobs], abs=1e-5)


def test_another_input_or_a_second_call_recomputes_and_each_adapter_keeps_its_stack() -> None:
    layers = [torch.nn.Linear(4, 4) for _ in range(3)]
    group = siblings.SiblingGroup(layers)
    first = [torch.randn(2, 4) for _ in range(3)]
    second = [torch.randn(3, 4) for _ in range(3)]
    x = torch.randn(5, 4)
    parts = [group.down(layer, x, x, first) for layer in layers]
    for part, a in zip(parts, first):
        torch.testing.assert_close(part, x @ a.t())
    other = torch.randn(5, 4)
    torch.testing.assert_close(group.down(layers[1], other, other, first), other @ first[1].t())
    torch.testing.assert_close(group.down(layers[1], other, other, first), other @ first[1].t())  # called twice
    torch.testing.assert_close(group.down(layers[2], x, x, second), x @ second[2].t())
    assert len(group._stacked) == 2  # a graph captured over the first adapter's stack still finds it


def test_an_adapter_loaded_in_place_is_served_in_place(stacked_calls) -> None:
    """A served adapter overwritten in place (``load_state_dict``): the kept copies, the stacked
    ``A`` and the block-diagonal ``sB`` keep their tensors (a captured graph reads them where they
    are) and hold the new values: the logits are a fresh install's."""
    model, _ = sampler_model("llama", True)
    ids = torch.randint(3, 500, (1, 7), generator=torch.Generator().manual_seed(2))
    served = kernels.install(model)
    try:
        _logits(model, ids)
        group = vars(model.base_model.model.model.layers[0].self_attn.q_proj)["_ftq_siblings"]
        kept = {key: (entry[0], entry[0].clone()) for key, entry in group._stacked.items()}
        assert len(kept) == 2  # the stacked A and the block-diagonal sB of the one adapter
        torch.manual_seed(5)
        model.load_state_dict({n: torch.randn_like(p) for n, p in model.named_parameters() if "lora_" in n}, strict=False)
        got = _logits(model, ids)
        for key, (tensor, before) in kept.items():
            assert group._stacked[key][0] is tensor and not torch.equal(tensor, before)
    finally:
        served.uninstall()
    torch.testing.assert_close(got, _served_logits(model, ids), rtol=0, atol=0)  # a fresh install


def test_only_modules_whose_named_siblings_are_all_fused_are_grouped() -> None:
    model, _ = sampler_model("llama", True)
    installed = lora_fused.install(model)
    try:
        layers = [layer for layer in installed.layers if not layer.__class__.__name__.endswith("Embedding")]
        attention = model.base_model.model.model.layers[0].self_attn
        without_v = [layer for layer in layers if layer is not attention.v_proj]
        groups = siblings.group_siblings(model, without_v)
        assert groups == 2 * model.config.num_hidden_layers - 1  # layer 0's q/k are not grouped without v
        assert "_ftq_siblings" not in vars(attention.q_proj)
    finally:
        siblings.ungroup(installed.layers)
        installed.uninstall()


def test_fused_base_weights_are_views_of_one_matrix_until_uninstalled() -> None:
    """A served model's q/k/v and gate/up base weights are rows of one matrix per group (one base
    matmul for the group); the weights' values do not change, and ``uninstall`` gives each its own
    storage again."""
    model, _ = sampler_model("llama", True)
    attention = model.base_model.model.model.layers[0].self_attn
    bases = [getattr(attention, name).get_base_layer() for name in ("q_proj", "k_proj", "v_proj")]
    values = [base.weight.detach().clone() for base in bases]
    served = kernels.install(model)
    try:
        group = vars(attention.q_proj)["_ftq_siblings"]
        assert group.weight is not None and "with their base weights as one matrix" in served.describe()
        storage = group.weight.untyped_storage().data_ptr()
        assert all(base.weight.untyped_storage().data_ptr() == storage for base in bases)
        assert all(torch.equal(base.weight, value) for base, value in zip(bases, values))
    finally:
        served.uninstall()
    assert len({base.weight.untyped_storage().data_ptr() for base in bases}) == 3
    assert all(torch.equal(base.weight, value) for base, value in zip(bases, values))


@pytest.mark.parametrize("arch", ["qwen3", "gpt_oss"])
def test_fused_groups_with_biases_and_head_norms_give_the_separate_layers_logits(arch: str) -> None:
    """GPT-OSS's q/k/v carry biases (one concatenated bias for the group) and Qwen3 normalizes
    each head of q and k (a strided view of the group's output goes through its RMSNorm): fp32
    logits of the fused groups equal those of the layers computed one by one."""
    model, _ = sampler_model(arch, True)
    ids = torch.randint(3, 500, (2, 9), generator=torch.Generator().manual_seed(4))
    alone = lora_fused.install(model)
    alone.cache.keep()
    want = _logits(model, ids)
    alone.uninstall()
    served = kernels.install(model)
    try:
        assert "0 with their base weights" not in served.describe()
        got = _logits(model, ids)
    finally:
        served.uninstall()
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_a_group_whose_weights_were_rebound_steps_aside() -> None:
    """After ``fuse_weights``, something that rebinds a base weight (``model.double()``, an assigning
    ``load_state_dict``) leaves the group's matrix with the old values: the group then lets each
    layer compute alone, so the served logits follow the model's weights."""
    model, _ = sampler_model("llama", True)
    ids = torch.randint(3, 500, (1, 6), generator=torch.Generator().manual_seed(6))
    served = kernels.install(model)
    try:
        attention = model.base_model.model.model.layers[0].self_attn
        group = vars(attention.q_proj)["_ftq_siblings"]
        assert group.weights_current()
        model.double()
        with torch.no_grad():
            attention.q_proj.get_base_layer().weight.zero_()
        assert not group.weights_current()
        got = _logits(model, ids)
    finally:
        served.uninstall()
    alone = lora_fused.install(model)
    alone.cache.keep()
    try:
        want = _logits(model, ids)
    finally:
        alone.uninstall()
    torch.testing.assert_close(got, want, rtol=0, atol=1e-9)
