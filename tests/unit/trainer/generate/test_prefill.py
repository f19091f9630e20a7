"""``trainer.generate.prefill``: which of a step's tokens form the one varlen batch of its prompts.

The engine-level proof (the batch's tokens equal the torch backend's, GPT-OSS's window and sinks
included) runs the kernel under Triton's interpreter in ``test_attention_backends.py``; on CUDA,
``tests/gpu/test_sampler_gpu.py``.
"""

from __future__ import annotations

import torch

from trainer.generate.attention import StepState
from trainer.generate.cache import KVCache
from trainer.generate.prefill import plan_prefill

CPU = torch.device("cpu")


def test_the_prompts_after_the_decoding_tokens_form_one_batch() -> None:
    segments = [(3, 17, 1), (0, 5, 1), (1, 0, 4), (2, 0, 1), (4, 0, 6)]
    prefill = plan_prefill(segments, True, CPU)
    assert prefill is not None
    assert (prefill.start, prefill.tokens, prefill.max_seqlen) == (2, 11, 6)
    assert prefill.cu_seqlens.tolist() == [0, 4, 5, 11] and prefill.cu_seqlens.dtype == torch.int32
    # groups: 0 the one-token segments (both decoding ones and the one-token prompt), then each
    # prompt of several tokens in row order
    assert prefill.groups == frozenset({1, 2})


def test_no_batch_for_fewer_than_two_prompts_of_several_tokens() -> None:
    assert plan_prefill([(0, 5, 1), (1, 0, 4)], True, CPU) is None
    assert plan_prefill([(0, 0, 4), (1, 0, 1)], False, CPU) is None
    assert plan_prefill([(0, 5, 1), (1, 9, 1)], True, CPU) is None


def test_no_batch_when_a_segment_after_the_first_prompt_continues_a_cached_sequence() -> None:
    assert plan_prefill([(1, 0, 4), (2, 3, 5)], False, CPU) is None


def test_its_groups_are_the_step_states_prompt_groups() -> None:
    cache = KVCache(layers=1, slots=5, kv_heads=1, max_len=16, head_dim=4, dtype=torch.float32, device="cpu")
    segments = [(3, 7, 1), (1, 0, 4), (2, 0, 1), (4, 0, 6)]
    state = StepState.build(cache, segments, CPU, "triton")
    assert state.prefill is not None
    for index in state.prefill.groups:
        group = state.groups[index]
        assert group.size[1] > 1 and group.kv_len == group.size[1]  # a prompt from position 0
        rows = group.rows.tolist()
        assert state.prefill.start <= rows[0] and rows[-1] < state.prefill.start + state.prefill.tokens
    assert StepState.build(cache, segments, CPU, "torch").prefill is None  # the reference path attends each
