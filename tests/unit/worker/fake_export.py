"""A stand-in for ``python -m trainer export`` (worker/exports.py's child), for the worker's unit tests.

``export JOB.json --format F --out DIR ...``: the mode is the job.json's ``model`` (written by the
test), and the argv and the child's ``CUDA_VISIBLE_DEVICES`` go to ``DIR.argv.json``.

    ok      progress through load, merge, save; writes DIR/model.safetensors; done succeeded
    fail    done failed with error_code unsupported
    crash   a traceback on stderr, exit 3 without done
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from trainer.events import Emitter  # noqa: E402

args = sys.argv[1:]
job, out = Path(args[1]), Path(args[args.index("--out") + 1])
mode = json.loads(job.read_text())["model"]
out.parent.mkdir(parents=True, exist_ok=True)
Path(str(out) + ".argv.json").write_text(json.dumps({"argv": args, "cuda": os.environ.get("CUDA_VISIBLE_DEVICES")}))
emit = Emitter(sys.stdout)
if mode == "crash":
    print("Traceback (most recent call last):\nRuntimeError: the fake export crashed", file=sys.stderr)
    sys.exit(3)
if mode == "fail":
    emit("done", status="failed", error_code="unsupported", message="format gguf: not this one", path=None, bytes=0)
    sys.exit(1)
for stage in ("load", "merge", "save"):
    emit("progress", stage=stage, fraction=0.0)
    emit("progress", stage=stage, fraction=1.0)
out.mkdir()
(out / "model.safetensors").write_bytes(b"\0" * 32)
emit("done", status="succeeded", error_code=None, message=None, path=str(out), bytes=32)
