"""GRPO's loss over a packed row of prompt + completion sequences: group advantages, the clipped
policy-gradient term with its published variants, and the optional KL to the reference.

The GRPO objective (issue 28) samples ``group_size`` completions per prompt, scores them, and trains
on them with this loss; this module is the part that must equal TRL's ``GRPOTrainer`` (1.15) for the
same completions, rewards and old/reference log-probabilities (``tests/unit/trainer/objectives/
test_grpo_loss.py`` holds the loss and the LoRA gradients to TRL's within 1e-5 in fp32).

Per completion token t of sequence s (``mask_T``: the positions whose target is a completion token):

- ``log_ratio_t = logp_t - old_t`` (``old``: the log-probabilities the completions were sampled
  with; with one optimisation step per batch of rollouts they are the current ones, detached, and the
  ratio is 1 with the gradient of ``logp``). ``importance_sampling_level="sequence"`` (GSPO) uses the
  sequence's mean log ratio for each of its tokens.
- ``ratio = exp(log_ratio)``; ``clipped = clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)``
  (asymmetric clipping as in DAPO when the two differ); ``delta`` caps ``ratio`` from above
  (two-sided clipping); ``loss_t = -min(ratio * A_s, clipped * A_s)``.
- ``beta > 0`` adds ``beta * kl_t`` with ``kl_t = exp(ref_t - logp_t) - (ref_t - logp_t) - 1`` (the k3
  estimator; the reference is the base with the adapters off, as for DPO), times the (uncapped)
  ratio when ``kl_bias_correction`` (on by default, as in TRL: the unbiased reverse-KL gradient).

Aggregation (``loss_type``), each over the whole optimizer step, so that micro-batches and ranks
sum to it exactly (the run's convention, ``trainer.training.step``): ``grpo`` the mean over
sequences of each sequence's mean token loss; ``bnpo`` and ``dapo`` the sum of token losses over
the step's completion tokens (TRL's ``bnpo`` divides by a micro-batch's tokens and ``dapo`` by the
generation batch's: the same for one micro-batch, and the step's for ftq); ``dr_grpo`` the sum over
``sequences x max_completion_length`` (the job's ``max_new_tokens``). ``policy_loss`` returns the numerator of this micro-batch;
``denominator`` gives the step's divisor.

Legend: ``T`` positions of the packed row, ``S`` sequences of the micro-batch.
"""

from __future__ import annotations

import torch

from trainer.objectives.grpo_config import GrpoLossConfig

STD_EPS = 1e-4
"""Added to the reward spread before dividing (TRL's constant)."""


def group_advantages(rewards: torch.Tensor, group_size: int, scale: str = "group") -> tuple[torch.Tensor, torch.Tensor]:
    """Each completion's advantage: its reward minus its group's mean, divided by the spread.

    Args:
        rewards: [G * group_size] fp32, the completions of a prompt consecutive.
        scale: ``group`` (each group's sample std), ``batch`` (the std over all), ``none`` (no division).

    Returns:
        The advantages and, per completion, whether its group's rewards were all equal (no signal).
    """
    if group_size < 2 or rewards.numel() % group_size:
        raise ValueError(f"group_size: must be >= 2 and divide the {rewards.numel()} rewards, got {group_size}")
    grouped = rewards.float().view(-1, group_size)
    mean = grouped.mean(dim=1).repeat_interleave(group_size)
    group_std = grouped.std(dim=1).repeat_interleave(group_size)
    std = rewards.float().std().expand_as(mean) if scale == "batch" else group_std
    advantages = rewards.float() - mean
    if scale != "none":
        advantages = advantages / (std + STD_EPS)
    return advantages, torch.isclose(group_std, torch.zeros_like(group_std))


def denominator(config: GrpoLossConfig, sequences: int, completion_tokens: int, max_completion_length: int) -> float:
    """The step's divisor of the summed ``policy_loss`` numerators (see the module docstring);
    ``max_completion_length``: Dr. GRPO's constant per sequence (the job's ``max_new_tokens``)."""
    if config.loss_type == "grpo":
        return float(max(sequences, 1))
    if config.loss_type == "dr_grpo":
        return float(max(sequences, 1) * max_completion_length)
    return float(max(completion_tokens, 1))


def policy_loss(
    logp_T: torch.Tensor,
    old_T: torch.Tensor,
    ref_T: torch.Tensor | None,
    advantages_S: torch.Tensor,
    seq_T: torch.Tensor,
    mask_T: torch.Tensor,
    config: GrpoLossConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """This micro-batch's loss numerator and its statistics.

    Args:
        logp_T: log p(target) at each position of the packed row (with its graph).
        old_T, ref_T: the sampling policy's and the reference's (``ref_T`` only with ``beta > 0``).
        advantages_S: each sequence's advantage.
        seq_T: each position's sequence (0 .. S-1). mask_T: bool, the completion-token positions.

    Returns:
        The numerator (divide by ``denominator`` for the step) and a detached fp32 vector:
        ``[clipped low, clipped high, tokens, ratio sum, kl sum]`` summed over completion tokens.
    """
    mask = mask_T.to(logp_T.dtype)
    num_seqs = advantages_S.shape[0]
    count_S = torch.zeros(num_seqs, dtype=logp_T.dtype, device=logp_T.device).index_add_(0, seq_T, mask)
    log_ratio_T = (logp_T - old_T) * mask
    if config.importance_sampling_level == "sequence":
        mean_S = torch.zeros_like(count_S).index_add_(0, seq_T, log_ratio_T) / count_S.clamp(min=1.0)
        log_ratio_T = mean_S[seq_T]
    ratio_T = torch.exp(log_ratio_T)
    adv_T = advantages_S.to(logp_T.dtype)[seq_T]
    clipped_T = torch.clamp(ratio_T, 1.0 - config.epsilon_low, 1.0 + config.epsilon_high)
    capped_T = ratio_T if config.delta is None else torch.clamp(ratio_T, max=config.delta)
    loss_T = -torch.min(capped_T * adv_T, clipped_T * adv_T)
    kl_T = None
    if config.beta > 0.0:
        if ref_T is None:
            raise ValueError("grpo.beta > 0 needs the reference's log-probabilities")
        diff_T = ref_T - logp_T
        kl_T = torch.exp(diff_T) - diff_T - 1.0
        if config.kl_bias_correction:
            kl_T = kl_T * ratio_T
        loss_T = loss_T + config.beta * kl_T
    loss_T = loss_T * mask
    if config.loss_type == "grpo":
        per_seq_S = torch.zeros_like(count_S).index_add_(0, seq_T, loss_T) / count_S.clamp(min=1.0)
        numerator = per_seq_S.sum()
    else:
        numerator = loss_T.sum()
    with torch.no_grad():
        low = ((ratio_T < 1.0 - config.epsilon_low) & (adv_T < 0)).to(mask.dtype) * mask
        high = ((ratio_T > 1.0 + config.epsilon_high) & (adv_T > 0)).to(mask.dtype) * mask
        kl_sum = (kl_T * mask).sum() if kl_T is not None else torch.zeros((), device=mask.device)
        stats = torch.stack([low.sum(), high.sum(), mask.sum(), (ratio_T * mask).sum(), kl_sum]).float()
    return numerator, stats
