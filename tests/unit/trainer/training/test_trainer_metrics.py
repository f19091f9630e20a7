"""Step metrics: phase timing, model FLOPs, MFU, memory and allocator retries, and the learning-rate schedule."""

from __future__ import annotations

import time

import pytest
import torch

from trainer.training.flops import AttentionLayers
from trainer.plan.hardware import detect, device_peak, peak_cache_path
from trainer.objectives.sft import Sft
from trainer.training.metrics import FlopCounter, PendingTiming, StepTimer, memory_stats, mfu, reset_peak_memory
from trainer.training.step import _RANK_FIELDS, PendingStep, lr_lambda


class TestStepTimer:
    def test_cpu_phases_add_up_across_micro_batches(self):
        timer = StepTimer(torch.device("cpu"))
        for _ in range(2):
            with timer.phase("forward"):
                time.sleep(0.01)
            with timer.phase("backward"):
                time.sleep(0.005)
        times = timer.finish().read()
        assert (
            times["forward_ms"] >= 20
            and times["backward_ms"] >= 10
            and times["optimizer_ms"] == 0
        )
        assert times["step_ms"] >= times["forward_ms"] + times["backward_ms"]


class TestFlops:
    def test_matmul_and_causal_attention_terms(self):
        """trainer.training.flops' count through the name the step uses (tests/unit/trainer/training/test_flops.py has the rest)."""
        counter = FlopCounter(frozen_params=1000, trainable_params=10, attention=(AttentionLayers(2, width=8),))
        # (4*frozen + 6*trainable)*T + 3.5 * 4*width*layers*sum(L(L+1)/2): lengths 3 and 4
        assert counter.step_flops([3, 4]) == 4060 * 7 + 3.5 * 4 * 8 * 2 * (6 + 10)

    def test_mfu_is_none_without_a_known_peak(self):
        assert mfu(1e12, 1000.0, None) is None
        assert mfu(1e12, 1000.0, 2e12) == pytest.approx(0.5)

    def test_cpu_memory_has_rss_and_no_gpu_fields(self):
        assert reset_peak_memory(torch.device("cpu")) is None
        stats = memory_stats(torch.device("cpu"), None)
        assert stats["host_rss"] > 0 and stats["gpu_mem_peak"] is None and stats["gpu_alloc_retries"] is None


class FakeAllocator:
    """``torch.cuda``'s memory counters as a CPU test sets them (CI has no GPU)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.retries = 0
        self.resets = 0
        monkeypatch.setattr(torch.cuda, "memory_stats_as_nested_dict", lambda device=None: {"num_alloc_retries": self.retries})
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", self._reset)
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 10)
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 20)
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 15)

    def _reset(self, device: torch.device | None = None) -> None:
        self.resets += 1  # the peaks only: the retry counter is cumulative, as torch's is


class TestAllocRetries:
    """``gpu_alloc_retries``: the allocator's cumulative ``num_alloc_retries`` counter, as a delta
    over the step, summed over ranks."""

    def test_a_step_reports_the_retries_since_its_start_not_since_the_process_started(self, monkeypatch):
        allocator = FakeAllocator(monkeypatch)
        cuda = torch.device("cuda", 0)
        allocator.retries = 5  # earlier steps' retries
        start = reset_peak_memory(cuda)
        assert start == 5 and allocator.resets == 1
        allocator.retries = 8
        stats = memory_stats(cuda, start)
        assert stats["gpu_alloc_retries"] == 3 and stats["gpu_mem_reserved"] == 20
        assert memory_stats(cuda, reset_peak_memory(cuda))["gpu_alloc_retries"] == 0
        assert memory_stats(cuda, None)["gpu_alloc_retries"] is None, "no start: unknown, not the cumulative count"

    def test_the_step_event_sums_the_ranks_retries_and_lists_each(self, monkeypatch):
        allocator = FakeAllocator(monkeypatch)
        cuda = torch.device("cuda", 0)
        start = reset_peak_memory(cuda)
        allocator.retries = 2
        event = _pending(memory_stats(cuda, start)).read(10, None, TwoRanks({"gpu_alloc_retries": 3}))
        assert event.gpu_alloc_retries == 5
        assert [r["gpu_alloc_retries"] for r in event.ranks] == [2, 3]
        assert event.gpu_mem_reserved == 20, "memory stays the largest rank's"

    def test_a_rank_without_cuda_counts_as_none_and_all_none_is_none(self):
        cpu = memory_stats(torch.device("cpu"), None)
        one = _pending(cpu).read(10, None, TwoRanks({"gpu_alloc_retries": 4}))
        assert one.gpu_alloc_retries == 4 and [r["gpu_alloc_retries"] for r in one.ranks] == [None, 4]
        both = _pending(cpu).read(10, None, TwoRanks({"gpu_alloc_retries": None}))
        assert both.gpu_alloc_retries is None and both.fields()["gpu_alloc_retries"] is None


class TwoRanks:
    """``Comm.gather_host`` of two ranks: this one's values, and rank 1's, the same but ``other``'s
    fields (None as the wire's -1)."""

    def __init__(self, other: dict[str, int | None]) -> None:
        self.other = other

    def gather_host(self, values: list[float], purpose: str = "") -> list[list[float]]:
        mine = dict(zip(_RANK_FIELDS, values))
        theirs = {**mine, **{f: -1.0 if v is None else float(v) for f, v in self.other.items()}}
        return [list(values), [theirs[f] for f in _RANK_FIELDS]]


def _pending(memory: dict[str, int | None]) -> PendingStep:
    """A finished CPU step of 100 ms over 64 tokens on this rank, with ``memory`` as its memory stats."""
    return PendingStep(
        step=1, epoch=0.1, loss=torch.tensor(2.0), grad_norm=torch.tensor(1.0), lr=1e-3, tokens=128, sequences=4,
        rank_tokens=64, flops=1e9, timing=PendingTiming([("forward", 0.0, 0.1)], cuda=False), memory=memory,
        objective=Sft(), stats=torch.zeros(1), targets=100,
    )


class TestPeak:
    """MFU's denominator: measured once per GPU model and torch version and cached, else the datasheet's."""

    def test_a_measurement_is_cached_per_gpu_and_torch_version(self, tmp_path):
        calls = []

        def measure() -> float:
            calls.append(1)
            return 801e12

        first = device_peak("NVIDIA H200", "2.11.0+cu130", measure, cache_dir=tmp_path)
        again = device_peak("NVIDIA H200", "2.11.0+cu130", measure, cache_dir=tmp_path)
        assert first == again and len(calls) == 1
        assert first[0] == 801e12 and first[1].startswith("measured: 8192^3 bf16 matmul, 20")
        assert peak_cache_path("NVIDIA H200", "2.11.0+cu130", tmp_path).name == "peak-NVIDIA-H200-2.11.0-cu130.json"
        assert device_peak("NVIDIA H200", "2.12.0", measure, cache_dir=tmp_path)[0] == 801e12 and len(calls) == 2

    def test_remeasuring_overwrites_the_cache(self, tmp_path):
        device_peak("NVIDIA H100 80GB HBM3", "2.11", lambda: 700e12, cache_dir=tmp_path)
        device_peak("NVIDIA H100 80GB HBM3", "2.11", lambda: 760e12, remeasure=True, cache_dir=tmp_path)
        assert device_peak("NVIDIA H100 80GB HBM3", "2.11", None, cache_dir=tmp_path)[0] == 760e12

    def test_without_a_measurement_the_datasheet_value_is_labelled_spec(self, tmp_path):
        def out_of_memory() -> float:
            raise torch.OutOfMemoryError("CUDA out of memory")

        spec = (989e12, "spec: H100 datasheet dense bf16")
        assert device_peak("NVIDIA H100 80GB HBM3", "2.11", None, cache_dir=tmp_path) == spec
        assert device_peak("NVIDIA H100 80GB HBM3", "2.11", out_of_memory, cache_dir=tmp_path) == spec
        assert device_peak("Some Future GPU", "2.11", None, cache_dir=tmp_path) == (None, None)
        assert not list(tmp_path.iterdir())

    def test_a_measurement_under_half_the_datasheet_is_not_trusted_nor_cached(self, tmp_path):
        peak, source = device_peak("NVIDIA H200", "2.11", lambda: 300e12, cache_dir=tmp_path)
        assert peak == 989e12 and source.startswith("spec: H200 datasheet dense bf16 (measured 300 TFLOP/s")
        assert not list(tmp_path.iterdir())
        assert device_peak("Some Future GPU", "2.11", lambda: 300e12, cache_dir=tmp_path)[0] == 300e12

    def test_the_cpu_has_no_peak_and_the_plan_hardware_names_its_source(self):
        hw = detect("cpu")
        assert hw.peak_flops is None and hw.to_dict()["peak_source"] is None


class TestLrSchedule:
    def test_warmup_then_cosine_to_zero(self):
        f = lr_lambda("cosine", warmup=2, total=6)
        assert [round(f(i), 4) for i in range(6)] == [
            0.5,
            1.0,
            1.0,
            0.8536,
            0.5,
            0.1464,
        ]

    def test_linear_and_constant(self):
        assert [lr_lambda("linear", 0, 4)(i) for i in range(4)] == [
            1.0,
            0.75,
            0.5,
            0.25,
        ]
        assert [lr_lambda("constant", 1, 4)(i) for i in range(4)] == [
            1.0,
            1.0,
            1.0,
            1.0,
        ]


def test_param_numel_counts_a_4bit_weight_by_its_logical_shape() -> None:
    """bitsandbytes packs two 4-bit weights per byte: numel() is half; quant_state has the shape."""
    import types

    import torch

    from trainer.training.metrics import param_numel

    packed = torch.nn.Parameter(torch.zeros(32 * 64 // 2, 1, dtype=torch.uint8), requires_grad=False)
    packed.quant_state = types.SimpleNamespace(shape=torch.Size([32, 64]))
    assert packed.numel() == 1024 and param_numel(packed) == 2048
    assert param_numel(torch.nn.Parameter(torch.zeros(3, 5))) == 15
