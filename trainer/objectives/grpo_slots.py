"""How many sequences a GRPO step's sampler decodes at once: the KV cache's slots and prompt slots
(``rollout_slots``), sized within the GPU memory the run leaves free (``trainer.objectives.grpo``'s
``rollout``)."""

from __future__ import annotations

import torch


CPU_SLOTS = 64
"""Sequences the sampler decodes together off CUDA (no memory to size it by)."""
PROMPT_SLOTS_PER_GROUP = 2
"""Prompt slots the shared-prompt cache holds per ``group_size`` slots: a group admitted together
uses one; choices of a group admitted in a later step (slots freed one by one as others finish)
prefill the prompt again into another, so two per group keep refills from waiting on a prompt
slot in all but odd cases (the scheduler then waits a step; it never runs out)."""


def rollout_slots(model: torch.nn.Module, prompts: int, group_size: int, prompt_len: int, max_new: int,
                  cap: int | None, shared: bool = True) -> tuple[int, int]:
    """The step's sampler shape ``(slots, prompt slots)``: slots for all ``prompts * group_size``
    sequences (one decode batch, the fastest: a decode step reads every weight once whatever its
    batch) where their KV cache fits the GPU memory left beside what the run holds now (the weights,
    adapters and optimizer state, within ``max_gpu_memory_gb`` when set, less the planner's margin),
    else as many as fit (``fit_slots``); at least one. ``shared``: the shared-prompt layout (a slot
    holds ``max_new`` positions, each prompt slot ``prompt_len``), else each slot holds
    ``prompt_len + max_new`` (prompt slots 0). The cache is freed after the rollout
    (``Engine.release``), so the training step after gets the memory back. Off CUDA: at most ``CPU_SLOTS``.
    """
    from trainer.features.attention.packed import unwrap_model
    from trainer.plan.memory import margin

    lm = unwrap_model(model)
    weight = lm.get_input_embeddings().weight
    sequences = prompts * group_size
    if weight.device.type != "cuda":
        slots = max(1, min(sequences, CPU_SLOTS))
        return slots, prompt_slots_for(slots, group_size) if shared else 0
    text = lm.config.get_text_config() if hasattr(lm.config, "get_text_config") else lm.config
    kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    position_bytes = 2 * text.num_hidden_layers * kv_heads * head_dim * weight.element_size()
    logits_bytes = 3 * text.vocab_size * 4  # a slot's fp32 logits row and the sampler's copies of it
    free, _ = torch.cuda.mem_get_info(weight.device)
    allocated = torch.cuda.memory_allocated(weight.device)
    limit = free + torch.cuda.memory_reserved(weight.device)
    if cap is not None:
        limit = min(limit, cap)
    room = limit - allocated - margin(limit)
    own = max_new if shared else prompt_len + max_new
    return fit_slots(room, sequences, group_size, own * position_bytes + logits_bytes,
                     prompt_len * position_bytes if shared else 0)


def prompt_slots_for(slots: int, group_size: int) -> int:
    """Prompt slots beside ``slots`` sequence slots (``PROMPT_SLOTS_PER_GROUP`` per group; never more
    than ``slots``: each prompt slot in use is read by at least one running sequence)."""
    return min(slots, PROMPT_SLOTS_PER_GROUP * -(-slots // group_size))


def fit_slots(room: int, sequences: int, group_size: int, slot_bytes: int, prompt_bytes: int) -> tuple[int, int]:
    """The most slots ``S`` (at most ``sequences``, at least 1) whose cache fits ``room`` bytes:
    ``S * slot_bytes + prompt_slots_for(S) * prompt_bytes``; and that prompt slot count (0 when
    ``prompt_bytes`` is 0: no prompt store)."""
    def cost(slots: int) -> int:
        return slots * slot_bytes + prompt_slots_for(slots, group_size) * prompt_bytes

    low, high = 1, max(1, sequences)
    while low < high:  # the cost grows with S: the largest S within room
        middle = (low + high + 1) // 2
        low, high = (middle, high) if cost(middle) <= room else (low, middle - 1)
    return low, prompt_slots_for(low, group_size) if prompt_bytes else 0
