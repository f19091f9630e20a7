"""bench.memory_estimate: the table's rows and ratios, and a CPU smoke run over the real machinery
(tiny Llama: the plan, each policy installed, the steps run; nothing measured off CUDA)."""

from __future__ import annotations

import pytest

from bench import memory_estimate
from bench.memory_estimate import Row


class TestTable:
    def test_a_measured_row_shows_the_ratio_and_a_skipped_one_why(self) -> None:
        rows = [
            Row("Llama-3.1-8B", "lora", "none", 84.58, 83.91, parts="est. 84.6 GiB (...)"),
            Row("Llama-3.1-8B", "lora", "full+offload", 19.08, None, status="OOM"),
        ]
        lines = memory_estimate.table(rows).splitlines()
        assert lines[2] == "| Llama-3.1-8B | lora | none | 84.58 | 83.91 | 1.008 | est. 84.6 GiB (...) |"
        assert lines[3] == "| Llama-3.1-8B | lora | full+offload | 19.08 | OOM | - |  |"

    def test_selective_checkpoints_half_the_layers(self) -> None:
        assert memory_estimate.policy_backend("selective", 32) == "selective:16/32"
        assert memory_estimate.policy_backend("full", 32) == "full"

    def test_unknown_policy_is_refused(self) -> None:
        with pytest.raises(SystemExit):
            memory_estimate.parse_args(["--policies", "half"])


@pytest.mark.slow  # builds a tiny model and runs each policy's steps: ~10 s on 2 busy cores
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_cpu_smoke_run_prints_every_policy(capsys) -> None:
    assert memory_estimate.main(["--device", "cpu", "--tiny", "--models", "tiny-llama", "--warmup", "0"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| tiny-Llama")]
    assert [r.split(" | ")[2] for r in rows] == ["none", "selective:1/2", "full", "full+offload"]
    assert all(" | - | - | est. " in r for r in rows)
    assert "- tiny-Llama: auto picks `full`" in out
