"""The decode-attention kernel (``trainer.kernels.decode_attention``) against the sampler's torch backend.

The kernel runs on CPU under ``TRITON_INTERPRET=1`` in a child process (the interpreter is chosen
when kernels are decorated, at import). Each case fills a random cache, builds one step
(``StepState``) of decoding sequences in a non-contiguous, unsorted slot order with mixed lengths
(one of length 1), plus, in some, a prompt prefilled from position 0 and one after a cached
prefix, and compares ``attend_cached`` with ``backend="triton"`` to ``backend="torch"`` on the
same cache: GQA (4 and 1 query heads per kv head, and multi-head), a head dim that is not a
power of two, sliding window, GPT-OSS sinks (drawn large, so the sink dominates some rows),
soft-capping, and split-K (the block and the split's least keys made small so each split runs
several blocks and short sequences leave splits empty).

Tolerance (max abs error over outputs of magnitude ~1): fp32 ``FP32_ATOL`` (the online softmax
sums in another order); bf16/fp16 ``HALF_ATOL``: the kernel rounds the unnormalized
probabilities to the values' dtype, the torch backend the normalized ones, and both round the
output once: two bf16 ulps at |out| < 4 (outputs are averages of N(0, 1) values).

Shared prompts (``SHARED_CASES``, ``trainer.generate.cache.SharedPrompts``): the same step on a cache
laid out with a prompt store: two decoding sequences reading one prompt slot, one reading none,
windows whose low bound falls inside the prompt, a block straddling the prompt's end, a prompt
prefilled into its prompt slot and one whose tokens fall on both sides of the prompt's end. The
kernel on it must match the torch backend on it within the same tolerances, and each backend must
give bitwise its own unshared output on the same keys (the torch backend gathers the unshared
order; the kernel runs the same blocks).
"""

from __future__ import annotations

import importlib.util
import json

import pytest

from tests.fixtures.interpreter import interpreter_results as run_in_interpreter

HAS_TRITON = importlib.util.find_spec("triton") is not None
FP32_ATOL = 1e-5
HALF_ATOL = 3e-2
CASES = [
    # (name, Hq, Hkv, D, dtype, window, sinks, softcap, splits, prefill)
    ("gqa4", 8, 2, 32, "float32", None, False, None, 1, False),
    ("gqa4_split", 8, 2, 32, "float32", None, False, None, 3, False),
    ("mha_d24", 2, 2, 24, "float32", None, False, None, 1, True),
    ("window", 4, 1, 16, "float32", 7, False, None, 2, False),
    ("sinks", 4, 2, 16, "float32", None, True, None, 1, True),
    ("sinks_window_split", 4, 2, 16, "float32", 9, True, None, 4, False),
    ("softcap", 4, 2, 16, "float32", None, False, 5.0, 2, True),
    ("bf16", 8, 2, 64, "bfloat16", None, False, None, 1, True),
    ("bf16_split_sinks", 8, 2, 64, "bfloat16", 11, True, 30.0, 3, False),
    ("fp16", 4, 4, 32, "float16", None, False, None, 2, False),
]


SHARED_CASES = [
    # (name, Hq, Hkv, D, dtype, window, sinks, softcap, splits)
    ("shared_gqa4", 8, 2, 32, "float32", None, False, None, 1),
    ("shared_window_sinks_split", 4, 2, 16, "float32", 7, True, None, 3),
    ("shared_mha_d24_softcap", 2, 2, 24, "float32", None, False, 5.0, 2),
    ("shared_bf16_window_split_sinks", 8, 2, 64, "bfloat16", 11, True, 30.0, 3),
]
SHARED_PROMPTS = [(0, 27), (-1, 0), (1, 12), (0, 27), (2, 3), (3, 6), (4, 11)]
"""Each of ``DECODES + PREFILLS``'s ``(prompt slot, prompt length)``: slots 5 and 1 share prompt slot 0
(27 positions; 5's window of 7 starts inside it), slot 0 reads none, slot 3 decodes the first position
after its prompt, and the prompt of slot 4's segment (positions 9-12) ends at 11."""


@pytest.fixture(scope="module")
def interpreter_results() -> dict[str, dict[str, float]]:
    return run_in_interpreter(__file__)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.slow  # the Triton interpreter in a child process
class TestDecodeKernelAgainstTorchBackend:
    @pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
    def test_outputs_match(self, interpreter_results, case) -> None:
        found = interpreter_results[case[0]]
        tolerance = FP32_ATOL if case[4] == "float32" else HALF_ATOL
        assert found["max_abs"] < tolerance, found
        assert found["kernel_ran"], found

    @pytest.mark.parametrize("case", SHARED_CASES, ids=[c[0] for c in SHARED_CASES])
    def test_shared_prompt_outputs_match_and_equal_the_unshared_layouts(self, interpreter_results, case) -> None:
        found = interpreter_results[case[0]]
        assert found["max_abs"] < (FP32_ATOL if case[4] == "float32" else HALF_ATOL), found
        assert found["kernel_ran"] and found["kernel_read_prompts"], found
        assert found["torch_vs_unshared"] == 0.0 and found["triton_vs_unshared"] == 0.0, found

    def test_split_count_follows_the_programs_and_the_length(self) -> None:
        from trainer.kernels.decode_attention import MIN_SPLIT_KEYS, plan_splits

        assert plan_splits(256, 8, 512, 132) == 1
        assert plan_splits(1, 8, 1000, 132) == 1000 // MIN_SPLIT_KEYS
        assert plan_splits(1, 8, 100_000, 132) == 33
        assert plan_splits(1, 8, 10, 132) == 1


DECODES = [(5, 30, 1), (0, 0, 1), (3, 12, 1), (1, 47, 1), (6, 5, 1)]
"""Segments ``(slot, first position, tokens)``: decodes in a shuffled slot order, lengths mixed."""
PREFILLS = [(2, 0, 6), (4, 9, 4)]
"""A prompt from position 0 (SDPA under ``triton``) and one after a cached prefix (the torch path)."""


def _run_case(case) -> dict[str, float]:
    import torch

    from trainer.generate.attention import StepState, attend_cached
    from trainer.generate.cache import KVCache
    from trainer.kernels import decode_attention

    name, heads_q, heads_kv, head_dim, dtype_name, window, has_sinks, softcap, splits, _ = case
    dtype = getattr(torch, dtype_name)
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    cache = KVCache(layers=1, slots=8, kv_heads=heads_kv, max_len=64, head_dim=head_dim, dtype=dtype, device="cpu")
    cache.keys_SHLD[0].copy_(torch.randn(cache.shape, generator=g))
    cache.values_SHLD[0].copy_(torch.randn(cache.shape, generator=g))
    segments = DECODES + (PREFILLS if case[9] else [])
    tokens = sum(count for _, _, count in segments)
    query = torch.randn(tokens, heads_q, head_dim, generator=g).to(dtype)
    key = torch.randn(tokens, heads_kv, head_dim, generator=g).to(dtype)
    value = torch.randn(tokens, heads_kv, head_dim, generator=g).to(dtype)
    sinks = (torch.randn(heads_q, generator=g) * 3).to(dtype) if has_sinks else None
    ran = []
    original = decode_attention.decode_attention

    def counted(*args, **kwargs):
        ran.append(True)
        return original(*args, **{**kwargs, "splits": splits})

    decode_attention.decode_attention = counted
    outs = []
    for backend in ("torch", "triton"):
        state = StepState.build(cache, segments, torch.device("cpu"), backend)
        cache.write(0, state.slot_T, state.position_T, key, value)
        outs.append(attend_cached(state, 0, query, key, value, head_dim**-0.5, window, sinks, softcap).float())
    decode_attention.decode_attention = original
    return {"max_abs": float((outs[0] - outs[1]).abs().max()), "kernel_ran": bool(ran)}


def _shared_copy(cache, segments):
    """``cache`` (unshared) laid out with a prompt store of ``SHARED_PROMPTS``: each prompt slot holds its
    sequence's first positions, each own slot the rest from position 0."""
    from trainer.generate.cache import KVCache, SharedPrompts

    _, heads_kv, length, head_dim = cache.shape
    shared = KVCache(1, 8, heads_kv, length, head_dim, cache.keys_SHLD[0].dtype, "cpu", SharedPrompts(5, 32, length))
    for (slot, _, _), (prompt_slot, prompt_len) in zip(segments, SHARED_PROMPTS):
        for own, prompt, source in ((shared.keys_SHLD[0], shared.prompt_keys_PHLD[0], cache.keys_SHLD[0]),
                                    (shared.values_SHLD[0], shared.prompt_values_PHLD[0], cache.values_SHLD[0])):
            own[slot, :, : length - prompt_len] = source[slot, :, prompt_len:]
            if prompt_len:
                prompt[prompt_slot, :, :prompt_len] = source[slot, :, :prompt_len]
    return shared


def _run_shared_case(case) -> dict[str, float]:
    import torch

    from trainer.generate.attention import StepState, attend_cached
    from trainer.generate.cache import KVCache
    from trainer.kernels import decode_attention

    name, heads_q, heads_kv, head_dim, dtype_name, window, has_sinks, softcap, splits = case
    dtype = getattr(torch, dtype_name)
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    cache = KVCache(layers=1, slots=8, kv_heads=heads_kv, max_len=64, head_dim=head_dim, dtype=dtype, device="cpu")
    cache.keys_SHLD[0].copy_(torch.randn(cache.shape, generator=g))
    cache.values_SHLD[0].copy_(torch.randn(cache.shape, generator=g))
    for tensor in (cache.keys_SHLD[0], cache.values_SHLD[0]):
        tensor[1, :, :27] = tensor[5, :, :27]  # slots 1 and 5 continue one prompt
    segments = DECODES + PREFILLS
    shared = _shared_copy(cache, segments)
    tokens = sum(count for _, _, count in segments)
    query, key, value = (torch.randn(tokens, h, head_dim, generator=g).to(dtype) for h in (heads_q, heads_kv, heads_kv))
    sinks = (torch.randn(heads_q, generator=g) * 3).to(dtype) if has_sinks else None
    calls = []
    original = decode_attention.decode_attention
    def counted(*args, **kwargs):
        calls.append(kwargs["prompt"])
        return original(*args, **{**kwargs, "splits": splits})

    decode_attention.decode_attention = counted
    outs = {}
    for layout, source, prompts in (("unshared", cache, None), ("shared", shared, SHARED_PROMPTS)):
        for backend in ("torch", "triton"):
            state = StepState.build(source, segments, torch.device("cpu"), backend, prompts)
            state.write(0, key, value)
            outs[layout, backend] = attend_cached(state, 0, query, key, value, head_dim**-0.5, window, sinks,
                                                  softcap).float()
    decode_attention.decode_attention = original
    return {"max_abs": float((outs["shared", "torch"] - outs["shared", "triton"]).abs().max()),
            "torch_vs_unshared": float((outs["shared", "torch"] - outs["unshared", "torch"]).abs().max()),
            "triton_vs_unshared": float((outs["shared", "triton"] - outs["unshared", "triton"]).abs().max()),
            "kernel_ran": len(calls) == 2, "kernel_read_prompts": calls[-1] is not None}


def _run_cases() -> dict[str, dict[str, float]]:
    """Child-process body: each case through both backends."""
    from trainer.kernels import decode_attention

    decode_attention.BLOCK_N = 16  # several key blocks per split even at these lengths
    results = {case[0]: _run_case(case) for case in CASES}
    return results | {case[0]: _run_shared_case(case) for case in SHARED_CASES}


if __name__ == "__main__":
    print(json.dumps(_run_cases()))
