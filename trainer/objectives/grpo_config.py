"""GRPO's settings (the job's ``grpo`` section): the loss's switches and the rollouts'. Standard library only.

``GrpoLossConfig`` is what ``trainer.objectives.grpo_loss`` reads; ``GrpoConfig`` adds what the
``grpo`` objective (``trainer.objectives.grpo``) samples and grades each step. Each bad value is a
``ValueError`` naming its field (``grpo.<field>``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
IMPORTANCE_LEVELS = ("token", "sequence")
REWARD_SCALES = ("group", "batch", "none")


@dataclass(frozen=True)
class GrpoLossConfig:
    """The loss's switches (the job's ``grpo`` section); ``validate`` names a bad field."""

    loss_type: str = field(default="dapo", metadata={
        "doc": "How token losses add up: grpo (mean per sequence, then over sequences), bnpo/dapo (over the "
               "step's completion tokens), dr_grpo (over sequences x max_new_tokens)."})
    epsilon_low: float = field(default=0.2, metadata={"doc": "Clip the ratio below 1 - epsilon_low.",
                                                      "spec": {"ge": 0, "lt": 1}})
    epsilon_high: float = field(default=0.2, metadata={"doc": "Clip the ratio above 1 + epsilon_high (DAPO: 0.28).",
                                                       "spec": {"ge": 0}})
    delta: float | None = field(default=None, metadata={"doc": "Cap the unclipped ratio too (two-sided clipping); "
                                                                "null: no cap."})
    beta: float = field(default=0.0, metadata={"doc": "KL coefficient to the reference (the base with the adapter "
                                                      "off); 0: no KL.", "spec": {"ge": 0}})
    kl_bias_correction: bool = field(default=True, metadata={
        "doc": "Multiply the KL term by the importance ratio (the unbiased reverse-KL gradient, TRL's default)."})
    importance_sampling_level: str = field(default="token", metadata={
        "doc": "token: one ratio per token; sequence (GSPO): the sequence's mean log-ratio for all its tokens."})
    scale_rewards: str = field(default="group", metadata={
        "doc": "Divide advantages by the group's reward std (group), the batch's (batch), or not (none)."})

    def __post_init__(self) -> None:
        checks = [
            (self.loss_type in LOSS_TYPES, "loss_type", f"one of {', '.join(LOSS_TYPES)}", self.loss_type),
            (self.importance_sampling_level in IMPORTANCE_LEVELS, "importance_sampling_level",
             f"one of {', '.join(IMPORTANCE_LEVELS)}", self.importance_sampling_level),
            (self.scale_rewards in REWARD_SCALES, "scale_rewards", f"one of {', '.join(REWARD_SCALES)}",
             self.scale_rewards),
            (0.0 <= self.epsilon_low < 1.0, "epsilon_low", "a number in [0, 1)", self.epsilon_low),
            (self.epsilon_high >= 0.0, "epsilon_high", "a number >= 0", self.epsilon_high),
            (self.delta is None or self.delta > 1.0 + self.epsilon_high, "delta",
             "null, or above 1 + epsilon_high", self.delta),
            (self.beta >= 0.0, "beta", "a number >= 0", self.beta),
        ]
        for ok, name, want, got in checks:
            if not ok:
                raise ValueError(f"grpo.{name}: must be {want}, got {got!r}")
        if self.importance_sampling_level == "sequence" and self.loss_type != "grpo":
            raise ValueError(
                f"grpo.importance_sampling_level: sequence (GSPO) weighs each sequence's tokens by one ratio and "
                f"needs loss_type grpo (a per-sequence mean); {self.loss_type} sums tokens across sequences"
            )


@dataclass(frozen=True)
class GrpoConfig(GrpoLossConfig):
    """Group Relative Policy Optimization (Shao et al. 2024): ``group_size`` completions of each
    prompt sampled from the current policy, graded, and trained on with group-normalised advantages."""

    graders: dict[str, Any] | None = field(default=None, metadata={
        "doc": "The reward: one grader in OpenAI's shape (string_check, text_similarity, python, multi).",
    })
    group_size: int = field(default=8, metadata={"doc": "Completions sampled per prompt (>= 2).", "spec": {"ge": 2, "le": 256}})
    max_new_tokens: int = field(default=256, metadata={"doc": "Longest completion (tokens).", "spec": {"ge": 1, "le": 32768}})
    temperature: float = field(default=1.0, metadata={"doc": "Sampling temperature (> 0).", "spec": {"gt": 0, "le": 10}})
    top_p: float = field(default=1.0, metadata={"doc": "Nucleus sampling (0, 1].", "spec": {"gt": 0, "le": 1}})
    log_rollouts: int = field(default=4, metadata={
        "doc": "Rollouts shown per step (the first completions of rank 0's prompts, with their rewards): the "
               "rollouts event and the job page; 0: none.", "spec": {"ge": 0, "le": 64}})

    def __post_init__(self) -> None:
        super().__post_init__()
        checks = [
            (self.group_size >= 2, "group_size", "an integer >= 2 (a group of one has no advantage)", self.group_size),
            (self.max_new_tokens >= 1, "max_new_tokens", "an integer >= 1", self.max_new_tokens),
            (self.temperature > 0, "temperature", "a number > 0 (rollouts must differ within a group)",
             self.temperature),
            (0 < self.top_p <= 1, "top_p", "a number in (0, 1]", self.top_p),
            (0 <= self.log_rollouts <= 64, "log_rollouts", "an integer in [0, 64]", self.log_rollouts),
        ]
        for ok, name, want, got in checks:
            if not ok:
                raise ValueError(f"grpo.{name}: must be {want}, got {got!r}")

    def loss_config(self) -> GrpoLossConfig:
        """The loss's switches alone."""
        return GrpoLossConfig(**{name: getattr(self, name) for name in GrpoLossConfig.__dataclass_fields__})
