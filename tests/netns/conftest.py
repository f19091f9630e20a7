"""Fixtures of the multi-machine tests: ``cluster``, one deployment per module over three network
namespaces (cluster.py, hosts.py), and the tiny model and dataset they train on.

These tests need root (``ip netns add``): where namespaces cannot be made they FAIL saying why,
never skip, so a CI box that cannot run them is noticed."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.e2e.stack import MODEL
from tests.netns.cluster import Cluster
from tests.netns.hosts import make_hosts

WORDS = "the cat sat on a mat and the dog ran in the park while birds sang songs of spring".split()
HOSTS = {"api": 1, "m1": 11, "m2": 12}


@pytest.fixture(scope="session")
def netns_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight Llama: each machine gets its own copy."""
    path = tmp_path_factory.mktemp("netns-model") / MODEL
    subprocess.run([sys.executable, "-m", "trainer", "make-tiny-model", str(path), "--arch", "llama"],
                   check=True, capture_output=True, timeout=300)
    return path


@pytest.fixture(scope="session")
def netns_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("netns-data") / "train.jsonl"
    with path.open("w") as f:
        for _ in range(64):
            messages = [{"role": "user", "content": " ".join(rng.choices(WORDS, k=6))},
                        {"role": "assistant", "content": " ".join(rng.choices(WORDS[:8], k=12))}]
            f.write(json.dumps({"messages": messages}) + "\n")
    return path


def start_cluster(base: Path, model: Path, *, keys: bool = True, proxied: tuple[str, ...] = ()) -> Iterator[Cluster]:
    """The API host and two worker machines; ``keys``: remote workers with a worker key each
    (False: workers without one, to check the harness before worker keys exist); ``proxied``:
    machines whose FTQ_API_URL goes through the corrupting proxy (proxy.py) on the API host."""
    with make_hosts(HOSTS) as hosts:
        cluster = Cluster(hosts, base)
        try:
            cluster.start_api_host(model)
            if keys:
                cluster.worker_keys = {name: cluster.create_worker_key(name) for name in ("m1", "m2")}
            if proxied:
                cluster.start_proxy()
            for name in ("m1", "m2"):
                cluster.add_machine(name, model, api_url=cluster.proxy_url if name in proxied else None)
                cluster.start_worker(name)
            cluster.wait_workers(["m1", "m2"])
            yield cluster
        finally:
            cluster.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, netns_model: Path) -> Iterator[Cluster]:
    yield from start_cluster(tmp_path_factory.mktemp("netns"), netns_model, proxied=("m2",))
