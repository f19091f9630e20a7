"""Fixtures of the multi-machine tests: ``cluster``, one deployment for the session over three
network namespaces (cluster.py, hosts.py); each test brings the machines up as it needs them
(``Cluster.ensure_up``, or a restart with other settings). The tiny model and dataset they train
on are ``tiny_llama`` and ``chat_dataset`` (tests/fixtures/training_inputs.py); each machine gets its own copy of the model.

These tests need root (``ip netns add``): where namespaces cannot be made they FAIL saying why,
never skip, so a CI box that cannot run them is noticed."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.netns.cluster import Cluster
from tests.netns.hosts import make_hosts

HOSTS = {"api": 1, "m1": 11, "m2": 12}


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


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path) -> Iterator[Cluster]:
    yield from start_cluster(tmp_path_factory.mktemp("netns"), tiny_llama, proxied=("m2",))
