"""Fused LoRA linear (``trainer.features.lora_kernel.fused``) against peft's own ``lora.Linear.forward``.

Tolerances (max abs difference relative to the reference's largest magnitude):
- float32, no autocast: 1e-5 (same matmuls, summation order differs: the update is accumulated
  into the base output by ``addmm_`` instead of a separate multiply and add).
- bf16 autocast: both round, differently (peft rounds the update to bf16 before adding it, we
  add it in the matmul's fp32 accumulator), so each is compared with the float32 result: ours may
  be at most 2x as far from it as peft's in relative L2 (floor 2e-3), and within 5e-2 of peft.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from trainer.features.lora_kernel import fused as lora_fused
from trainer.config import LoraConfig
from trainer.model.load import apply_lora
from trainer.model.tiny import build_tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12)).item()


def _rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def _lora_model(arch: str, *, bias: bool = False, seed: int = 0) -> nn.Module:
    model, _ = build_tiny_model(arch, seed=seed)
    if bias:  # Qwen2-style q/k/v biases: give every linear one, with random values
        for name, module in list(model.named_modules()):
            if isinstance(module, nn.Linear) and "lm_head" not in name:
                module.bias = nn.Parameter(torch.randn(module.out_features) * 0.1)
    model = apply_lora(model, LoraConfig(r=4, alpha=8))
    # peft starts B at zero: give the adapters values so the update and dA are not trivially zero.
    g = torch.Generator().manual_seed(seed + 1)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data = torch.randn(p.shape, generator=g) * 0.05
    return model


def _loss_and_grads(model: nn.Module, ids: torch.Tensor, autocast: bool) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else torch.autocast("cpu", enabled=False)
    with ctx:
        out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.loss.detach(), grads


@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral"])
def test_model_loss_and_lora_grads_match_peft_fp32(arch: str) -> None:
    model = _lora_model(arch)
    ids = torch.randint(0, 500, (2, 24), generator=torch.Generator().manual_seed(3))
    ref_loss, ref_grads = _loss_and_grads(model, ids, autocast=False)
    result = lora_fused.install(model)
    assert len(result.layers) == 2 * 7 and result.fused_base == 2 * 7  # 2 layers x q,k,v,o,gate,up,down
    loss, grads = _loss_and_grads(model, ids, autocast=False)
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-5)
    assert grads.keys() == ref_grads.keys() and any("lora_A" in n for n in grads)
    for name, grad in grads.items():
        assert grad.dtype == ref_grads[name].dtype == torch.float32, name  # fp32 master grads kept
        assert _rel(grad, ref_grads[name]) < 1e-5, name


@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral"])
def test_bf16_autocast_is_as_close_to_fp32_as_peft(arch: str) -> None:
    """Under bf16 autocast both paths round; the fused one must be about as close to the fp32 result
    as peft's own bf16 path (relative L2 at most 2x peft's, floor 2e-3; loss 1.5x) and within 5e-2
    relative L2 of peft."""
    model = _lora_model(arch)
    ids = torch.randint(0, 500, (2, 24), generator=torch.Generator().manual_seed(3))
    exact_loss, exact = _loss_and_grads(model, ids, autocast=False)
    peft_loss, peft_grads = _loss_and_grads(model, ids, autocast=True)
    lora_fused.install(model)
    loss, grads = _loss_and_grads(model, ids, autocast=True)
    assert abs(loss - exact_loss) <= max(1.5 * abs(peft_loss - exact_loss), 2e-3 * exact_loss)
    for name, grad in grads.items():
        assert grad.dtype == torch.float32, name
        assert _rel_l2(grad, exact[name]) <= max(2 * _rel_l2(peft_grads[name], exact[name]), 2e-3), name
        assert _rel_l2(grad, peft_grads[name]) < 5e-2, name


def test_bias_and_gradient_checkpointing() -> None:
    model = _lora_model("llama", bias=True)
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    ids = torch.randint(0, 500, (1, 40), generator=torch.Generator().manual_seed(4))
    ref_loss, ref_grads = _loss_and_grads(model, ids, autocast=False)
    lora_fused.install(model)
    loss, grads = _loss_and_grads(model, ids, autocast=False)
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-5)
    for name, grad in grads.items():
        assert _rel(grad, ref_grads[name]) < 1e-5, name


def test_trainable_base_weight_and_bias_get_gradients() -> None:
    """``full``-style use (base weight trainable) takes the same path: dW and dbias against autograd."""
    torch.manual_seed(0)
    x = torch.randn(3, 5, 16, requires_grad=True)
    w = torch.randn(12, 16, requires_grad=True)
    b = torch.randn(12, requires_grad=True)
    a = torch.randn(4, 16, requires_grad=True)
    bb = torch.randn(12, 4, requires_grad=True)
    out = lora_fused._FusedLoraLinear.apply(x, w, b, a, bb, 0.5, torch.float32, a.detach(), 0.5 * bb.detach())
    ref = x @ w.T + b + 0.5 * (x @ a.T) @ bb.T
    g = torch.randn_like(ref)
    got = torch.autograd.grad(out, (x, w, b, a, bb), g)
    want = torch.autograd.grad(ref, (x, w, b, a, bb), g)
    assert _rel(out, ref) < 1e-5
    for name, gg, ww in zip(["x", "w", "b", "A", "B"], got, want, strict=True):
        assert _rel(gg, ww) < 1e-5, name


def test_update_only_path_over_a_base_with_its_own_autograd() -> None:
    """A base that is not a plain nn.Linear (a 4-bit layer under QLoRA) keeps its forward."""
    torch.manual_seed(1)
    x = torch.randn(2, 7, 16, requires_grad=True)
    w = torch.randn(12, 16, requires_grad=True)
    a = torch.randn(4, 16, requires_grad=True)
    bb = torch.randn(12, 4, requires_grad=True)
    base_out = torch.tanh(x @ w.T)  # anything differentiable
    out = lora_fused._LoraUpdate.apply(base_out, x, a, bb, 2.0, torch.float32, a.detach(), 2.0 * bb.detach())
    ref = torch.tanh(x @ w.T) + 2.0 * (x @ a.T) @ bb.T
    g = torch.randn_like(ref)
    got = torch.autograd.grad(out, (x, w, a, bb), g)
    want = torch.autograd.grad(ref, (x, w, a, bb), g)
    assert _rel(out, ref) < 1e-5
    for name, gg, ww in zip(["x", "w", "A", "B"], got, want, strict=True):
        assert _rel(gg, ww) < 1e-5, name


def test_falls_back_to_peft_outside_the_plain_state() -> None:
    model = _lora_model("llama")
    ids = torch.randint(0, 500, (1, 16), generator=torch.Generator().manual_seed(5))
    lora_fused.install(model)
    layer = lora_fused.lora_linear_layers(model)[0]
    calls = []
    original = layer._ftq_peft_forward
    layer._ftq_peft_forward = lambda *a, **k: calls.append(1) or original(*a, **k)
    with torch.no_grad():
        model(input_ids=ids)
        assert calls == []  # fused path
        with model.disable_adapter():
            base_only = model(input_ids=ids).logits
        assert calls == [1]  # adapters disabled: peft's forward
        lora_fused.install(model).uninstall()
        assert "forward" not in vars(layer)
        model.base_model.disable_adapter_layers()
        assert torch.equal(model(input_ids=ids).logits, base_only)


def test_nonzero_dropout_keeps_peft_forward_in_training() -> None:
    model, _ = build_tiny_model("llama")
    model = apply_lora(model, LoraConfig(r=4, alpha=8, dropout=0.1))
    model.train()
    layer = lora_fused.lora_linear_layers(model)[0]
    assert lora_fused._plain_adapter(layer, {}) is None
    model.eval()  # dropout inactive: the fused path is exact
    assert lora_fused._plain_adapter(layer, {}) == "default"


def test_install_is_idempotent_and_uninstall_restores() -> None:
    model = _lora_model("qwen3")
    first = lora_fused.install(model)
    second = lora_fused.install(model)
    assert len(first.layers) == len(second.layers)
    layer = first.layers[0]
    assert layer.forward.__func__ is lora_fused.fused_forward
    second.uninstall()
    assert "forward" not in vars(layer) and "_ftq_peft_forward" not in vars(layer)
    assert "fused in the compute dtype" in first.describe()


def test_lora_bias_keeps_pefts_forward() -> None:
    """peft's ``lora_bias=True`` gives lora_B a bias, which the fused path does not carry."""
    import peft

    model, _ = build_tiny_model("llama")
    with warnings.catch_warnings():  # "base layer has no bias, merging won't be possible": not used here
        warnings.simplefilter("ignore")
        model = peft.get_peft_model(
            model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_bias=True)
        )
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data = torch.randn_like(p) * 0.1
    ids = torch.randint(0, 500, (1, 10), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        want = model(input_ids=ids).logits
        lora_fused.install(model)
        got = model(input_ids=ids).logits
    layer = lora_fused.lora_linear_layers(model)[0]
    assert lora_fused._plain_adapter(layer, {}) is None
    assert torch.equal(got, want)


def test_a_hooked_base_is_called_not_bypassed() -> None:
    """A forward hook on the base linear must still run: only the update is fused then."""
    model = _lora_model("llama")
    ids = torch.randint(0, 500, (1, 12), generator=torch.Generator().manual_seed(7))
    layer = lora_fused.lora_linear_layers(model)[0]
    layer.get_base_layer().register_forward_hook(lambda mod, args, out: out + 0.5)
    with torch.no_grad():
        want = model(input_ids=ids).logits
        result = lora_fused.install(model)
        got = model(input_ids=ids).logits
    assert result.fused_base == len(result.layers) - 1  # the hooked one takes the update-only path
    assert _rel(got, want) < 1e-5


def test_uninstall_puts_back_an_instance_forward_set_before() -> None:
    model = _lora_model("llama")
    layer = lora_fused.lora_linear_layers(model)[0]
    own = layer.forward  # bound class forward, set on the instance as a wrapper would
    layer.forward = own
    result = lora_fused.install(model)
    assert layer.forward.__func__ is lora_fused.fused_forward
    result.uninstall()
    assert vars(layer)["forward"] is own


class TestAdapterCache:
    """The compute-dtype adapter copies: cast once per optimizer step, never stale."""

    def test_off_until_an_optimizer_is_watched(self) -> None:
        model = _lora_model("llama")
        result = lora_fused.install(model)
        layer = result.layers[0]
        a = layer.lora_A["default"].weight
        b = layer.lora_B["default"].weight
        first = result.cache.get(layer, a, b, 2.0, torch.bfloat16)
        second = result.cache.get(layer, a, b, 2.0, torch.bfloat16)
        assert first[0] is not second[0]  # nothing kept: no optimizer tells when weights change
        result.uninstall()

    def test_reused_within_a_step_and_cleared_by_the_optimizer_step(self) -> None:
        model = _lora_model("llama")
        result = lora_fused.install(model)
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=0.1, fused=True)  # fused: no version bump
        result.cache.watch(optimizer)
        layer = result.layers[0]
        a = layer.lora_A["default"].weight
        b = layer.lora_B["default"].weight
        with torch.no_grad():
            b.normal_()  # peft starts B at zero; make s*B visible
        cached_a, cached_sb = result.cache.get(layer, a, b, 2.0, torch.bfloat16)
        assert result.cache.get(layer, a, b, 2.0, torch.bfloat16)[0] is cached_a
        assert torch.equal(cached_sb, (b.detach() * 2.0).to(torch.bfloat16))
        for p in params:
            p.grad = torch.ones_like(p)
        version = a._version
        optimizer.step()
        assert a._version == version  # why versions alone cannot tell
        fresh_a, fresh_sb = result.cache.get(layer, a, b, 2.0, torch.bfloat16)
        assert fresh_a is not cached_a
        assert torch.equal(fresh_a, a.detach().to(torch.bfloat16))
        assert torch.equal(fresh_sb, (b.detach() * 2.0).to(torch.bfloat16))
        result.uninstall()
        assert not result.cache.enabled and "_ftq_adapter_cache" not in vars(layer)

    def test_kept_for_serving_per_layer_and_adapter_and_refreshed_in_place(self) -> None:
        import peft

        model = _lora_model("llama")
        model.add_adapter("second", peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
        result = lora_fused.install(model)
        result.cache.keep()
        assert result.cache.enabled
        layer = result.layers[0]
        first = layer.lora_A["default"].weight, layer.lora_B["default"].weight
        second = layer.lora_A["second"].weight, layer.lora_B["second"].weight
        cached = result.cache.get(layer, *first, 2.0, torch.bfloat16)
        other = result.cache.get(layer, *second, 2.0, torch.bfloat16)
        # a second adapter of the layer does not evict the first: a graph captured over it stays valid
        assert result.cache.get(layer, *first, 2.0, torch.bfloat16)[0] is cached[0]
        assert result.cache.get(layer, *second, 2.0, torch.bfloat16)[0] is other[0]
        with torch.no_grad():
            first[1].add_(1.0)  # any in-place change bumps the version
        fresh = result.cache.get(layer, *first, 2.0, torch.bfloat16)
        # refreshed where it is: a CUDA graph captured over the copy reads the new values
        assert fresh[1] is cached[1] and torch.equal(fresh[1], (first[1].detach() * 2.0).to(torch.bfloat16))
        assert result.cache.get(layer, *first, 2.0, torch.bfloat16)[1] is cached[1]
        result.uninstall()
        assert not result.cache.enabled

    def test_an_in_place_copy_into_the_masters_is_seen(self) -> None:
        model = _lora_model("llama")
        result = lora_fused.install(model)
        result.cache.watch(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0))
        layer = result.layers[0]
        a = layer.lora_A["default"].weight
        b = layer.lora_B["default"].weight
        cached_a, _ = result.cache.get(layer, a, b, 1.0, torch.float32)
        with torch.no_grad():
            a.copy_(torch.randn_like(a))  # a load_state_dict does this
        assert torch.equal(result.cache.get(layer, a, b, 1.0, torch.float32)[0], a.detach())
        result.uninstall()

    def test_training_steps_equal_the_uncached_path(self) -> None:
        """Three AdamW steps with the cache on give the same losses and weights as with it off."""
        runs = []
        for cached in (False, True):
            torch.manual_seed(0)
            model = _lora_model("llama")
            result = lora_fused.install(model)
            params = [p for p in model.parameters() if p.requires_grad]
            optimizer = torch.optim.AdamW(params, lr=1e-2)
            if cached:
                result.cache.watch(optimizer)
            ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
            losses = []
            for _ in range(3):
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                losses.append(loss.item())
            runs.append((losses, [p.detach().clone() for p in params]))
            result.uninstall()
        assert runs[0][0] == pytest.approx(runs[1][0], rel=1e-6)
        for p, q in zip(runs[0][1], runs[1][1], strict=True):
            assert torch.allclose(p, q, rtol=1e-5, atol=1e-7)
