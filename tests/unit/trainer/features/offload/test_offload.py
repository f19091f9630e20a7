"""Offloaded activation checkpointing on CPU: same numbers as plain checkpointing, stream order, surface.

The CPU runs the offloader's real code path with ``SyncStreams`` (copies at once, events no-ops),
so these tests prove the equivalence CI can check; ``tests/gpu/test_offload_gpu.py`` repeats it
with CUDA streams and checks the overlap.

Tolerances: fp32 on CPU, one thread. The offloaded recompute runs the same ops on the same
values as transformers' own checkpoint recompute (the reload is a byte copy), so loss and every
LoRA gradient are compared with ``torch.equal`` (bitwise) against plain checkpointing and
against no checkpointing at all. The schedule alone: ``test_offload_schedule.py``; the plan's
byte estimates: ``test_offload_estimate.py``; shared models and steps: ``offload_helpers.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from offload_helpers import (
    COMMON,
    LENGTHS_1,
    LENGTHS_2,
    MODES,
    assert_bitwise,
    loss_of,
    make_batch,
    make_model,
    train_step,
)

from trainer.features.offload import (
    ActivationOffloader,
    NoOffload,
    SyncStreams,
    build,
    decoder_layers,
)

pytestmark = [
    pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"),
    pytest.mark.usefixtures("one_thread"),
]


class LateSideStreams(SyncStreams):
    """A CPU twin whose side stream runs as LATE as the events allow, like a busy copy engine.

    Side-stream copies are queued and run only when the main stream waits on an event recorded
    after them (or on the whole side stream). Main-stream work is synchronous, so waits of the
    side stream on main events are already satisfied. A missing ``copy_done`` wait shows up as
    a recompute from a stale buffer, i.e. different gradients.
    """

    class Event:
        position: int | None = None

    def __init__(self) -> None:
        self.queue: list[Any] = []
        self.ran = 0
        self.most_pending = 0

    def main(self) -> str:
        return "main"

    def side(self) -> str:
        return "side"

    def event(self) -> LateSideStreams.Event:
        return LateSideStreams.Event()

    def record(self, event: Any, stream: Any) -> None:
        event.position = len(self.queue) if stream == "side" else None

    def wait_event(self, stream: Any, event: Any) -> None:
        if stream == "main" and event.position is not None:
            self._run_until(event.position)

    def wait_stream(self, stream: Any, other: Any) -> None:
        if stream == "main" and other == "side":
            self._run_until(len(self.queue))

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Any) -> None:
        assert stream == "side"
        self.queue.append(lambda: dst.copy_(src))
        self.most_pending = max(self.most_pending, len(self.queue) - self.ran)

    def _run_until(self, position: int) -> None:
        while self.ran < position:
            self.queue[self.ran]()
            self.ran += 1


class TestEquivalence:
    @pytest.mark.parametrize("family", ["llama", "qwen3"])
    def test_all_modes_give_bitwise_equal_loss_and_lora_grads_with_grad_accumulation(
        self, family: str
    ) -> None:
        results = {mode: train_step(make_model(family, mode)) for mode in MODES}
        for mode in MODES[1:]:
            assert_bitwise(results["none"], results[mode])

    @pytest.mark.parametrize("mode", ["offload-double", "offload-single"])
    def test_copies_deferred_until_their_events_give_the_same_grads(
        self, mode: str
    ) -> None:
        streams = LateSideStreams()
        assert_bitwise(
            train_step(make_model("llama", "none")),
            train_step(make_model("llama", mode, streams=streams)),
        )
        assert (
            streams.most_pending >= 3
        )  # the forward's offload copies really waited in the queue

    def test_dropout_recompute_replays_the_forward_masks(self) -> None:
        reference = train_step(make_model("llama", "none", dropout=0.2))
        assert_bitwise(
            reference, train_step(make_model("llama", "offload-double", dropout=0.2))
        )
        assert_bitwise(
            reference, train_step(make_model("llama", "offload-single", dropout=0.2))
        )

    def test_dropout_without_rng_replay_differs(self) -> None:
        """The dropout test above can fail: without the RNG replay the recompute draws new masks."""
        losses_ref, grads_ref = train_step(make_model("llama", "none", dropout=0.2))
        losses, grads = train_step(make_model("llama", "offload-double", dropout=0.2, rng=False))
        assert all(
            torch.equal(a, b) for a, b in zip(losses, losses_ref, strict=True)
        )  # forward untouched
        assert any(not torch.equal(grads[n], grads_ref[n]) for n in grads)

    def test_odd_layer_count(self) -> None:
        assert_bitwise(
            train_step(make_model("llama", "none", layers=3)),
            train_step(make_model("llama", "offload-double", layers=3)),
        )

    def test_two_forwards_then_one_backward(self) -> None:
        """Two passes alive at once: each owns its host copies, and a stolen prefetch reloads."""

        def run(model: Any) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
            loss = loss_of(model, make_batch(LENGTHS_1, 3)) + loss_of(
                model, make_batch(LENGTHS_2, 4)
            )
            loss.backward()
            return [loss.detach()], {
                n: p.grad.clone()
                for n, p in model.named_parameters()
                if p.requires_grad
            }

        assert_bitwise(
            run(make_model("llama", "none")), run(make_model("llama", "offload-double"))
        )

    def test_packed_metadata_kwargs_reach_the_recompute(self) -> None:
        """ftq's packed attention passes a metadata object as a layer kwarg; it is kept as-is."""
        from trainer.features.attention.packed import PackedAttention
        from trainer.data.packed_metadata import build_packed_metadata

        def run(mode: str) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
            model = make_model("llama", mode)
            PackedAttention("sdpa").install(model)
            meta = build_packed_metadata(LENGTHS_2, "cpu", backend="sdpa")
            ids = make_batch(LENGTHS_2, 5)["input_ids"]
            logits = model(input_ids=ids, use_cache=False, **meta.model_kwargs()).logits
            loss = F.cross_entropy(logits[0, :-1], ids[0, 1:], reduction="sum")
            loss.backward()
            return [loss.detach()], {
                n: p.grad.clone()
                for n, p in model.named_parameters()
                if p.requires_grad
            }

        assert_bitwise(run("checkpoint"), run("offload-double"))

    def test_transformers_checkpointing_is_bypassed_not_nested(self) -> None:
        model = make_model("llama", "checkpoint")
        calls = []
        for layer in decoder_layers(model):
            inner = layer._gradient_checkpointing_func
            layer._gradient_checkpointing_func = lambda *a, inner=inner, **k: (
                calls.append(1) or inner(*a, **k)
            )
        loss_of(model, make_batch(LENGTHS_1, 0)).backward()
        assert len(calls) == COMMON["num_hidden_layers"]  # the hook works
        calls.clear()
        model.zero_grad()
        ActivationOffloader("cpu").apply(model)
        loss_of(model, make_batch(LENGTHS_1, 0)).backward()
        assert calls == []

    def test_second_backward_through_the_same_graph_is_refused(self) -> None:
        model = make_model("llama", "offload-double")
        loss = loss_of(model, make_batch(LENGTHS_1, 0))
        loss.backward(retain_graph=True)
        with pytest.raises(RuntimeError, match="backward twice"):
            loss.backward()

    def test_no_grad_forward_runs_the_plain_layer(self) -> None:
        model = make_model("llama", "offload-double")
        with torch.no_grad():
            model(**make_batch(LENGTHS_1, 0), use_cache=False)
        assert model.offloader.trace == []

    def test_remove_restores_the_layers(self) -> None:
        model = make_model("llama", "offload-double")
        model.offloader.remove(model)
        assert all("forward" not in vars(layer) for layer in decoder_layers(model))
        assert_bitwise(train_step(make_model("llama", "none")), train_step(model))


class RecordingStreams(SyncStreams):
    """The CPU twin, logging every stream operation in order (names instead of streams)."""

    def __init__(self) -> None:
        self.log: list[tuple[str, ...]] = []

    def main(self) -> str:
        return "main"

    def side(self) -> str:
        return "side"

    def wait_event(self, stream: Any, event: Any) -> None:
        self.log.append(("wait_event", stream))

    def wait_stream(self, stream: Any, other: Any) -> None:
        self.log.append(("wait_stream", stream, other))

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Any) -> None:
        self.log.append(("copy", stream))
        super().copy(dst, src, stream)

    def device_empty(
        self, numel: int, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        self.log.append(("device_empty",))
        return super().device_empty(numel, dtype, device)


class TestStreamSafety:
    @pytest.mark.parametrize("mode", ["offload-double", "offload-single"])
    def test_copy_into_a_fresh_buffer_waits_for_the_whole_main_stream(
        self, mode: str
    ) -> None:
        """A new buffer comes from the main stream's pool, whose queued kernels may still use that
        memory: the side-stream copy into it must wait for all of main first. (Missing in the
        double-buffered path, this gave 1e11/NaN LoRA gradients on an H200 at 8B/14B scale.)"""
        streams = RecordingStreams()
        model = make_model("llama", mode, streams=streams)
        # two micro-batches; the second is longer, so both buffers grow again
        train_step(model)
        allocations = [i for i, op in enumerate(streams.log) if op[0] == "device_empty"]
        assert len(allocations) == (4 if mode == "offload-double" else 2)
        for i in allocations:
            after = streams.log[i + 1 :]
            first_copy = next(j for j, op in enumerate(after) if op[0] == "copy")
            waits = after[:first_copy]
            assert ("wait_stream", "side", "main") in waits, streams.log[i:]


class TestTupleOutputs:
    def test_tuple_output_with_none_is_reassembled(self) -> None:
        from transformers.modeling_layers import GradientCheckpointingLayer

        class Layer(GradientCheckpointingLayer):
            def __init__(self) -> None:
                super().__init__()
                self.linear = torch.nn.Linear(8, 8)

            def forward(
                self, hidden_states: torch.Tensor, scale: float = 1.0
            ) -> tuple[torch.Tensor, None]:
                return torch.tanh(self.linear(hidden_states)) * scale, None

        def run(offload: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
            torch.manual_seed(0)
            layers = torch.nn.ModuleList([Layer() for _ in range(3)])
            if offload:
                ActivationOffloader("cpu").apply(layers, layers=list(layers))
            x = torch.randn(1, 5, 8, requires_grad=True)
            h = x
            for layer in layers:
                h, none = layer(h, scale=0.5)
                assert none is None
            h.sum().backward()
            return x.grad, [p.grad for p in layers.parameters()]

        (gx_a, gp_a), (gx_b, gp_b) = run(False), run(True)
        assert torch.equal(gx_a, gx_b)
        assert all(torch.equal(a, b) for a, b in zip(gp_a, gp_b, strict=True))


class TestSurface:
    def test_transformers_own_checkpointing_flag_is_off_while_applied_and_restored(self) -> None:
        """transformers 5.17 checkpoints in the layer's ``__call__`` when the flag is set: the
        offloader clears it while applied (else each layer is recomputed twice) and restores it."""
        model = make_model("llama", "checkpoint")
        layers = decoder_layers(model)
        assert all(layer.gradient_checkpointing for layer in layers)
        offloader = ActivationOffloader("cpu")
        offloader.apply(model)
        assert not any(layer.gradient_checkpointing for layer in layers)
        offloader.remove(model)
        assert all(layer.gradient_checkpointing for layer in layers)

    def test_no_offload_twin_has_the_same_surface(self) -> None:
        public = {n for n in dir(ActivationOffloader) if not n.startswith("_")}
        assert public <= set(dir(NoOffload))
        model = torch.nn.Linear(2, 2)
        twin = build("cpu", offload=False, double_buffer=True)
        assert isinstance(twin, NoOffload) and twin.apply(model) is model
        assert twin.extra_gpu_bytes == 0 and twin.trace == [] and not twin.enabled
        assert isinstance(
            build("cpu", offload=True, double_buffer=False), ActivationOffloader
        )

    def test_apply_twice_is_refused(self) -> None:
        model = make_model("llama", "offload-double")
        with pytest.raises(ValueError, match="already applied"):
            model.offloader.apply(model)
        with pytest.raises(ValueError, match="instance-level forward"):
            ActivationOffloader("cpu").apply(model)

    def test_decoder_layers_needs_one_layer_list(self) -> None:
        with pytest.raises(
            ValueError, match="expected one decoder-layer list, found none"
        ):
            decoder_layers(torch.nn.Sequential(torch.nn.Linear(2, 2)))

    def test_argument_that_requires_grad_is_refused(self) -> None:
        model = make_model("llama", "offload-double")
        layer = decoder_layers(model)[0]
        x = torch.randn(1, 3, COMMON["hidden_size"])
        with pytest.raises(ValueError, match="only the hidden state may require grad"):
            layer(
                x,
                position_embeddings=(
                    torch.ones(1, 3, 8, requires_grad=True),
                    torch.ones(1, 3, 8),
                ),
            )
        with pytest.raises(ValueError, match="past_key_values must be None"):
            layer(x, past_key_values=object())


class TestOverlapSummary:
    """bench.offload.overlap_summary reads the GPU test's and the benchmark's traces; hand-made trace here."""

    def test_counts_only_side_stream_copies_under_main_stream_kernels(
        self, tmp_path: Any
    ) -> None:
        import json

        from bench.offload import overlap_summary

        def event(
            cat: str, name: str, stream: int, ts: float, dur: float
        ) -> dict[str, Any]:
            return {
                "ph": "X",
                "cat": cat,
                "name": name,
                "ts": ts,
                "dur": dur,
                "args": {"stream": stream},
            }

        trace = tmp_path / "trace.json"
        trace.write_text(
            json.dumps(
                {
                    "traceEvents": [
                        event("kernel", "gemm", 7, 0, 100),
                        event("kernel", "gemm", 7, 150, 100),
                        event("kernel", "small", 13, 0, 5),
                        event(
                            "gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 13, 50, 100
                        ),  # 50..100 under a kernel
                        event(
                            "gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 13, 260, 40
                        ),  # after all kernels
                        event(
                            "gpu_memcpy", "Memcpy HtoD (Pageable -> Device)", 7, 0, 10
                        ),  # the main stream's own
                        event(
                            "gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 13, 10, 20
                        ),
                        {"ph": "i", "name": "marker", "ts": 5},
                    ]
                }
            )
        )
        summary = overlap_summary(trace)
        assert summary["main_stream"] == 7
        assert summary["h2d"]["copies"] == 2
        assert summary["h2d"]["copy_ms"] == pytest.approx(0.140)
        assert summary["h2d"]["overlapped_ms"] == pytest.approx(0.050)
        assert summary["h2d"]["overlapped_fraction"] == pytest.approx(0.050 / 0.140)
        assert summary["d2h"]["overlapped_fraction"] == pytest.approx(1.0)

    def test_trace_without_kernels_is_refused(self, tmp_path: Any) -> None:
        import json

        from bench.offload import overlap_summary

        trace = tmp_path / "trace.json"
        trace.write_text(json.dumps({"traceEvents": []}))
        with pytest.raises(ValueError, match="no GPU kernels"):
            overlap_summary(trace)
