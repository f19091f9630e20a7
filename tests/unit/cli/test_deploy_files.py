"""docker-compose.yml, Dockerfile and the CI entry: what a GPU box and CI rely on."""

from __future__ import annotations

import os
import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[3]


def _compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def _seconds(duration: str) -> float:
    match = re.fullmatch(r"(\d+)(s|m)", duration)
    assert match, f"unexpected duration {duration!r}"
    return int(match[1]) * (60 if match[2] == "m" else 1)


def test_compose_has_the_production_parts():
    services = _compose()["services"]
    assert {"postgres", "redis", "api", "worker"} <= set(services)
    api = services["api"]
    assert "ftq db upgrade && exec ftq api" in " ".join(api["command"])
    assert api["environment"]["FTQ_DATABASE_URL"].startswith("postgresql+psycopg://")
    assert api["environment"]["FTQ_BROKER_URL"].startswith("redis://redis:")


def test_one_worker_holds_every_gpu_of_the_box_as_one_pool():
    services = _compose()["services"]
    workers = {name: svc for name, svc in services.items() if name.startswith("worker")}
    assert list(workers) == ["worker"]
    svc = workers["worker"]
    (device,) = svc["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"] and device["count"] == "all"
    assert svc["command"][:4] == ["ftq", "worker", "--gpus", "all"] and "--name" in svc["command"]
    assert "CUDA_VISIBLE_DEVICES" not in svc["environment"], "the worker pins each job to its own GPUs"
    cancel_grace = float(svc["environment"]["FTQ_CANCEL_GRACE_S"])
    assert _seconds(svc["stop_grace_period"]) > cancel_grace, "docker must wait for the checkpoint"
    assert "ftq-data:/data" in svc["volumes"] and svc["init"] is True
    assert svc["shm_size"], "ranks of a multi-GPU job share memory (NCCL)"


def test_api_and_workers_share_the_data_volume():
    services = _compose()["services"]
    assert "ftq-data:/data" in services["api"]["volumes"]


def test_dockerfile_installs_every_package_it_runs():
    text = (ROOT / "Dockerfile").read_text()
    for package in ("api", "cli", "core", "migrations", "trainer", "worker"):
        assert f"COPY {package} ./{package}" in text
    assert "USER ftq" in text


def test_ci_runs_the_readme_test_command():
    run = ROOT / ".ci" / "run"
    assert os.access(run, os.X_OK)
    text = run.read_text()
    assert "set -euo pipefail" in text and re.search(r"^make test$", text, re.M)
    assert os.access(ROOT / "scripts" / "services.sh", os.X_OK)
