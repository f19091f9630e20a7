"""Run ``scripts/api_load.py`` against a stack of its own, so the figures are comparable run to run:
a throwaway PostgreSQL and Redis (``tests/faults/services.py``: initdb into tmp, free ports), a
tiny random-weight Llama, ``ftq api`` and, with ``--worker``, ``ftq worker`` training one long
tiny job whose step time is compared idle vs under load. Everything it started is stopped at
the end; the machine's own servers are not touched.

    .venv/bin/python scripts/api_load_stack.py [--worker] [--spy] [--pin] [api_load.py options...]

``--spy`` records the API process with py-spy (``pip install py-spy``) during the run into
``/tmp/api_spy.txt`` (collapsed stacks). Run from the repository root. ``--pin`` keeps the API off
the trainer's core, as ``FTQ_CPUS`` does in production (core/affinity.py): this script, and with it
PostgreSQL, Redis, the API and the load client, run on core 0; the worker and its trainer get
``FTQ_CPUS=1`` (the last core, on a box with more).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from tests.faults.services import ThrowawayPostgres, ThrowawayRedis, free_port  # noqa: E402
from tests.fixtures.stack import MODEL, STACK_ENV, Stack  # noqa: E402

DATA = '{"messages": [{"role": "user", "content": "a b c"}, {"role": "assistant", "content": "d e f g"}]}\n' * 32


def start_training(stack: Stack) -> str:
    """A long tiny job on the worker, past its third step; its id."""
    with stack.client() as client:
        file_id = client.post("/v1/files", files={"file": ("t.jsonl", DATA)}, data={"purpose": "train"}).json()["id"]
        job = client.post("/v1/jobs", json={"model": MODEL, "training_file": file_id, "priority": "high",
                                            "hyperparameters": {"max_steps": 100000, "batch_tokens": 512,
                                                                "max_seq_len": 128}}).json()
        for _ in range(600):
            if client.get(f"/v1/jobs/{job['id']}").json()["progress"]["step"] >= 3:
                return job["id"]
            time.sleep(0.5)
    raise RuntimeError(f"job {job['id']} did not start training\n{stack.log_tail()}")


def main() -> None:
    with_worker, with_spy, pin = "--worker" in sys.argv, "--spy" in sys.argv, "--pin" in sys.argv
    args = [a for a in sys.argv[1:] if a not in ("--worker", "--spy", "--pin")]
    trainer_core = max(os.sched_getaffinity(0))
    if pin:
        os.sched_setaffinity(0, {0})  # inherited by every process started below but the worker
    base = Path(tempfile.mkdtemp(prefix="ftq-load-"))
    subprocess.run([sys.executable, "-m", "trainer", "make-tiny-model", str(base / "models" / MODEL), "--arch", "llama"],
                   check=True, capture_output=True)
    pg, redis = ThrowawayPostgres(base / "pg"), ThrowawayRedis(base / "redis")
    stack = Stack("load", f"http://127.0.0.1:{free_port()}", base / "data", base / "models")
    env = {k: v for k, v in os.environ.items() if not k.startswith("FTQ_")}
    env.update(STACK_ENV, FTQ_DATA_DIR=str(stack.data_dir), FTQ_MODEL_ROOT=str(stack.model_root),
               FTQ_CONFIG=str(base / "client.toml"), FTQ_DATABASE_URL=pg.url, FTQ_BROKER_URL=redis.url,
               FTQ_REDIS_URL=redis.url, FTQ_PORT=stack.url.rsplit(":", 1)[1], FTQ_AUTH_FAILURE_LIMIT="0")
    stack.env = env
    job = None
    try:
        pg.start()
        redis.start()
        subprocess.run([sys.executable, "-m", "cli", "db", "upgrade"], env=env, check=True, capture_output=True)
        stack.api_key = stack.create_user("load", "--admin")
        stack.start("api", [sys.executable, "-m", "cli", "api"], env)
        if with_worker:
            worker_env = {**env, "FTQ_CPUS": str(trainer_core)} if pin else env
            stack.start("worker", [sys.executable, "-m", "cli", "worker", "--name", "load"], worker_env)
            stack.wait_ready()
            job = start_training(stack)
        else:
            while True:
                try:
                    if httpx.get(f"{stack.url}/healthz").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.3)
        spy = None
        if with_spy:
            spy = subprocess.Popen([str(ROOT / ".venv/bin/py-spy"), "record", "-p", str(stack.procs["api"].pid),
                                    "-d", "60", "-r", "50", "--format", "raw", "-o", "/tmp/api_spy.txt", "--nonblocking"])
        watch = ["--watch", job] if job else []
        subprocess.run([sys.executable, str(ROOT / "scripts/api_load.py"), "--url", stack.url, "--key", stack.api_key,
                        "--model", MODEL, *watch, *args], check=False)
        if spy is not None:
            spy.wait()
        if job:
            with stack.client() as client:
                client.post(f"/v1/jobs/{job}/cancel")
    finally:
        stack.stop()
        redis.stop()
        pg.stop()


if __name__ == "__main__":
    main()
