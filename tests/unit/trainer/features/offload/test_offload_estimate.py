"""What offloaded checkpointing costs (trainer/features/offload/estimate.py): the plan's byte counts and limits."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch

from trainer.features.offload import double_buffer_supported, estimate, host_available_bytes


class TestEstimates:
    def test_llama_8b_at_16k_tokens(self) -> None:
        from transformers import LlamaConfig

        config = LlamaConfig(hidden_size=4096, num_hidden_layers=32)
        est = estimate(config, 16_384, torch.bfloat16)
        assert est.buffer == est.second_buffer == 16_384 * 4096 * 2 == 128 << 20
        assert (
            est.checkpointed
            == estimate(config, 16_384, "bfloat16").checkpointed
            == 32 * est.buffer
        )
        assert est.offloaded == 31 * est.buffer

    def test_bad_inputs_say_what_to_fix(self) -> None:
        with pytest.raises(ValueError, match="tokens: must be >= 1"):
            estimate(object(), 0, "bfloat16")
        with pytest.raises(ValueError, match="num_hidden_layers/hidden_size"):
            estimate(object(), 16, "bfloat16")
        with pytest.raises(ValueError, match="dtype 'int8'"):
            estimate(
                type("C", (), {"num_hidden_layers": 2, "hidden_size": 4})(), 16, "int8"
            )

    def test_the_last_layer_input_never_goes_to_the_host(self) -> None:
        """One layer: nothing to offload (its input is kept for the first backward); fp32 is 4 bytes."""
        est = estimate(SimpleNamespace(num_hidden_layers=1, hidden_size=8), 10, "float32")
        assert (est.checkpointed, est.offloaded, est.buffer) == (320, 0, 320)

    def test_double_buffer_needs_room_for_the_second_buffer(self) -> None:
        assert double_buffer_supported(8 << 30, 128 << 20) is None
        assert "second reload buffer" in double_buffer_supported(600 << 20, 128 << 20)

    @pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/meminfo")
    def test_host_available_bytes_reads_meminfo(self) -> None:
        assert host_available_bytes() > 0
