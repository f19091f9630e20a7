"""bench.profile_run's GPU-busy fraction, on a hand-made chrome trace."""

from __future__ import annotations

import pytest

from bench.profile_run import busy_fraction


def _event(name: str, ts: float, dur: float, cat: str = "kernel") -> dict:
    return {"name": name, "cat": cat, "ts": ts, "dur": dur}


class TestBusyFraction:
    def test_overlapping_kernels_count_once_and_outside_the_window_not_at_all(self) -> None:
        trace = {"traceEvents": [
            _event("ProfilerStep#1", 100, 50, cat="user_annotation"),
            _event("ProfilerStep#2", 150, 50, cat="user_annotation"),
            _event("k1", 90, 20),      # 100..110 inside the window
            _event("k2", 105, 10),     # overlaps k1: 110..115 new
            _event("copy", 150, 5, cat="gpu_memcpy"),
            _event("cpu op", 120, 60, cat="cpu_op"),  # host work is not GPU-busy
            _event("k3", 195, 20),     # 195..200 inside
            _event("late", 300, 10),
        ]}
        busy, window_ms, events = busy_fraction(trace)
        assert window_ms == pytest.approx(0.1)
        assert busy == pytest.approx((10 + 5 + 5 + 5) / 100)
        assert events == 4

    def test_no_step_markers_is_nan(self) -> None:
        busy, window_ms, events = busy_fraction({"traceEvents": [_event("k", 0, 1)]})
        assert busy != busy and (window_ms, events) == (0.0, 0)


class TestSyncCalls:
    def test_counts_waits_inside_the_window_by_kind(self) -> None:
        from bench.profile_run import sync_calls

        trace = {"traceEvents": [
            _event("ProfilerStep#1", 100, 100, cat="user_annotation"),
            _event("cudaStreamSynchronize", 120, 5, cat="cuda_runtime"),
            _event("cudaEventSynchronize", 150, 1, cat="cuda_runtime"),
            _event("cudaEventSynchronize", 250, 1, cat="cuda_runtime"),  # after the window
        ]}
        assert sync_calls(trace) == {"cudaStreamSynchronize": 1, "cudaDeviceSynchronize": 0, "cudaEventSynchronize": 1}
