"""The reload schedule of offloaded checkpointing (trainer/features/offload/schedule.py), by hand.

``ReloadSchedule`` is plain Python: these tests drive it without a model and compare its trace
with the algorithm in ``trainer/features/offload/offloader.py``'s docstring; one test checks that a real
backward through ``ActivationOffloader`` leaves exactly the planned trace.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
from offload_helpers import COMMON, LENGTHS_1, loss_of, make_batch, make_model

from trainer.features.offload import ReloadSchedule, Step

SCHEDULE_PY = Path(__file__).resolve().parents[5] / "trainer" / "features" / "offload" / "schedule.py"

pytestmark = [
    pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"),
    pytest.mark.usefixtures("one_thread"),
]


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
        model = make_model("llama", "offload-double")
        loss_of(model, make_batch(LENGTHS_1, 0)).backward()
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


class TestStandardLibraryOnly:
    def test_schedule_imports_only_the_standard_library(self) -> None:
        tree = ast.parse(SCHEDULE_PY.read_text())
        modules = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        modules |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level == 0}
        top = {name.split(".")[0] for name in modules}
        assert top, "schedule.py imports nothing: the parse went wrong"
        assert top <= set(sys.stdlib_module_names) | {"__future__"}, sorted(top - set(sys.stdlib_module_names))

    def test_schedule_runs_with_torch_blocked(self) -> None:
        """Loaded by path (not through ``trainer.features.offload``, whose offloader needs torch) with torch unimportable."""
        code = (
            "import importlib.util, sys\n"
            "sys.modules['torch'] = None\n"
            f"spec = importlib.util.spec_from_file_location('schedule', {str(SCHEDULE_PY)!r})\n"
            "module = importlib.util.module_from_spec(spec)\n"
            "sys.modules['schedule'] = module\n"
            "spec.loader.exec_module(module)\n"
            "s = module.ReloadSchedule(2, double_buffer=True)\n"
            "p, e = s.forward(0, 8)\n"
            "s.forward(1, 8)\n"
            "print(s.trace[0].op, e.offloaded)\n"
        )
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
        assert result.returncode == 0, result.stderr
        assert result.stdout.split() == ["offload", "True"]
