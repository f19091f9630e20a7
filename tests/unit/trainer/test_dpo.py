"""trainer.objectives.dpo on the packed path: per-sequence log-probs from the fused head, the loss, packed
pairs against pairs run one by one, the adapter-off reference, and a DPO run's step events.

Tolerances: float32 on CPU. The fused and the full-logits log-probs run the same matmuls in
another order (chunks): 1e-5 relative. Packed against one by one differs only in the attention
mask / varlen boundaries: 1e-5 relative on the loss, 1e-4 on the LoRA gradients.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math

import pytest
import torch
import torch.nn.functional as F
from trainer_helpers import Recorder, lora_model, make_job, write_jsonl

from trainer.objectives import dpo
from trainer.features.attention.packed import PackedAttention
from trainer.config import DataConfig, DpoConfig, LoraConfig, ModelConfig, OptimConfig, TrainConfig
from trainer.data.dataset import IGNORE_INDEX, Sample
from trainer.errors import ConfigError
from trainer.training.flops import AttentionLayers, FlopCounter
from trainer.objectives.fused_logprobs import fused_linear_sequence_logprobs
from trainer.features.loss.packed_forward import LOSS_FUSED, LOSS_PLAIN, packed_sequence_logprobs
from trainer.data.packing import pack_batch
from trainer.objectives.preference import PreferencePair, pack_pairs, shared_prefix, tokenize_pair

LENGTHS = ((9, 6), (5, 12), (14, 4))
"""(chosen, rejected) lengths of the test pairs: prompt 3 tokens, the rest answer."""


def pairs(seed: int = 0) -> list[PreferencePair]:
    """A pair's two sequences share their prompt, as tokenized pairs do (``tokenize_pair``)."""
    g = torch.Generator().manual_seed(seed)
    prompt_len = 3

    def seq(prompt: list[int], n: int) -> Sample:
        ids = prompt + torch.randint(6, 500, (n - prompt_len,), generator=g).tolist()
        return Sample(ids, [IGNORE_INDEX] * prompt_len + ids[prompt_len:])

    def pair(c: int, r: int) -> PreferencePair:
        prompt = torch.randint(6, 500, (prompt_len,), generator=g).tolist()
        return PreferencePair(seq(prompt, c), seq(prompt, r))

    return [pair(c, r) for c, r in LENGTHS]


def packed_model(seed: int = 0) -> tuple[torch.nn.Module, PackedAttention]:
    model = lora_model("llama", seed=seed)
    attn = PackedAttention("sdpa", cache=True)
    attn.install(model)
    return model, attn


def lora_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def dpo_loss_of(model, attn, group: list[PreferencePair], num_items: int, loss: dpo.DpoLoss) -> torch.Tensor:
    batch = pack_batch(group)
    return loss(model, batch, attn.metadata(batch.lengths, "cpu"), num_items)


class TestSequenceLogprobs:
    @pytest.mark.parametrize("softcap", [None, 5.0])
    def test_fused_equals_full_logits_values_and_gradients(self, softcap: float | None) -> None:
        g = torch.Generator().manual_seed(0)
        hidden = torch.randn(1, 23, 16, generator=g, requires_grad=True)
        weight = torch.randn(40, 16, generator=g, requires_grad=True)
        labels = torch.randint(0, 40, (1, 23), generator=g)
        labels[0, [0, 5, 22]] = IGNORE_INDEX
        seq = torch.tensor([[0] * 7 + [1] * 9 + [2] * 7])
        coef = torch.tensor([0.5, -2.0, 1.5])
        fused = fused_linear_sequence_logprobs(hidden, weight, labels, seq, 3, chunk_size=4, softcap=softcap)
        grads = torch.autograd.grad((fused * coef).sum(), (hidden, weight))
        logits = (hidden @ weight.T).float()
        if softcap is not None:
            logits = softcap * torch.tanh(logits / softcap)
        token = -F.cross_entropy(logits[0], labels[0], ignore_index=IGNORE_INDEX, reduction="none")
        plain = torch.zeros(3).index_add(0, seq[0], token)
        plain_grads = torch.autograd.grad((plain * coef).sum(), (hidden, weight))
        torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-5)
        for a, b in zip(grads, plain_grads, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)

    def test_both_kernels_agree_on_a_packed_model(self) -> None:
        model, attn = packed_model()
        batch = pack_batch(pairs())
        meta = attn.metadata(batch.lengths, "cpu")
        with torch.no_grad():
            fused = packed_sequence_logprobs(model, batch, meta, LOSS_FUSED)
            plain = packed_sequence_logprobs(model, batch, meta, LOSS_PLAIN)
        assert fused.shape == (6,) and bool((fused < 0).all())
        torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-5)


class TestLoss:
    def test_the_sigmoid_loss_with_label_smoothing_by_hand(self) -> None:
        pc, pr, rc, rr = (torch.tensor([v]) for v in (-10.0, -14.0, -11.0, -12.0))
        delta = (-10.0 + 11.0) - (-14.0 + 12.0)  # 3
        sig = lambda x: 1.0 / (1.0 + math.exp(-x))
        plain = -math.log(sig(0.1 * delta))
        smoothed = -0.8 * math.log(sig(0.1 * delta)) - 0.2 * math.log(sig(-0.1 * delta))
        assert dpo.dpo_losses(pc, pr, rc, rr, 0.1).item() == pytest.approx(plain, rel=1e-6)
        assert dpo.dpo_losses(pc, pr, rc, rr, 0.1, 0.2).item() == pytest.approx(smoothed, rel=1e-6)

    def test_packed_pairs_give_the_loss_and_gradients_of_pairs_one_by_one(self) -> None:
        model, attn = packed_model(seed=1)
        loss = dpo.DpoLoss(DpoConfig(beta=0.5), LOSS_FUSED)
        group = pairs(1)
        packed = dpo_loss_of(model, attn, group, len(group), loss)
        packed.backward()
        packed_grads, packed_stats = lora_grads(model), loss.last
        model.zero_grad(set_to_none=True)
        separate, stats = torch.zeros(()), dpo.new_stats(torch.device("cpu"))
        for pair in group:
            one = dpo_loss_of(model, attn, [pair], len(group), loss)
            one.backward()
            separate, stats = separate + one.detach(), stats + loss.last
        torch.testing.assert_close(packed.detach(), separate, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(packed_stats, stats, rtol=1e-5, atol=1e-5)
        grads = lora_grads(model)
        assert packed_grads.keys() == grads.keys() and all(g.abs().sum() > 0 for g in grads.values())
        for name, grad in grads.items():
            torch.testing.assert_close(packed_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)

    def test_a_shared_prompt_gives_the_loss_stats_and_gradients_of_whole_pairs(self) -> None:
        """``pack_pairs(shared=True)``: each pair's shared prefix once, both answers attending to it: the
        loss, statistics and LoRA gradients of the whole sequences (fp32)."""
        model, attn = packed_model(seed=3)
        loss = dpo.DpoLoss(DpoConfig(beta=0.5), LOSS_FUSED)
        results = []
        for shared in (False, True):
            model.zero_grad(set_to_none=True)
            group = pairs(3)
            batch = pack_pairs(group, shared)
            value = loss(model, batch, attn.metadata(batch.lengths, "cpu", batch.prefixes), len(group))
            value.backward()
            results.append((value.detach(), loss.last, lora_grads(model), batch.num_tokens))
        (whole, whole_stats, whole_grads, whole_tokens), (one, one_stats, one_grads, one_tokens) = results
        assert one_tokens == whole_tokens - sum(shared_prefix(p) for p in pairs(3)) < whole_tokens
        torch.testing.assert_close(one, whole, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(one_stats, whole_stats, rtol=1e-5, atol=1e-5)
        assert all(g.abs().sum() > 0 for g in whole_grads.values())
        for name, grad in whole_grads.items():
            torch.testing.assert_close(one_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)

    def test_the_reference_is_the_base_with_adapters_off(self) -> None:
        model, attn = packed_model(seed=2)  # LoRA B random: the adapters change the outputs
        batch = pack_batch(pairs(2))
        meta = attn.metadata(batch.lengths, "cpu")
        loss = dpo.DpoLoss(DpoConfig(), LOSS_FUSED)
        with torch.no_grad():
            reference = loss.reference_logprobs(model, batch, meta)
            policy = packed_sequence_logprobs(model, batch, meta, LOSS_FUSED)
            with model.disable_adapter():
                base = packed_sequence_logprobs(model.get_base_model(), batch, meta, LOSS_FUSED)
        torch.testing.assert_close(reference, base, rtol=0, atol=0)
        assert not torch.allclose(policy, reference)
        assert all(not p.requires_grad for n, p in model.named_parameters() if "lora" not in n)

    def test_step_fields_are_means_over_pairs(self) -> None:
        stats = torch.tensor([3.0, 2.0, -30.0, -45.0, 4.0])
        assert dpo.step_fields(stats) == {
            "reward_margin": 0.75, "reward_accuracy": 0.5, "chosen_logp": -7.5, "rejected_logp": -11.25,
        }
        assert dpo.step_fields(None) == {}

    def test_step_flops_add_the_reference_forward_by_hand(self) -> None:
        counter = FlopCounter(frozen_params=100, trainable_params=10, attention=(AttentionLayers(1, 2),))
        pair = PreferencePair(Sample([1, 2, 3], [1, 2, 3]), Sample([1, 2], [1, 2]))
        attention_forward = 4 * 2 * (6 + 3)  # 4 x width x in-sample causal pairs of lengths 3 and 2
        policy = (4 * 100 + 6 * 10) * 5 + 3.5 * attention_forward
        adapters_off = dpo.DpoLoss(DpoConfig(), LOSS_FUSED).step_flops(counter, [pair])
        frozen_copy = dpo.DpoLoss(DpoConfig(), LOSS_FUSED, reference=torch.nn.Linear(1, 1)).step_flops(counter, [pair])
        assert adapters_off == policy + 2 * 100 * 5 + attention_forward
        assert frozen_copy == policy + 2 * 110 * 5 + attention_forward

    def test_fsdp2_is_refused_naming_what_to_change(self) -> None:
        dpo.check_parallelism(None)
        dpo.check_parallelism("ddp")
        with pytest.raises(ConfigError, match="gpus to 1 or use method lora"):
            dpo.check_parallelism("fsdp2")


@pytest.mark.slow  # loads a 4-bit model through the CPU bitsandbytes backend
@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="needs bitsandbytes (the dev extra)")
class TestQlora:
    def test_the_reference_is_the_4bit_base_with_the_fused_adapters_off(self, tmp_path, tiny_model_dir) -> None:
        """QLoRA's reference: the NF4 base with the adapters off (the fused LoRA path falls back to
        the base layer), and the policy's gradient reaches every LoRA weight (CPU bnb backend, bf16
        plan as in test_qlora)."""
        from trainer.plan import hardware, planner as planning
        from trainer.features.lora_kernel import fused as lora_fused
        from trainer.model.load import load_model, prepare_for_training

        config = make_job(tmp_path, tiny_model_dir, method="qlora")
        plan = dataclasses.replace(planning.plan(hardware.detect("cpu"), dataclasses.replace(config, method="lora")),
                                   dtype="bfloat16")
        model = prepare_for_training(load_model(config, plan, torch.device("cpu")), config)
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                torch.nn.init.normal_(p, std=0.05)
        lora_fused.install(model)
        batch = pack_batch(pairs(3))
        loss = dpo.DpoLoss(DpoConfig(), LOSS_PLAIN)
        with torch.no_grad():
            reference = loss.reference_logprobs(model, batch, None)
            with model.disable_adapter():
                base = packed_sequence_logprobs(model, batch, None, LOSS_PLAIN)
            policy = packed_sequence_logprobs(model, batch, None, LOSS_PLAIN)
        torch.testing.assert_close(reference, base, rtol=0, atol=0)
        assert not torch.allclose(policy, reference)
        loss(model, batch, None, 3).backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
        assert grads and all(g is not None and g.abs().sum() > 0 for g in grads.values())


class TestPairs:
    def test_a_pair_shares_its_prompt_and_labels_only_the_answers(self, tiny_tokenizer) -> None:
        record = {
            "input": {"messages": [{"role": "user", "content": "What is one plus one?"}]},
            "preferred_output": [{"role": "assistant", "content": "Two."}],
            "non_preferred_output": [{"role": "assistant", "content": "I cannot say, it is hard."}],
        }
        pair = tokenize_pair(record, tiny_tokenizer)
        start = pair.chosen.labels.count(IGNORE_INDEX)
        assert start == pair.rejected.labels.count(IGNORE_INDEX) > 0
        assert pair.chosen.input_ids[:start] == pair.rejected.input_ids[:start]
        assert pair.chosen.labels[start:] == pair.chosen.input_ids[start:]
        assert "Two." in tiny_tokenizer.decode(pair.chosen.input_ids[start:])
        assert len(pair) == len(pair.chosen) + len(pair.rejected)

    def test_pairs_pack_chosen_then_rejected_and_count_as_one_item_each(self) -> None:
        group = pairs()
        batch = pack_batch(group)
        assert batch.lengths == [n for lengths in LENGTHS for n in lengths]
        assert batch.num_targets == len(group) and batch.num_tokens == sum(len(p) for p in group)
        assert batch.position_ids[0, :10].tolist() == [*range(9), 0]


    def test_a_shared_prompt_packs_once_and_each_answer_continues_it(self) -> None:
        group = pairs()
        batch = pack_pairs(group, shared=True)
        # the prompt is 3 tokens: its first 2 are shared (the third's target is an answer token)
        assert [shared_prefix(p) for p in group] == [2, 2, 2]
        assert batch.lengths == [n for c, r in LENGTHS for n in (2, c - 2, r - 2)]
        assert batch.prefixes == [x for i in range(3) for x in (-1, 3 * i, 3 * i)]
        assert batch.position_ids[0, :9].tolist() == [0, 1, *range(2, 9)]
        assert batch.extras["sequence"][0, :9].tolist() == [0, 0] + [0] * 7
        assert batch.num_targets == len(group)
        targets = batch.targets[0].tolist()
        assert targets[:2] == [IGNORE_INDEX] * 2 and targets[2:9] == group[0].chosen.labels[3:] + [IGNORE_INDEX]

    def test_a_pair_whose_sequences_differ_from_the_first_token_shares_nothing(self) -> None:
        pair = PreferencePair(Sample([5, 6, 7], [IGNORE_INDEX, 6, 7]), Sample([9, 6], [IGNORE_INDEX, 6]))
        assert shared_prefix(pair) == 0
        batch = pack_pairs([pair], shared=True)
        assert batch.lengths == [3, 2] and batch.prefixes == [-1, -1]


def dpo_job(tmp_path, model_dir, **overrides) -> TrainConfig:
    records = [
        {"input": {"messages": [{"role": "user", "content": f"What is {i % 5} plus one?"}]},
         "preferred_output": [{"role": "assistant", "content": f"The answer is {i % 5 + 1}."}],
         "non_preferred_output": [{"role": "assistant", "content": "I do not know, sorry."}]}
        for i in range(20)
    ]
    path = write_jsonl(tmp_path / "pairs.jsonl", records)
    fields = dict(
        model=ModelConfig(str(model_dir)), data=DataConfig(str(path), max_seq_len=64, batch_tokens=256),
        optim=OptimConfig(max_steps=8, learning_rate=5e-3), lora=LoraConfig(r=8, alpha=16),
        output_dir=str(tmp_path / "out"), gradient_checkpointing=False, device="cpu",
        objective="dpo", dpo=DpoConfig(beta=0.1),
    )
    return TrainConfig(**{**fields, **overrides})


@pytest.mark.slow  # a few dozen CPU training steps
class TestDpoRun:
    def test_a_full_dpo_run_resumed_keeps_the_initial_model_as_its_reference(self, tmp_path, tiny_model_dir) -> None:
        """The frozen reference of method full is the model as loaded, not the checkpoint a
        resumed run starts from: the resumed steps follow the uninterrupted run."""
        import shutil

        from trainer.training import layout
        from trainer.training.train import run

        whole = Recorder()
        config = dpo_job(tmp_path, tiny_model_dir, method="full", checkpoint_every=2,
                         optim=OptimConfig(max_steps=4, learning_rate=1e-3))
        assert run(config, whole).status == "succeeded"
        resumed_out = tmp_path / "resumed"
        shutil.copytree(layout.checkpoint_dir(config.output_dir, 2), layout.checkpoint_dir(resumed_out, 2))
        resumed = Recorder()
        assert run(dataclasses.replace(config, output_dir=str(resumed_out)), resumed).status == "succeeded"
        want = {e["step"]: e for e in whole.of("step")}
        got = {e["step"]: e for e in resumed.of("step")}
        assert sorted(got) == [3, 4] and want[4]["reward_margin"] > 0.05
        for step in (3, 4):
            for field in ("loss", "reward_margin", "chosen_logp", "rejected_logp"):
                assert got[step][field] == pytest.approx(want[step][field], rel=1e-4, abs=1e-6), (step, field)

    def test_a_run_with_shared_prompts_follows_one_with_whole_pairs(self, tmp_path, tiny_model_dir,
                                                                      monkeypatch) -> None:
        """``Dpo.share_prefixes`` on and off (SDPA packed attention on CPU takes shared prefixes): the
        same losses and DPO fields at each of 4 LoRA steps."""
        from trainer.training.train import run

        runs = []
        for shared in (False, True):
            monkeypatch.setattr(dpo.Dpo, "share_prefixes", shared)
            (tmp_path / str(shared)).mkdir()
            config = dpo_job(tmp_path / str(shared), tiny_model_dir, optim=OptimConfig(max_steps=4, learning_rate=5e-3))
            recorder = Recorder()
            assert run(config, recorder).status == "succeeded"
            runs.append(recorder.of("step"))
        whole, shared_steps = runs
        assert whole[-1]["reward_margin"] > 0.01  # the adapters moved: later steps compare trained weights
        for a, b in zip(whole, shared_steps):
            for field in ("loss", "reward_margin", "chosen_logp", "rejected_logp", "grad_norm"):
                assert b[field] == pytest.approx(a[field], rel=1e-4, abs=1e-6), (a["step"], field)

    def test_a_lora_dpo_run_learns_the_preference_and_reports_it(self, tmp_path, tiny_model_dir) -> None:
        from trainer.training.train import run

        config = dpo_job(tmp_path, tiny_model_dir)
        config = dataclasses.replace(config, data=dataclasses.replace(config.data, validation_path=config.data.train_path),
                                     sample_count=1, sample_max_new_tokens=4)
        recorder = Recorder()
        assert run(config, recorder).status == "succeeded"
        steps = recorder.of("step")
        assert len(steps) == 8
        assert steps[0]["loss"] == pytest.approx(math.log(2), abs=1e-4)  # LoRA B starts at 0: policy = reference
        assert steps[0]["reward_margin"] == pytest.approx(0.0, abs=1e-4)
        assert steps[-1]["loss"] < 0.5 and steps[-1]["reward_margin"] > 0.3 and steps[-1]["reward_accuracy"] == 1.0
        assert steps[-1]["chosen_logp"] > steps[0]["chosen_logp"] > steps[0]["rejected_logp"] > steps[-1]["rejected_logp"]
        [evaluation] = recorder.of("eval")  # the validation pairs' mean DPO loss, at the end
        assert evaluation["loss"] < math.log(2) and evaluation["tokens"] == 20
        [sample] = recorder.of("sample")[-1]["samples"]  # greedy answer to a pair's prompt (input.messages)
        assert sample["prompt"] == "What is 0 plus one?" and sample["tokens"] > 0
