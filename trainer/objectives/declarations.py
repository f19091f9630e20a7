"""The built-in objectives' declarations (``sft``, ``dpo``, ``grpo``) and DPO's settings. Standard library only.

Their implementations are ``trainer.objectives.sft`` and ``trainer.objectives.dpo`` (torch).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trainer.objectives.grpo_config import GrpoConfig
from trainer.objectives.registry import Chart, Declaration, MetricField, register


@dataclass(frozen=True)
class DpoConfig:
    """Direct Preference Optimization (Rafailov et al. 2023), sigmoid loss as TRL defines it."""

    beta: float = field(default=0.1, metadata={
        "doc": "KL strength: reward = beta x (policy - reference) log-prob; > 0.", "spec": {"gt": 0, "le": 100},
    })
    """Strength of the implicit KL penalty: the reward is beta x (policy - reference) log-prob."""
    label_smoothing: float = field(default=0.0, metadata={
        "doc": "Assumed probability that a preference is flipped, [0, 0.5).", "spec": {"ge": 0.0, "lt": 0.5},
    })
    """Probability that a preference label is flipped (conservative DPO); 0 is plain DPO."""

    def __post_init__(self) -> None:
        if not self.beta > 0:
            raise ValueError(f"dpo.beta: must be > 0, got {self.beta}")
        if not 0.0 <= self.label_smoothing < 0.5:
            raise ValueError(f"dpo.label_smoothing: must be in [0, 0.5), got {self.label_smoothing}")


SFT = register(Declaration(
    name="sft",
    title="SFT",
    formats=("chat", "prompt_completion", "text"),
    implementation="trainer.objectives.sft:Sft",
    doc="sft trains on chat/prompt_completion/text files",
    metrics=(
        MetricField("token_accuracy", "accuracy", "fraction",
                    "Fraction of the step's target tokens the model ranked first, before the update (0-1)."),
    ),
    charts=(Chart("token-accuracy", "Token accuracy", ("token_accuracy",)),),
    openai_method="supervised",
))

DPO = register(Declaration(
    name="dpo",
    title="DPO",
    formats=("preference",),
    implementation="trainer.objectives.dpo:Dpo",
    doc='dpo on preference files ({"input": {"messages": [...]}, "preferred_output": [...], '
        '"non_preferred_output": [...]})',
    metrics=(
        MetricField("reward_margin", "margin", "reward",
                    "Mean over pairs of chosen minus rejected reward, reward = beta x (policy - reference) log-prob."),
        MetricField("reward_accuracy", "accuracy", "fraction",
                    "Fraction of pairs whose chosen reward exceeds the rejected one (0-1)."),
        MetricField("chosen_logp", "chosen", "nats",
                    "Mean over pairs of the policy's summed log-prob of the chosen answer (nats)."),
        MetricField("rejected_logp", "rejected", "nats",
                    "Mean over pairs of the policy's summed log-prob of the rejected answer (nats)."),
    ),
    charts=(
        Chart("dpo-reward", "DPO reward margin and accuracy", ("reward_margin", "reward_accuracy")),
        Chart("dpo-logps", "DPO log-probabilities (policy)", ("chosen_logp", "rejected_logp"), digits=4),
    ),
    section=DpoConfig,
    fsdp2=False,
    openai_method="dpo",
))

DPO_STEP_FIELDS: tuple[str, ...] = tuple(m.name for m in DPO.metrics)
"""The step fields only a DPO run fills (null for the others)."""

GRPO = register(Declaration(
    name="grpo",
    title="GRPO",
    formats=("prompts",),
    implementation="trainer.objectives.grpo:Grpo",
    doc='grpo samples completions of prompts files ({"messages": [...]} or {"prompt": ...}, other keys are the '
        "grader's item) and trains on their graded rewards",
    metrics=(
        MetricField("reward_mean", "mean", "reward", "Mean reward of the step's completions."),
        MetricField("reward_std", "std", "reward", "Spread (std) of the step's rewards."),
        MetricField("zero_std_fraction", "no signal", "fraction",
                    "Fraction of the step's prompts whose completions all scored alike (advantage 0)."),
        MetricField("completion_length", "length", "tokens", "Mean completion length (tokens)."),
        MetricField("clip_fraction", "clipped", "fraction", "Fraction of completion tokens whose ratio was clipped."),
        MetricField("kl", "KL", "nats", "Mean per-token KL to the reference (null when grpo.beta is 0)."),
        MetricField("grade_error_fraction", "grader errors", "fraction",
                    "Fraction of completions the grader failed on (scored 0)."),
        MetricField("generation_ms", "generation", "ms",
                    "Wall time the step's sampling took (mean over the ranks); part of data_ms."),
        MetricField("grading_ms", "grading", "ms",
                    "Wall time the step's grading took (mean over the ranks); part of data_ms."),
    ),
    charts=(
        Chart("grpo-reward", "GRPO reward", ("reward_mean", "reward_std")),
        Chart("grpo-signal", "GRPO signal", ("zero_std_fraction", "clip_fraction", "grade_error_fraction")),
        Chart("grpo-length", "Completion length and KL", ("completion_length", "kl")),
        Chart("grpo-time", "Rollout time", ("generation_ms", "grading_ms")),
    ),
    section=GrpoConfig,
    openai_method="reinforcement",
))
