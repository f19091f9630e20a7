"""Offloaded activation checkpointing on CPU: same numbers as plain checkpointing, and the schedule.

The CPU runs the offloader's real code path with ``SyncStreams`` (copies at once, events no-ops),
so these tests prove the equivalence CI can check; ``tests/gpu/test_offload_gpu.py`` repeats it
with CUDA streams and checks the overlap.

Tolerances: fp32 on CPU, one thread. The offloaded recompute runs the same ops on the same
values as transformers' own checkpoint recompute (the reload is a byte copy), so loss and every
LoRA gradient are compared with ``torch.equal`` (bitwise) against plain checkpointing and
against no checkpointing at all.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from trainer.offload import (
    ActivationOffloader,
    NoOffload,
    ReloadSchedule,
    Step,
    SyncStreams,
    activation_bytes,
    build,
    decoder_layers,
    double_buffer_supported,
    estimate,
    supported,
)

pytestmark = [
    pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"),
    pytest.mark.usefixtures("one_thread"),
]

COMMON = {
    "hidden_size": 32,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 64,
    "vocab_size": 96,
}
LENGTHS_1 = (5, 9, 4)
LENGTHS_2 = (7, 3, 12, 6)
"""The second micro-batch is longer: the reload buffers must grow."""
MODES = ("none", "checkpoint", "offload-single", "offload-double")



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


def _model(
    family: str,
    mode: str,
    *,
    dropout: float = 0.0,
    layers: int = 4,
    rng: bool = True,
    streams: Any = None,
) -> Any:
    """A tiny random-weight model with LoRA (random B, so A gets gradients too) in ``mode``."""
    import peft
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    torch.manual_seed(0)
    common = {**COMMON, "num_hidden_layers": layers, "attention_dropout": dropout}
    if family == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**common, head_dim=8))
    else:
        model = LlamaForCausalLM(LlamaConfig(**common))
    model.config.use_cache = False
    if mode == "checkpoint":
        model.activation_checkpointing_enable(
            activation_checkpointing_kwargs={"use_reentrant": False}
        )
    lora = peft.LoraConfig(
        r=4,
        lora_alpha=8,
        lora_dropout=dropout,
        target_modules="all-linear",
        task_type="CAUSAL_LM",
    )
    model = peft.get_peft_model(model, lora)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    model.train()
    if mode.startswith("offload"):
        offloader = ActivationOffloader(
            "cpu",
            double_buffer=mode == "offload-double",
            preserve_rng_state=rng,
            streams=streams,
        )
        offloader.apply(model)
        model.offloader = offloader
    return model


def _batch(lengths: tuple[int, ...], seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, COMMON["vocab_size"], (1, sum(lengths)), generator=gen)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    return {"input_ids": ids, "position_ids": positions}


def _loss(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    logits = model(**batch, use_cache=False).logits
    return F.cross_entropy(
        logits[0, :-1].float(), batch["input_ids"][0, 1:], reduction="sum"
    )


def _step(
    model: Any, seed: int = 1
) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """Two micro-batches (gradient accumulation), seeded per forward; returns losses and LoRA grads."""
    losses = []
    for i, lengths in enumerate((LENGTHS_1, LENGTHS_2)):
        torch.manual_seed(seed + i)
        loss = _loss(model, _batch(lengths, seed=10 + i))
        loss.backward()
        losses.append(loss.detach())
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return losses, grads


def _assert_bitwise(a: tuple, b: tuple) -> None:
    (loss_a, grads_a), (loss_b, grads_b) = a, b
    assert all(torch.equal(x, y) for x, y in zip(loss_a, loss_b, strict=True)), (
        loss_a,
        loss_b,
    )
    assert grads_a.keys() == grads_b.keys()
    assert len(grads_a) > 0
    for name in grads_a:
        assert torch.count_nonzero(grads_a[name]) > 0, f"{name} got no gradient"
        assert torch.equal(grads_a[name], grads_b[name]), (
            name,
            (grads_a[name] - grads_b[name]).abs().max().item(),
        )


class TestEquivalence:
    @pytest.mark.parametrize("family", ["llama", "qwen3"])
    def test_all_modes_give_bitwise_equal_loss_and_lora_grads_with_grad_accumulation(
        self, family: str
    ) -> None:
        results = {mode: _step(_model(family, mode)) for mode in MODES}
        for mode in MODES[1:]:
            _assert_bitwise(results["none"], results[mode])

    @pytest.mark.parametrize("mode", ["offload-double", "offload-single"])
    def test_copies_deferred_until_their_events_give_the_same_grads(
        self, mode: str
    ) -> None:
        streams = LateSideStreams()
        _assert_bitwise(
            _step(_model("llama", "none")),
            _step(_model("llama", mode, streams=streams)),
        )
        assert (
            streams.most_pending >= 3
        )  # the forward's offload copies really waited in the queue

    def test_dropout_recompute_replays_the_forward_masks(self) -> None:
        reference = _step(_model("llama", "none", dropout=0.2))
        _assert_bitwise(
            reference, _step(_model("llama", "offload-double", dropout=0.2))
        )
        _assert_bitwise(
            reference, _step(_model("llama", "offload-single", dropout=0.2))
        )

    def test_dropout_without_rng_replay_differs(self) -> None:
        """The dropout test above can fail: without the RNG replay the recompute draws new masks."""
        losses_ref, grads_ref = _step(_model("llama", "none", dropout=0.2))
        losses, grads = _step(_model("llama", "offload-double", dropout=0.2, rng=False))
        assert all(
            torch.equal(a, b) for a, b in zip(losses, losses_ref, strict=True)
        )  # forward untouched
        assert any(not torch.equal(grads[n], grads_ref[n]) for n in grads)

    def test_odd_layer_count(self) -> None:
        _assert_bitwise(
            _step(_model("llama", "none", layers=3)),
            _step(_model("llama", "offload-double", layers=3)),
        )

    def test_two_forwards_then_one_backward(self) -> None:
        """Two passes alive at once: each owns its host copies, and a stolen prefetch reloads."""

        def run(model: Any) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
            loss = _loss(model, _batch(LENGTHS_1, 3)) + _loss(
                model, _batch(LENGTHS_2, 4)
            )
            loss.backward()
            return [loss.detach()], {
                n: p.grad.clone()
                for n, p in model.named_parameters()
                if p.requires_grad
            }

        _assert_bitwise(
            run(_model("llama", "none")), run(_model("llama", "offload-double"))
        )

    def test_packed_metadata_kwargs_reach_the_recompute(self) -> None:
        """ftq's packed attention passes a metadata object as a layer kwarg; it is kept as-is."""
        from trainer.attention import install
        from trainer.packed_metadata import build_packed_metadata

        def run(mode: str) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
            model = _model("llama", mode)
            install(model, backend="sdpa")
            meta = build_packed_metadata(LENGTHS_2, "cpu", backend="sdpa")
            ids = _batch(LENGTHS_2, 5)["input_ids"]
            logits = model(input_ids=ids, use_cache=False, **meta.model_kwargs()).logits
            loss = F.cross_entropy(logits[0, :-1], ids[0, 1:], reduction="sum")
            loss.backward()
            return [loss.detach()], {
                n: p.grad.clone()
                for n, p in model.named_parameters()
                if p.requires_grad
            }

        _assert_bitwise(run("checkpoint"), run("offload-double"))

    def test_transformers_checkpointing_is_bypassed_not_nested(self) -> None:
        model = _model("llama", "checkpoint")
        calls = []
        for layer in decoder_layers(model):
            inner = layer._gradient_checkpointing_func
            layer._gradient_checkpointing_func = lambda *a, inner=inner, **k: (
                calls.append(1) or inner(*a, **k)
            )
        _loss(model, _batch(LENGTHS_1, 0)).backward()
        assert len(calls) == COMMON["num_hidden_layers"]  # the hook works
        calls.clear()
        model.zero_grad()
        ActivationOffloader("cpu").apply(model)
        _loss(model, _batch(LENGTHS_1, 0)).backward()
        assert calls == []

    def test_second_backward_through_the_same_graph_is_refused(self) -> None:
        model = _model("llama", "offload-double")
        loss = _loss(model, _batch(LENGTHS_1, 0))
        loss.backward(retain_graph=True)
        with pytest.raises(RuntimeError, match="backward twice"):
            loss.backward()

    def test_no_grad_forward_runs_the_plain_layer(self) -> None:
        model = _model("llama", "offload-double")
        with torch.no_grad():
            model(**_batch(LENGTHS_1, 0), use_cache=False)
        assert model.offloader.trace == []

    def test_remove_restores_the_layers(self) -> None:
        model = _model("llama", "offload-double")
        model.offloader.remove(model)
        assert all("forward" not in vars(layer) for layer in decoder_layers(model))
        _assert_bitwise(_step(_model("llama", "none")), _step(model))


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
        model = _model("llama", mode, streams=streams)
        # two micro-batches; the second is longer, so both buffers grow again
        _step(model)
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


class TestSchedule:
    def _backward_all(self, schedule: ReloadSchedule, entries: list) -> None:
        for p, e in reversed(entries):
            schedule.backward(p, e)
            schedule.done(e)

    def test_double_buffer_alternates_and_prefetches_one_layer_ahead(self) -> None:
        s = ReloadSchedule(4, double_buffer=True)
        entries = [s.forward(i, 100) for i in range(4)]
        self._backward_all(s, entries)
        assert s.trace == [
            Step("offload", 0),
            Step("offload", 1),
            Step("offload", 2),
            Step("keep", 3),
            # backward of the kept last layer prefetches layer 2 into buffer 0, just allocated from
            # the main stream's pool: the copy waits for the whole main stream (the H200 race)
            Step("grow", 2, 0, 100),
            Step("h2d", 2, 0, "main"),
            Step("backward", 3, None),
            # layer 2: main waits for its copy, layer 1 is copied into buffer 1 meanwhile
            Step("wait", 2, 0),
            Step("grow", 1, 1, 100),
            Step("h2d", 1, 1, "main"),
            Step("backward", 2, 0),
            Step("release", 2, 0),
            # layer 0's copy into buffer 0 waits for the event recorded after layer 2's backward
            Step("wait", 1, 1),
            Step("h2d", 0, 0, 2),
            Step("backward", 1, 1),
            Step("release", 1, 1),
            Step("wait", 0, 0),
            Step("backward", 0, 0),
            Step("release", 0, 0),
        ]

    def test_second_pass_waits_on_the_previous_pass_release_events(self) -> None:
        s = ReloadSchedule(4, double_buffer=True)
        self._backward_all(s, [s.forward(i, 100) for i in range(4)])
        del s.trace[:]
        self._backward_all(s, [s.forward(i, 100) for i in range(4)])
        loads = [step for step in s.trace if step.op == "h2d"]
        # buffer 0 was last read by layer 0, buffer 1 by layer 1 (previous micro-batch)
        assert loads == [
            Step("h2d", 2, 0, 0),
            Step("h2d", 1, 1, 1),
            Step("h2d", 0, 0, 2),
        ]
        assert not [step for step in s.trace if step.op == "grow"]

    def test_single_buffer_reloads_synchronously_after_the_main_stream(self) -> None:
        s = ReloadSchedule(3, double_buffer=False)
        self._backward_all(s, [s.forward(i, 10) for i in range(3)])
        assert s.trace == [
            Step("offload", 0),
            Step("offload", 1),
            Step("keep", 2),
            Step("backward", 2, None),
            Step("grow", 1, 0, 10),
            Step("h2d", 1, 0, "main"),
            Step("wait", 1, 0),
            Step("backward", 1, 0),
            Step("release", 1, 0),
            Step("h2d", 0, 0, "main"),
            Step("wait", 0, 0),
            Step("backward", 0, 0),
            Step("release", 0, 0),
        ]

    def test_buffers_grow_on_a_longer_batch_and_never_shrink(self) -> None:
        s = ReloadSchedule(4, double_buffer=True)
        for numel in (100, 250, 50):
            self._backward_all(s, [s.forward(i, numel) for i in range(4)])
        grows = [step for step in s.trace if step.op == "grow"]
        assert grows == [
            Step("grow", 2, 0, 100),
            Step("grow", 1, 1, 100),
            Step("grow", 2, 0, 250),
            Step("grow", 1, 1, 250),
        ]
        assert s.capacity == [250, 250]

    def test_small_inputs_and_the_last_layer_stay_on_the_gpu(self) -> None:
        s = ReloadSchedule(3, double_buffer=True)
        entries = [s.forward(0, 10), s.forward(1, 10, small=True), s.forward(2, 10)]
        assert [e.offloaded for _, e in entries] == [True, False, False]

    def test_stolen_prefetch_reloads_on_demand(self) -> None:
        s = ReloadSchedule(3, double_buffer=True)
        a = [s.forward(i, 10) for i in range(3)]
        b = [s.forward(i, 10) for i in range(3)]
        pa, a1 = a[1]
        s.backward(*a[2])  # prefetches pass A layer 1 into buffer 1
        s.done(a[2][1])
        s.backward(*b[2])  # prefetches pass B layer 1 into buffer 1: steals it
        s.done(b[2][1])
        del s.trace[:]
        plan = s.backward(pa, a1)
        assert [(load.entry.layer, load.slot) for load in plan.loads] == [
            (1, 1),
            (0, 0),
        ]
        assert s.trace[0] == Step("h2d", 1, 1, None)

    def test_model_run_follows_the_schedule(self) -> None:
        """The executor drives the same schedule: a real backward leaves exactly the planned trace."""
        model = _model("llama", "offload-double")
        _loss(model, _batch(LENGTHS_1, 0)).backward()
        ops = [
            (step.op, step.layer, step.slot)
            for step in model.offloader.trace
            if step.op in ("h2d", "backward")
        ]
        assert ops == [
            ("h2d", 2, 0),
            ("backward", 3, None),
            ("h2d", 1, 1),
            ("backward", 2, 0),
            ("h2d", 0, 0),
            ("backward", 1, 1),
            ("backward", 0, 0),
        ]
        hidden_numel = sum(LENGTHS_1) * COMMON["hidden_size"]
        assert model.offloader.buffer_bytes == [hidden_numel * 4, hidden_numel * 4]
        assert model.offloader.extra_gpu_bytes == hidden_numel * 4

    def test_rejects_zero_layers(self) -> None:
        with pytest.raises(ValueError, match="num_layers"):
            ReloadSchedule(0, double_buffer=True)


class TestSurface:
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
        model = _model("llama", "offload-double")
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
        model = _model("llama", "offload-double")
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


class TestEstimates:
    def test_llama_8b_at_16k_tokens(self) -> None:
        from transformers import LlamaConfig

        config = LlamaConfig(hidden_size=4096, num_hidden_layers=32)
        est = estimate(config, 16_384, torch.bfloat16)
        assert est.buffer == est.second_buffer == 16_384 * 4096 * 2 == 128 << 20
        assert (
            est.checkpointed
            == activation_bytes(config, 16_384, "bfloat16")
            == 32 * est.buffer
        )
        assert est.offloaded == 31 * est.buffer

    def test_bad_inputs_say_what_to_fix(self) -> None:
        with pytest.raises(ValueError, match="tokens: must be >= 1"):
            estimate(object(), 0, "bfloat16")
        with pytest.raises(ValueError, match="num_hidden_layers/hidden_size"):
            estimate(object(), 16, "bfloat16")
        with pytest.raises(ValueError, match="dtype 'int8'"):
            activation_bytes(
                type("C", (), {"num_hidden_layers": 2, "hidden_size": 4})(), 16, "int8"
            )

    def test_supported_needs_cuda(self) -> None:
        assert "needs a CUDA GPU" in supported("cpu", 1 << 40, 1 << 30)

    def test_double_buffer_needs_room_for_the_second_buffer(self) -> None:
        assert double_buffer_supported(8 << 30, 128 << 20) is None
        assert "second reload buffer" in double_buffer_supported(600 << 20, 128 << 20)


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
