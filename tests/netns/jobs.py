"""What the multi-machine tests do through the user API (plain helpers; ``client`` is one from
``Cluster.client()``, so it is used inside the API host's namespace)."""

from __future__ import annotations

import io
import json
import time
import zipfile
from pathlib import Path
from typing import Any

import httpx

FINISHED = ("succeeded", "failed", "cancelled")
TINY = {"max_steps": 6, "batch_tokens": 512, "max_seq_len": 128, "learning_rate": 0.01, "warmup_steps": 1}


def upload(client: httpx.Client, path: Path) -> str:
    with path.open("rb") as f:
        response = client.post("/v1/files", files={"file": (path.name, f, "application/jsonl")},
                               data={"purpose": "train"})
    assert response.status_code == 201, response.text
    return response.json()["id"]


def submit(client: httpx.Client, file_id: str, model: str, **fields: Any) -> dict[str, Any]:
    body = {"model": model, "training_file": file_id, "hyperparameters": TINY, **fields}
    response = client.post("/v1/jobs", json=body)
    assert response.status_code == 201, response.text
    return response.json()


def wait_job(client: httpx.Client, job_id: str, predicate, *, what: str, timeout_s: float = 300,
             logs: Any = None) -> dict[str, Any]:
    """Poll the job until ``predicate(job)``; ``logs()`` (the cluster's log tail) in the failure."""
    deadline = time.monotonic() + timeout_s
    job: dict[str, Any] = {}
    while time.monotonic() < deadline:
        job = client.get(f"/v1/jobs/{job_id}").json()
        if predicate(job):
            return job
        time.sleep(0.3)
    raise AssertionError(f"job {job_id} never {what} in {timeout_s:.0f}s; last seen {json.dumps(job)[:2000]}\n"
                         f"{logs() if logs else ''}")


def finished(client: httpx.Client, job_id: str, *, timeout_s: float = 400, logs: Any = None) -> dict[str, Any]:
    return wait_job(client, job_id, lambda j: j["status"] in FINISHED, what="finished", timeout_s=timeout_s,
                    logs=logs)


def metrics(client: httpx.Client, job_id: str) -> list[dict[str, Any]]:
    response = client.get(f"/v1/jobs/{job_id}/metrics", params={"limit": 1000})
    assert response.status_code == 200, response.text
    return response.json()["data"]


def events(client: httpx.Client, job_id: str) -> list[tuple[str, dict[str, Any]]]:
    """A finished job's events as (type, data), from its SSE stream (which ends after the final state)."""
    text = client.get(f"/v1/jobs/{job_id}/events", timeout=60).text
    out = []
    for block in text.split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line and not line.startswith(":"))
        if "event" in fields and "data" in fields:
            out.append((fields["event"], json.loads(fields["data"])))
    return out


def checkpoint_steps(client: httpx.Client, job_id: str) -> list[int]:
    response = client.get(f"/v1/jobs/{job_id}/checkpoints")
    assert response.status_code == 200, response.text
    return sorted(c["step"] for c in response.json()["data"])


def zip_files(client: httpx.Client, url: str) -> dict[str, bytes]:
    """The members of a zip archive the API serves at ``url`` (an adapter, a checkpoint)."""
    response = client.get(url, params={"format": "zip"}, timeout=120)
    assert response.status_code == 200, f"GET {url}: {response.status_code} {response.text[:500]}"
    with zipfile.ZipFile(io.BytesIO(response.content)) as archive:
        return {name: archive.read(name) for name in archive.namelist() if not name.endswith("/")}


def same_adapter(local: Path, downloaded: dict[str, bytes]) -> list[str]:
    """How the downloaded adapter differs from the directory the machine trained into; the API
    rewrites only README.md (the card) and adapter_config.json's base_model_name_or_path."""
    problems = []
    files = {str(p.relative_to(local)): p.read_bytes() for p in local.rglob("*") if p.is_file()}
    if not any(name.endswith(".safetensors") for name in files):
        problems.append(f"no weights in {local}: {sorted(files)}")
    for name, data in files.items():
        if name == "README.md":
            continue
        if name not in downloaded:
            problems.append(f"{name} is not in the download")
        elif name == "adapter_config.json":
            ours, theirs = json.loads(data), json.loads(downloaded[name])
            ours.pop("base_model_name_or_path", None), theirs.pop("base_model_name_or_path", None)
            if ours != theirs:
                problems.append("adapter_config.json differs beyond base_model_name_or_path")
        elif data != downloaded[name]:
            problems.append(f"{name}: the download's bytes differ from the machine's")
    return problems
