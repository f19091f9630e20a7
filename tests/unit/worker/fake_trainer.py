"""A stand-in for ``python -m trainer`` that the worker's unit tests drive.

``run JOB.json``: the behaviour is named by the config's ``model.name_or_path``
(``fake:<mode>[:<steps>]``), so a test picks it through the job, like a user would pick a
model. Every run appends a line to ``<output_dir>/runs.txt`` and writes its environment's
``CUDA_VISIBLE_DEVICES`` to ``<output_dir>/cuda.txt``.

    ok          plan, <steps> steps, a final checkpoint, done succeeded
    fail        plan, done failed (error_code data_error)
    crash       plan, two steps, a traceback on stderr, exit 3 without done
    sigkill     plan, then SIGKILL to itself (what the OOM killer does)
    stubborn    ignores SIGTERM; starts a grandchild (pid in grandchild.pid); steps forever
    cooperative steps forever; on SIGTERM a checkpoint and done cancelled
    silent_ok   prints nothing but noise and exits 0 (no done event)
    messy       like ok, with a step event that has no step and a log message holding a NUL
    rankkill    under torchrun: every rank starts a grandchild in a session of its own (pid in
                rank<r>-grandchild.pid) and steps; rank 1 SIGKILLs itself after its second step

Under torchrun (``RANK`` set) only rank 0 emits events, as the real trainer; each rank writes its
pid to ``rank<r>.pid`` and its ``CUDA_VISIBLE_DEVICES`` to ``cuda<r>.txt``.

``detect --json`` prints a small hardware report.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from trainer.training import layout  # noqa: E402
from trainer.events import STEP_FIELDS, Emitter  # noqa: E402

RANK = int(os.environ.get("RANK", "0"))
_emit = Emitter()


def emit(type_: str, **payload) -> None:
    if RANK == 0:
        _emit(type_, **payload)


def decision(name: str, enabled: bool, backend: str | None, reason: str) -> dict:
    return {"name": name, "requested": "auto", "enabled": enabled, "backend": backend, "reason": reason}


PLAN = {
    "device": "cpu",
    "dtype": "float32",
    "model_attention": "sdpa",
    "decisions": [
        decision("attention", True, "sdpa", "CPU: SDPA with the packed block mask"),
        decision("loss", True, "torch", "fake"),
        decision("lora_kernel", False, "peft", "CPU"),
        decision("fused_ops", False, None, "CPU"),
        decision("packed_metadata_cache", True, "sdpa", "fake"),
    ],
}
"""A plan event's ``plan.to_dict()`` part, in the agreed shape (trainer.events)."""


def step(n: int, total: int | None) -> None:
    fields = {name: None for name in STEP_FIELDS}
    fields.update(step=n, total_steps=total, epoch=n / 10, loss=5.0 - 0.1 * n, lr=1e-3, grad_norm=1.5,
                  tokens=100, sequences=4, step_ms=10.0, data_ms=1.0, forward_ms=4.0, backward_ms=4.0,
                  optimizer_ms=1.0, tokens_per_s=10000.0, host_rss=123456)
    emit("step", **fields)


def run(job_json: str) -> int:
    config = json.loads(Path(job_json).read_text())
    out = Path(config["output_dir"])
    with (out / "runs.txt").open("a") as f:
        f.write(f"{os.getpid()}\n")
    (out / "cuda.txt").write_text(os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>"))
    if "RANK" in os.environ:
        (out / f"rank{RANK}.pid").write_text(str(os.getpid()))
        (out / f"cuda{RANK}.txt").write_text(os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>"))
    _, mode, *rest = config["model"]["name_or_path"].split(":")
    steps = int(rest[0]) if rest else 3
    emit("plan", hardware={"device": "cpu"}, **PLAN, total_steps=steps,
         model={"name": "fake", "params": 1, "trainable_params": 1, "layers": 1},
         resumed_from_step=None)
    if mode == "ok":
        for n in range(1, steps + 1):
            step(n, steps)
        emit("log", level="info", message="training finished")
        emit("checkpoint", step=steps, path=str(layout.checkpoint_dir(out, steps)), bytes=42, final=True)
        emit("done", status="succeeded", error_code=None, message=None, adapter_path=str(layout.export_dir(out, "lora")),
             steps=steps)
        return 0
    if mode == "messy":
        step(1, steps)
        print(json.dumps({"type": "step"}), flush=True)
        emit("log", level="info", message="tokenizer said \u0000 here")
        for n in range(2, steps + 1):
            step(n, steps)
        emit("done", status="succeeded", error_code=None, message=None, adapter_path=str(layout.export_dir(out, "lora")),
             steps=steps)
        return 0
    if mode == "fail":
        emit("done", status="failed", error_code="data_error", message="line 3 of train.jsonl has no text",
             adapter_path=None, steps=0)
        return 1
    if mode == "crash":
        step(1, steps)
        step(2, steps)
        print("Traceback (most recent call last):", file=sys.stderr)
        print("RuntimeError: corrupt weights in model.safetensors", file=sys.stderr, flush=True)
        return 3
    if mode == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "silent_ok":
        print("not an event")
        return 0
    if mode == "stubborn":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
        (out / "grandchild.pid").write_text(str(child.pid))
        return _step_forever(steps)
    if mode == "rankkill":
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True)
        (out / f"rank{RANK}-grandchild.pid").write_text(str(child.pid))
        print(f"rank {RANK} starting", file=sys.stderr, flush=True)
        n = 0
        while True:
            n += 1
            step(n, None)
            time.sleep(0.05)
            if RANK == 1 and n == 2:
                print("rank 1: about to be killed", file=sys.stderr, flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
    if mode == "cooperative":
        stopping = []
        signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
        n = 0
        while not stopping:
            n += 1
            step(n, None)
            time.sleep(0.02)
        emit("checkpoint", step=n, path=str(layout.checkpoint_dir(out, n)), bytes=42, final=False)
        emit("done", status="cancelled", error_code=None, message="stopped at step %d" % n, adapter_path=None,
             steps=n)
        return 0
    raise SystemExit(f"fake trainer: unknown mode {mode!r}")


def _step_forever(total: int) -> int:
    n = 0
    while True:
        n += 1
        step(n, None)
        time.sleep(0.02)


def main() -> int:
    if sys.argv[1:3] == ["detect", "--json"]:
        print(json.dumps({"hardware": {"device": "cpu", "name": "fake"}, "plan": PLAN}))
        return 0
    if sys.argv[1] == "run":
        return run(sys.argv[2])
    raise SystemExit(f"fake trainer: unknown command {sys.argv[1:]}")


if __name__ == "__main__":
    sys.exit(main())
