"""MoE grouped routing (trainer/features/moe/routing.py): the metadata by hand, and grouped == eager.

Equivalence: tiny random-weight GPT-OSS / Qwen3-MoE / Mixtral causal LMs (hidden 64, 8 experts,
top-2, 2 layers, float32) run once with the grouped forward and once with transformers' eager
per-expert loop; logits, loss and every gradient (all weights in ``full`` mode; LoRA adapters on
attention and on the 3-D expert weights in ``lora`` mode) must agree to a relative 1e-5 of the
reference's largest magnitude. On CPU the grouped path runs its loop fallback; the grouped_mm
path is held to the same reference on a GPU by tests/gpu/test_moe_gpu.py. The Triton gate kernel
runs on CPU in Triton's interpreter, in a child process (``TRITON_INTERPRET=1`` must be set before
the kernels are decorated, at import): this file run as a script prints the errors as JSON.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from trainer.features.moe import routing as moe_routing
from trainer.features.moe.metadata import build_routing
from trainer.features.moe.routing import grouped_linear, install, supported

REL_TOL = 1e-5
"""fp32: the grouped path sums the same products in another order (bmm over K vs per-expert index_add)."""

ARCHS = ("gpt_oss", "qwen3_moe", "mixtral")
REPO_ROOT = Path(__file__).resolve().parents[5]


def _config(arch: str, experts: int = 8):
    import transformers

    common = {
        "vocab_size": 128,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "tie_word_embeddings": False,
    }
    if arch == "gpt_oss":
        return transformers.GptOssConfig(
            **common, intermediate_size=32, head_dim=16, num_local_experts=experts, num_experts_per_tok=2,
            layer_types=["sliding_attention", "full_attention"], sliding_window=8,
        )
    if arch == "qwen3_moe":
        return transformers.Qwen3MoeConfig(
            **common, intermediate_size=128, head_dim=16, num_experts=experts, num_experts_per_tok=2,
            moe_intermediate_size=32,
        )
    return transformers.MixtralConfig(**common, intermediate_size=32, num_local_experts=experts, num_experts_per_tok=2)


def _model(arch: str, seed: int = 0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(_config(arch), dtype=torch.float32)


def _lora(model):
    import peft

    config = peft.LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj"],
        target_parameters=moe_routing.expert_lora_targets(model),
        init_lora_weights=False,  # random B too, so every adapter gets a gradient at step 0
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        return peft.get_peft_model(model, config)


def _step(model, ids):
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return out.logits.detach(), out.loss.detach(), grads


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    scale = expected.abs().max().clamp_min(1e-12)
    err = ((actual - expected).abs().max() / scale).item()
    assert err <= REL_TOL, f"{what}: relative error {err:.2e} > {REL_TOL:.0e}"


def _grouped_and_eager(model):
    grouped, eager = model, copy.deepcopy(model)
    assert install(grouped, True).enabled
    assert not install(eager, False).enabled
    return grouped, eager


class TestBuildRouting:
    def test_hand_checked_case(self):
        meta = build_routing(torch.tensor([[1, 0], [2, 1], [0, 2]]), 3, host_offsets=True)
        # flat slots [1,0,2,1,0,2]; expert 0 <- slots 1, 4; expert 1 <- 0, 3; expert 2 <- 2, 5.
        assert meta.sort_idx_S.tolist() == [1, 4, 0, 3, 2, 5]
        assert meta.token_S.tolist() == [0, 2, 0, 1, 1, 2]
        assert meta.expert_S.tolist() == [0, 0, 1, 1, 2, 2]
        assert meta.counts_E.tolist() == [2, 2, 2]
        assert meta.offsets_E.tolist() == [2, 4, 6]
        assert meta.offsets_E.dtype == torch.int32
        assert meta.host_offsets == (2, 4, 6)
        assert meta.sort_idx_S[meta.inverse_S].tolist() == list(range(6))

    def test_experts_with_no_tokens_get_empty_groups(self):
        meta = build_routing(torch.tensor([[3, 0], [3, 5], [0, 3]]), 6, host_offsets=True)
        assert meta.counts_E.tolist() == [2, 0, 0, 3, 0, 1]
        assert meta.offsets_E.tolist() == [2, 2, 2, 5, 5, 6]
        assert list(meta.groups()) == [(0, 0, 2), (3, 2, 5), (5, 5, 6)]
        assert meta.token_S.tolist() == [0, 2, 0, 1, 2, 1]  # stable: tokens ascending per expert

    def test_no_host_copy_unless_asked(self):
        meta = build_routing(torch.tensor([[0, 1]]), 2)
        assert meta.host_offsets is None
        with pytest.raises(AssertionError, match="host_offsets"):
            list(meta.groups())

    def test_matches_where_per_expert(self):
        gen = torch.Generator().manual_seed(0)
        index = torch.stack([torch.randperm(16, generator=gen)[:4] for _ in range(50)])
        meta = build_routing(index, 16, host_offsets=True)
        for e, start, end in meta.groups():
            _, tokens = torch.where(index.T == e)  # what the eager loop finds
            assert meta.token_S[start:end].tolist() == sorted(tokens.tolist())
        assert int(meta.counts_E.sum()) == index.numel()

    def test_rejects_float_assignments(self):
        with pytest.raises(ValueError, match="integer"):
            build_routing(torch.zeros(3, 2), 4)


class TestGroupedLinear:
    def test_loop_fallback_forward_and_backward_match_dense(self):
        gen = torch.Generator().manual_seed(1)
        index = torch.tensor([[2], [0], [2], [2], [0]])  # expert 1 gets no rows
        meta = build_routing(index, 3, host_offsets=True)
        x = torch.randn(5, 8, generator=gen, requires_grad=True)
        w = torch.randn(3, 8, 6, generator=gen, requires_grad=True)
        out = grouped_linear(x, w, meta)
        expected = torch.stack([x[i] @ w[meta.expert_S[i]] for i in range(5)])
        torch.testing.assert_close(out, expected)
        grad = torch.randn(5, 6, generator=gen)
        gx, gw = torch.autograd.grad(out, (x, w), grad)
        ex, ew = torch.autograd.grad(expected, (x, w), grad)
        torch.testing.assert_close(gx, ex)
        torch.testing.assert_close(gw, ew)
        assert gw[1].abs().sum() == 0


class TestGroupedEqualsEager:
    @pytest.mark.parametrize("arch", ARCHS)
    def test_full_finetuning_same_logits_loss_and_every_gradient(self, arch):
        grouped, eager = _grouped_and_eager(_model(arch))
        ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(2))
        logits_g, loss_g, grads_g = _step(grouped, ids)
        logits_e, loss_e, grads_e = _step(eager, ids)
        _assert_close(logits_g, logits_e, "logits")
        _assert_close(loss_g, loss_e, "loss")
        assert grads_g.keys() == grads_e.keys()
        expert_grads = [n for n in grads_e if ".experts." in n]
        assert expert_grads, "the experts' own weights must be among the compared gradients"
        for name in grads_e:
            _assert_close(grads_g[name], grads_e[name], name)

    @pytest.mark.parametrize("arch", ARCHS)
    def test_lora_on_attention_and_experts_same_gradients(self, arch):
        grouped, eager = _grouped_and_eager(_lora(_model(arch)))
        ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(3))
        _, loss_g, grads_g = _step(grouped, ids)
        _, loss_e, grads_e = _step(eager, ids)
        _assert_close(loss_g, loss_e, "loss")
        expert_lora = [n for n in grads_e if ".experts." in n and "lora_" in n]
        attention_lora = [n for n in grads_e if "_proj.lora_" in n and ".experts." not in n]
        assert len(expert_lora) == 8 and attention_lora  # 2 layers x 2 weights x (A, B)
        for name in grads_e:
            _assert_close(grads_g[name], grads_e[name], name)
            assert grads_g[name].abs().max() > 0, f"{name} got no gradient"

    def test_gradient_checkpointing_recompute_gives_same_gradients(self):
        grouped, eager = _grouped_and_eager(_model("gpt_oss"))
        kwargs = {"use_reentrant": False}
        if hasattr(grouped, "activation_checkpointing_enable"):  # transformers >= 5.2x
            grouped.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            grouped.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        grouped.train()
        eager.train()
        ids = torch.randint(0, 128, (1, 32), generator=torch.Generator().manual_seed(6))
        _, loss_g, grads_g = _step(grouped, ids)
        _, loss_e, grads_e = _step(eager, ids)
        _assert_close(loss_g, loss_e, "loss")
        for name in grads_e:
            _assert_close(grads_g[name], grads_e[name], name)

    def test_lora_on_experts_trains(self):
        model = _lora(_model("gpt_oss"))
        install(model, True)
        experts_lora = {n: p.detach().clone() for n, p in model.named_parameters() if ".experts." in n and p.requires_grad}
        ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(4))
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        losses = []
        for _ in range(6):
            optimizer.zero_grad()
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        assert losses[-1] < losses[0] - 0.1, losses
        moved = [n for n, p in model.named_parameters() if n in experts_lora and not torch.equal(p, experts_lora[n])]
        assert len(moved) == len(experts_lora) == 8

    def test_gpt_oss_clamp_and_alpha_preserved(self):
        model = _model("gpt_oss")
        experts = model.model.layers[0].mlp.experts
        with torch.no_grad():
            experts.gate_up_proj.mul_(400.0)  # pre-activations far beyond swiglu_limit (7.0)
        grouped = copy.deepcopy(experts)
        moe_routing.install(torch.nn.ModuleDict({"e": grouped}), True)
        moe_routing.install(torch.nn.ModuleDict({"e": experts}), False)
        gen = torch.Generator().manual_seed(5)
        x = torch.randn(40, 64, generator=gen)
        index = torch.stack([torch.randperm(8, generator=gen)[:2] for _ in range(40)])
        weights = torch.softmax(torch.randn(40, 2, generator=gen), -1)
        pre = x @ experts.gate_up_proj[0] + experts.gate_up_proj_bias[0]
        assert pre.abs().max() > 10 * experts.limit, "the case must exercise the clamp"
        _assert_close(grouped(x, index, weights), experts(x, index, weights), "gpt-oss experts output")

    def test_tokens_routed_to_few_experts_leave_others_empty(self):
        model = _model("qwen3_moe")
        experts = model.model.layers[0].mlp.experts
        grouped = copy.deepcopy(experts)
        install(torch.nn.ModuleDict({"e": grouped}), True)
        install(torch.nn.ModuleDict({"e": experts}), False)
        x = torch.randn(6, 64, requires_grad=True)
        index = torch.tensor([[5, 2]] * 6)  # 6 of 8 experts get nothing
        weights = torch.full((6, 2), 0.5, requires_grad=True)
        out_g = grouped(x, index, weights)
        out_e = experts(x, index, weights)
        _assert_close(out_g, out_e, "output")
        grad = torch.randn_like(out_e)
        g = torch.autograd.grad(out_g, (x, weights, grouped.gate_up_proj), grad)
        e = torch.autograd.grad(out_e, (x, weights, experts.gate_up_proj), grad)
        for a, b, what in zip(g, e, ("x", "routing weights", "gate_up_proj")):
            _assert_close(a, b, what)
        assert g[2][[0, 1, 3, 4, 6, 7]].abs().sum() == 0

    def test_no_tokens(self):
        model = _model("mixtral")
        experts = model.model.layers[0].mlp.experts
        install(torch.nn.ModuleDict({"e": experts}), True)
        out = experts(torch.zeros(0, 64), torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2))
        assert out.shape == (0, 64)


class TestInstallAndSupported:
    def test_install_counts_blocks_for_the_plan(self):
        result = install(_model("gpt_oss"), True)
        assert (result.blocks, result.families, result.backend) == (2, ("gpt_oss",), "loop")
        assert result.describe().startswith("grouped routing on 2 MoE blocks (gpt_oss)")
        assert "eager" in install(_model("mixtral"), False).describe()

    def test_off_runs_transformers_eager_loop_whatever_the_config_says(self):
        model = _model("qwen3_moe")
        model.set_experts_implementation("grouped_mm")
        install(model, False)
        experts = model.model.layers[0].mlp.experts
        assert experts.forward.__func__ is type(experts).forward.__wrapped__

    def test_install_again_switches_back(self):
        model = _model("mixtral")
        install(model, False)
        install(model, True)
        assert model.model.layers[1].mlp.experts.forward.__func__ is moe_routing.grouped_experts_forward

    def test_supported_reasons(self):
        import transformers

        assert supported(_model("gpt_oss"), "cpu") is None
        assert supported(_config("qwen3_moe")) is None
        llama = transformers.LlamaConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64)
        assert "no MoE blocks" in supported(llama)
        dense = transformers.AutoModelForCausalLM.from_config(llama)
        assert "no MoE experts" in supported(dense, "cpu")
        with pytest.raises(ValueError, match="no recognised MoE experts"):
            install(dense, True)

    def test_triton_on_cpu_is_refused_with_the_reason(self):
        with pytest.raises(ValueError, match="triton=True: the Triton MoE kernels need"):
            install(_model("mixtral"), True, triton=True)
        assert not install(_model("mixtral"), True).triton  # auto: torch ops on CPU

    def test_expert_lora_targets(self):
        targets = ["experts.gate_up_proj", "experts.down_proj"]
        assert moe_routing.expert_lora_targets(_model("gpt_oss")) == targets
        assert moe_routing.expert_lora_targets(_lora(_model("qwen3_moe"))) == targets


@pytest.mark.slow  # ~22 s: the Triton interpreter in a child process
class TestTritonKernelsInInterpreter:
    @pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
    def test_triton_kernels_match_eager_loop_outputs_and_gradients(self):
        path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)
        env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
        proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300,
                              check=False)
        assert proc.returncode == 0, proc.stderr[-3000:]
        results = json.loads(proc.stdout.strip().splitlines()[-1])
        assert set(results) == set(ARCHS)
        for arch, errors in results.items():
            assert errors.pop("fused_blocks") == 1 and errors.pop("triton"), arch
            for what, err in errors.items():
                assert err <= REL_TOL, f"{arch} {what}: relative error {err:.2e} > {REL_TOL:.0e}"


def _interpreter_main() -> None:
    """One experts module per family, Triton kernels (interpreted) vs eager: relative errors as JSON."""
    results = {}
    for arch in ARCHS:
        eager = _model(arch).model.layers[0].mlp.experts
        if arch == "gpt_oss":  # exercise the clamps and the bias path
            with torch.no_grad():
                eager.gate_up_proj.mul_(100.0)
                eager.gate_up_proj_bias.normal_()
        fused = copy.deepcopy(eager)
        report = install(torch.nn.ModuleDict({"e": fused}), True, triton=True)
        install(torch.nn.ModuleDict({"e": eager}), False)
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(50, 64, generator=gen, requires_grad=True)
        index = torch.stack([torch.randperm(8, generator=gen)[:2] for _ in range(50)])
        weights = torch.softmax(torch.randn(50, 2, generator=gen), -1).requires_grad_()
        out_f, out_e = fused(x, index, weights), eager(x, index, weights)
        grad = torch.randn(out_e.shape, generator=gen)
        names = ["x", "weights"] + [n for n, _ in eager.named_parameters()]
        grads_f = torch.autograd.grad(out_f, [x, weights, *fused.parameters()], grad)
        grads_e = torch.autograd.grad(out_e, [x, weights, *eager.parameters()], grad)
        rel = lambda a, b: ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()
        errors = {"output": rel(out_f, out_e), "fused_blocks": report.fused_gate_blocks, "triton": report.triton}
        errors.update({f"grad {n}": rel(a, b) for n, a, b in zip(names, grads_f, grads_e)})
        results[arch] = errors
    print(json.dumps(results))


if __name__ == "__main__":
    _interpreter_main()
