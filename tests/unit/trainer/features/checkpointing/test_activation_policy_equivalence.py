"""Every activation policy gives full checkpointing's loss and gradients (CPU, tiny models).

Tiny Llama, Qwen3 (q/k norms) and Qwen3-MoE (experts with LoRA through ``target_parameters``,
grouped routing), LoRA with random B. Each policy is installed through ``trainer.training.install`` from
the CPU plan with its ``gradient_checkpointing`` decision (and for ``full+offload`` the offload
decision, the CPU twin of the double-buffered reload) replaced, then one packed micro-batch
forward and backward. A recompute runs the same kernels on the same bytes in one thread, so the
tolerance is exact: losses and every gradient bit-identical (0 difference).
"""

from __future__ import annotations


import pytest
import torch
from plan_fakes import CPU, plan_config
from trainer_helpers import lora_model

from trainer.config import ModelConfig
from trainer.data.dataset import Sample
from trainer.features.checkpointing import policy as checkpointing
from trainer.training.install import install
from trainer.model.load import model_facts
from trainer.data.packing import pack_batch
from trainer.plan.feature import Target
from trainer.plan.types import Decision, Plan
from trainer.plan.planner import plan

pytestmark = [
    pytest.mark.slow,  # ~4 s: three tiny models, four policies each
    pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"),
    pytest.mark.usefixtures("one_thread"),
]
LENGTHS = (9, 5, 12)
POLICIES = ("none", "selective:1/2", "full+offload")


def _loss_and_grads(model: torch.nn.Module, chosen: Plan) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    installed = install(model, chosen)
    try:
        gen = torch.Generator().manual_seed(1)
        samples = []
        for n in LENGTHS:
            ids = torch.randint(6, 500, (n,), generator=gen).tolist()
            samples.append(Sample(input_ids=ids, labels=ids))
        batch, meta = installed.micro_batch(pack_batch(samples), torch.device("cpu"))
        loss = installed.loss(model, batch, meta, batch.num_targets)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        return loss.detach(), grads
    finally:
        installed.remove()


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_moe"])
def test_every_policy_equals_full_checkpointing(arch: str, tiny_models) -> None:
    model = lora_model(arch)
    model.train()
    config = plan_config(model=ModelConfig(str(tiny_models[arch])))
    base = plan(CPU, config, model_facts(config))
    assert base.decision(checkpointing.NAME).backend == "full"
    ref_loss, ref_grads = _loss_and_grads(model, base)
    assert len(ref_grads) > 10
    for backend in POLICIES:
        loss, grads = _loss_and_grads(model, checkpointing.with_policy(base, backend, "test"))
        assert torch.equal(loss, ref_loss), (backend, loss.item(), ref_loss.item())
        assert grads.keys() == ref_grads.keys(), backend
        for name, grad in grads.items():
            assert torch.equal(grad, ref_grads[name]), (backend, name)


def test_the_policy_sets_each_layers_checkpointing_and_remove_restores_it() -> None:
    model = lora_model("llama")
    layers = model.get_base_model().model.layers
    decision = Decision(checkpointing.NAME, "selective", True, "selective:1/2", "test")
    handle = checkpointing.FEATURE.apply(model, decision, Target())
    assert [layer.gradient_checkpointing for layer in layers] == [True, False]
    assert handle.describe() == "activation policy: selective:1/2, 1 of 2 layers checkpointed"
    handle.remove()
    assert all("gradient_checkpointing" not in vars(layer) for layer in layers)
    assert not any(layer.gradient_checkpointing for layer in layers)  # the class default again
