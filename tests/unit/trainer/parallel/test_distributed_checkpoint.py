"""``trainer.training.checkpoint`` through ``torch.distributed.checkpoint`` in one process (no process
group): what several ranks write is read the same way (``test_distributed_runs`` does it with
two ranks), so these pin the format, the atomic rename and the trained-only content."""

from __future__ import annotations

import json

import pytest
import torch
from trainer_helpers import random_ids

from trainer.training import checkpoint, layout
from trainer.training.checkpoint import TrainingState
from trainer.parallel.distributed import Comm, World

ONE = Comm(World(), torch.device("cpu"))


def _trained(model: torch.nn.Module, seed: int):
    """AdamW + a LambdaLR over ``model``'s trainable weights after two steps on random ids."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: 1.0 / (i + 1))
    for k in range(2):
        ids = random_ids(seed + k)
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    return optimizer, scheduler


@pytest.fixture
def tiny(tiny_model_dir):
    """A fresh tiny Llama for method ``full`` (every weight trained) or ``lora`` (r=4 adapters)."""
    from transformers import AutoModelForCausalLM

    from trainer.config import LoraConfig
    from trainer.model.load import apply_lora

    def build(method: str) -> torch.nn.Module:
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
        return model if method == "full" else apply_lora(model, LoraConfig(r=4, alpha=8))

    return build


class TestShardedCheckpoint:
    def test_full_state_round_trips_into_a_fresh_model_and_optimizer(self, tmp_path, tiny):
        model = tiny("full")
        optimizer, scheduler = _trained(model, 0)
        path, size = checkpoint.save(tmp_path, model, optimizer, scheduler, TrainingState(2, 8), ONE, sharded=True)
        assert path == layout.checkpoint_dir(tmp_path, 2) and size > 0
        assert sorted(p.name for p in layout.sharded_state_dir(path).iterdir()) == [".metadata", "__0_0.distcp"]
        assert json.loads((path / "trainer_state.json").read_text()) == {"step": 2, "data_position": 8, "final": False}
        assert checkpoint.latest_checkpoint(tmp_path) == path

        fresh = tiny("full")
        fresh_optimizer, fresh_scheduler = _trained(fresh, 5)  # other weights, other state
        state = checkpoint.load_checkpoint(path, fresh, fresh_optimizer, fresh_scheduler)
        assert state == TrainingState(2, 8)
        for (name, a), b in zip(model.named_parameters(), fresh.parameters()):
            assert torch.equal(a, b), name
        saved, loaded = optimizer.state_dict(), fresh_optimizer.state_dict()
        assert saved["param_groups"] == loaded["param_groups"]
        for k, v in saved["state"].items():
            for field in ("step", "exp_avg", "exp_avg_sq"):
                assert torch.equal(v[field], loaded["state"][k][field]), (k, field)
        assert fresh_scheduler.state_dict() == scheduler.state_dict()

    def test_only_trained_weights_are_saved_for_lora(self, tmp_path, tiny):
        from torch.distributed.checkpoint import FileSystemReader

        model = tiny("lora")
        optimizer, scheduler = _trained(model, 0)
        path, _ = checkpoint.save(tmp_path, model, optimizer, scheduler, TrainingState(2, 8), ONE, sharded=True)
        keys = FileSystemReader(layout.sharded_state_dir(path)).read_metadata().state_dict_metadata
        model_keys = {k.removeprefix("model.") for k in keys if k.startswith("model.")}
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        assert model_keys == trainable and all("lora_" in k for k in model_keys)

    def test_a_half_written_checkpoint_is_never_resumed_and_is_replaced(self, tmp_path, tiny):
        model = tiny("full")
        optimizer, scheduler = _trained(model, 0)
        checkpoint.save(tmp_path, model, optimizer, scheduler, TrainingState(2, 8), ONE, sharded=True)
        half = layout.partial_checkpoint_dir(tmp_path, 4)
        (layout.sharded_state_dir(half)).mkdir(parents=True)
        (half / "trainer_state.json").write_text("{}")  # rank 0's part done, a shard missing
        assert checkpoint.latest_checkpoint(tmp_path) == layout.checkpoint_dir(tmp_path, 2)
        path, _ = checkpoint.save(tmp_path, model, optimizer, scheduler, TrainingState(4, 16), ONE, sharded=True)
        assert not half.exists() and checkpoint.latest_checkpoint(tmp_path) == path

    def test_adapter_checkpoints_stay_peft_files_with_the_optimizer_inside(self, tmp_path, tiny):
        model = tiny("lora")
        optimizer, scheduler = _trained(model, 0)
        assert not checkpoint.uses_dcp("lora", "ddp") and not checkpoint.uses_dcp("qlora", None)
        assert checkpoint.uses_dcp("full", None) and checkpoint.uses_dcp("lora", "fsdp2")
        path, _ = checkpoint.save(tmp_path, model, optimizer, scheduler, TrainingState(2, 8), ONE, sharded=False)
        assert (path / "adapter_model.safetensors").is_file() and not layout.sharded_state_dir(path).exists()
        assert "optimizer" in torch.load(path / "trainer_state.pt", weights_only=True)


@pytest.mark.parametrize("method", ["full", "lora"])
def test_export_without_sharding_is_save_pretrained(tmp_path, tiny, method):
    model = tiny(method)
    out = checkpoint.export(model, layout.export_dir(tmp_path, method), ONE, sharded=False)
    name = "model.safetensors" if method == "full" else "adapter_model.safetensors"
    assert (out / name).is_file() and not out.with_name(out.name + layout.PARTIAL_SUFFIX).exists()
