"""Direct Preference Optimization: a loss and a batch shape on the SFT path, not a second trainer.

A packed micro-batch of P pairs holds 2P sequences, pair i's chosen at 2i and its rejected at
2i+1 (``trainer.objectives.preference``, ``trainer.data.packing.pack_batch``): the packed metadata, varlen
attention and every installed optimization run unchanged. Per sequence s the policy's summed
log-probability of its answer tokens, ``logp_S``, comes from the fused chunked head
(``trainer.features.loss.packed_forward.packed_sequence_logprobs`` over
``trainer.objectives.fused_logprobs.causal_lm_sequence_logprobs``: a segment-sum of the token log-probs, the
logits never materialised) or, where the plan chose the plain loss, from the full logits.

The sigmoid DPO loss (Rafailov et al. 2023, eq. 7; TRL's ``loss_type="sigmoid"``), with
conservative-DPO label smoothing eps (the paper's cDPO, TRL's form before 1.x)::

    delta_P = (pi_chosen - ref_chosen) - (pi_rejected - ref_rejected)
    loss_P  = -(1 - eps) * logsigmoid(beta * delta_P) - eps * logsigmoid(-beta * delta_P)

summed over the micro-batch's pairs and divided by the pair count of the whole optimizer step
(``num_items``, as SFT divides by the step's label tokens), so accumulation is exact.

The reference log-probabilities, without autograd:

- ``lora`` / ``qlora``: the same model with its adapters disabled (peft's ``disable_adapter``):
  no second copy of the base in memory; one extra forward per micro-batch.
- ``full``: a frozen copy of the model as loaded, kept in the compute dtype beside the policy.
  Chosen over a first pass that precomputes every pair's reference log-probs because the copy
  makes the reference a function of the batch alone, as for LoRA: nothing to persist per pair
  for a resume, to recompute when the data or its truncation changes, or to carry through the
  packed batch; it costs one set of weights (16 GB for an 8B model in bf16), ~12% beside the
  weights, gradients and AdamW state full fine-tuning already holds.

Several ranks: DDP (LoRA/QLoRA) works as for SFT (the reference forward touches no trainable
parameter). FSDP2 (full fine-tuning on several GPUs, or a sharded LoRA base) is refused at set-up
(``check_parallelism``): the frozen copy would not be sharded, and the adapter-off pass inside
FSDP2's gathers is untested.

Legend: ``S`` sequences in a micro-batch (2P), ``P`` pairs, ``T`` packed tokens.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
import torch.nn.functional as F

from trainer.config import TrainConfig
from trainer.errors import ConfigError
from trainer.training.flops import ATTENTION_BACKWARD, FlopCounter
from trainer.objectives.declarations import DPO_STEP_FIELDS, DpoConfig
from trainer.objectives.preference import PreferencePair, load_pair_sets, pack_pairs, shared_prefix
from trainer.features.loss.packed_forward import packed_sequence_logprobs
from trainer.data.packing import PackedBatch

STATS = ("reward_margin", "correct", "chosen_logp", "rejected_logp", "pairs")
"""What a micro-batch adds up (``DpoLoss.last``); ``step_fields`` turns the step's sums into means."""


def dpo_losses(
    policy_chosen_P: torch.Tensor,
    policy_rejected_P: torch.Tensor,
    ref_chosen_P: torch.Tensor,
    ref_rejected_P: torch.Tensor,
    beta: float,
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """Each pair's sigmoid DPO loss (see the module docstring), fp32 [P]."""
    delta_P = (policy_chosen_P - ref_chosen_P) - (policy_rejected_P - ref_rejected_P)
    return -(1.0 - label_smoothing) * F.logsigmoid(beta * delta_P) - label_smoothing * F.logsigmoid(-beta * delta_P)


class DpoLoss:
    """``loss(model, batch, meta, num_items)`` for packed pairs: the run's loss when ``objective`` is dpo.

    Args:
        config: beta and label smoothing.
        loss_kernel: the plan's loss kernel (``LOSS_FUSED`` or the plain one).
        reference: a frozen copy for full fine-tuning; None: the policy with its adapters off.
    """

    def __init__(self, config: DpoConfig, loss_kernel: str, reference: torch.nn.Module | None = None) -> None:
        self.config = config
        self.loss_kernel = loss_kernel
        self.reference = reference
        self.shared = False
        """Whether pairs pack with their prompt once (``Dpo.build_loss``; ``step_flops`` counts it)."""
        self.last: torch.Tensor | None = None
        """The last call's sums, in ``STATS`` order (a detached device tensor, read one step late)."""

    def __call__(self, model: torch.nn.Module, batch: PackedBatch, meta: Any, num_items: int) -> torch.Tensor:
        with torch.no_grad():  # first: its transient memory comes before the policy's saved activations
            ref_S = self.reference_logprobs(model, batch, meta)
        policy_S = packed_sequence_logprobs(model, batch, meta, self.loss_kernel, _sequences(batch))
        losses_P = dpo_losses(
            policy_S[0::2], policy_S[1::2], ref_S[0::2], ref_S[1::2], self.config.beta, self.config.label_smoothing
        )
        self.last = self._stats(policy_S.detach(), ref_S)
        return losses_P.sum() / max(int(num_items), 1)

    def reference_logprobs(self, model: torch.nn.Module, batch: PackedBatch, meta: Any) -> torch.Tensor:
        """The reference model's ``packed_sequence_logprobs`` (call under ``no_grad``)."""
        if self.reference is not None:
            return packed_sequence_logprobs(self.reference, batch, meta, self.loss_kernel, _sequences(batch))
        with _adapters_off(model):
            return packed_sequence_logprobs(model, batch, meta, self.loss_kernel, _sequences(batch))

    def step_flops(self, counter: FlopCounter, pairs: list[Any]) -> float:
        """Model FLOPs of a step over ``pairs`` (``trainer.training.flops``' one count): the policy's forward
        and backward on every sequence, as for SFT, plus the reference's forward: 2 per parameter
        it multiplies per token (the base alone with adapters off; the whole frozen copy for full
        fine-tuning) and the forward attention."""
        lengths = [len(seq) for pair in pairs for seq in pair.sequences]
        reference = counter.frozen_params + (counter.trainable_params if self.reference is not None else 0)
        attention_forward = counter.attention_flops(lengths) / (1.0 + ATTENTION_BACKWARD)
        total = counter.step_flops(lengths) + 2.0 * reference * sum(lengths) + attention_forward
        if not self.shared:
            return total
        # a shared prompt goes through the policy and the reference once, not twice
        prompts = [n for pair in pairs if (n := shared_prefix(pair))]
        prompt_attention = counter.attention_flops(prompts) / (1.0 + ATTENTION_BACKWARD)
        return total - counter.step_flops(prompts) - 2.0 * reference * sum(prompts) - prompt_attention

    def _stats(self, policy_S: torch.Tensor, ref_S: torch.Tensor) -> torch.Tensor:
        rewards_S = self.config.beta * (policy_S - ref_S)
        margin_P = rewards_S[0::2] - rewards_S[1::2]
        return torch.stack([
            margin_P.sum(), (margin_P > 0).float().sum(), policy_S[0::2].sum(), policy_S[1::2].sum(),
            torch.full((), float(margin_P.numel()), device=policy_S.device),  # a fill: no host-to-device copy
        ])


def _sequences(batch: PackedBatch) -> tuple[torch.Tensor, int] | None:
    """A shared-prefix batch's (``pack_pairs``) sequence per position and count (two a pair: its
    ``num_targets``); None for whole sequences."""
    if "sequence" not in batch.extras:
        return None
    return batch.extras["sequence"].reshape(-1), 2 * batch.num_targets


def _adapters_off(model: torch.nn.Module) -> Any:
    """peft's ``disable_adapter()`` context (a model without adapters is its own reference)."""
    return model.disable_adapter() if hasattr(model, "disable_adapter") else nullcontext()


def new_stats(device: torch.device) -> torch.Tensor:
    """A zero sum of ``STATS`` for one step."""
    return torch.zeros(len(STATS), dtype=torch.float32, device=device)


def step_fields(stats: torch.Tensor | None) -> dict[str, float | None]:
    """The step event's DPO fields from the step's summed ``STATS`` (all ranks); {} for None.

    Reads the tensor (call it one step late, as ``PendingStep.read`` does).
    """
    if stats is None:
        return {}
    return _fields(stats.tolist())


def _fields(sums: Sequence[float]) -> dict[str, float | None]:
    margin, correct, chosen, rejected, pairs = sums
    if not pairs:
        return dict.fromkeys(DPO_STEP_FIELDS)
    values = (margin / pairs, correct / pairs, chosen / pairs, rejected / pairs)
    return dict(zip(DPO_STEP_FIELDS, values))


def build(config: TrainConfig, model: torch.nn.Module, loss_kernel: str) -> DpoLoss:
    """The run's DPO loss: the frozen reference copy is taken here for ``method: full``, so call it
    after the plan is installed and before training changes a weight."""
    reference = None
    if config.method == "full":
        reference = copy.deepcopy(model).requires_grad_(False)
    return DpoLoss(config.dpo, loss_kernel, reference)


def check_parallelism(strategy: str | None) -> None:
    """Refuse the strategies DPO does not run under (see the module docstring).

    Raises:
        ConfigError: FSDP2 was chosen.
    """
    if strategy == "fsdp2":
        raise ConfigError(
            "objective dpo runs on one GPU, or on several with DDP (method lora or qlora on a base that fits one "
            "GPU); this job would need FSDP2 (method full, or a base too big for one GPU), which DPO does not "
            "support yet: set gpus to 1 or use method lora"
        )


class Dpo:
    """The ``dpo`` objective (``trainer.objectives.declarations.DPO``): pairs, ``DpoLoss``, ``STATS``."""

    share_prefixes = True
    """Pack each pair's prompt once (``pack_pairs``) where the installed attention takes shared
    prefixes; the schedule still counts a pair as its two whole sequences."""

    def __init__(self) -> None:
        self.loss: DpoLoss | None = None
        self.shared = False

    def load_data(self, config: TrainConfig, tokenizer: Any) -> tuple[list[PreferencePair], list[PreferencePair] | None]:
        return load_pair_sets(config, tokenizer)

    def pack(self, items: Sequence[PreferencePair]) -> PackedBatch:
        return pack_pairs(list(items), self.shared)

    def build_loss(self, config: TrainConfig, model: torch.nn.Module, installed: Any, strategy: str | None) -> DpoLoss:
        from trainer.features.attention.packed import windowed_attention

        check_parallelism(strategy)
        self.shared = self.share_prefixes and installed.attention.takes_prefixes and not windowed_attention(model)
        self.loss = build(config, model, installed.loss.kernel)
        self.loss.shared = self.shared
        return self.loss

    def new_stats(self, device: torch.device) -> torch.Tensor:
        return new_stats(device)

    @contextmanager
    def collecting(self, stats: torch.Tensor | None) -> Iterator[None]:
        yield
        if stats is not None:
            stats += self.loss.last

    def step_fields(self, sums: Sequence[float], targets: int) -> dict[str, float | None]:
        return _fields(sums)

    def eval_accuracy(self, sums: Sequence[float], targets: int) -> float | None:
        return None  # the eval event's accuracy is a token accuracy; DPO's loss ranks no tokens

    def step_flops(self, counter: FlopCounter, items: Sequence[Any]) -> float:
        return self.loss.step_flops(counter, list(items))
