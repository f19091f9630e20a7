"""The multi-machine harness itself (hosts.py): hosts reach each other and nothing else, and
nothing of them is left after the block, even when it fails."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.netns.hosts import inside, make_hosts

pytestmark = [pytest.mark.integration, pytest.mark.netns]


def _listen(hosts, host: str) -> tuple[socket.socket, int]:
    """A listening socket on ``host`` (the kernel completes connections into its backlog)."""
    with hosts.inside(host):
        server = socket.create_server((hosts.addresses[host], 0))
    return server, server.getsockname()[1]


def _reaches(address: str, port: int) -> bool:
    try:
        with socket.create_connection((address, port), timeout=1):
            return True
    except OSError:
        return False


def test_hosts_reach_each_other_only_and_leave_nothing_behind():
    with make_hosts({"api": 1, "m1": 11, "m2": 12}) as hosts:
        names = dict(hosts.names)
        server, port = _listen(hosts, "api")
        for host in ("m1", "m2"):
            with hosts.inside(host):
                assert _reaches(hosts.addresses["api"], port), f"{host} cannot reach the API host"
                loopback = subprocess.run(["ip", "-o", "link", "show", "lo"], capture_output=True, text=True)
                assert "UP" in loopback.stdout, loopback.stdout
        assert not _reaches(hosts.addresses["api"], port), "the box's own namespace reaches a host: not isolated"
        hosts.link_down("m1")
        with hosts.inside("m1"):
            assert not _reaches(hosts.addresses["api"], port), "a host whose link is down still reaches the API"
        with hosts.inside("m2"):
            sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        assert hosts.pids("m2") == [sleeper.pid]
        server.close()
    assert sleeper.wait(timeout=30) in (-15, -9), "the process in the namespace was not ended"
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(name in listed for name in names.values()), listed
    assert not (Path("/run/ftq-netns") / hosts.subnet).exists()


def test_a_failure_inside_still_removes_everything():
    with pytest.raises(RuntimeError, match="boom"), make_hosts({"a": 1, "b": 2}) as hosts:
        with hosts.inside("a"):
            sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        raise RuntimeError("boom")
    assert sleeper.wait(timeout=30) in (-15, -9), "the process in the namespace was not ended"
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert hosts.sid not in listed, listed


def test_the_calling_thread_returns_to_its_own_namespace():
    own = Path("/proc/thread-self/ns/net").readlink()
    with make_hosts({"a": 1}) as hosts:
        with pytest.raises(ValueError), inside(hosts.names["a"]):
            assert Path("/proc/thread-self/ns/net").readlink() != own
            raise ValueError
        assert Path("/proc/thread-self/ns/net").readlink() == own


def test_a_box_that_cannot_make_namespaces_fails_the_test_saying_why(monkeypatch):
    monkeypatch.setattr("os.geteuid", lambda: 1000)
    with pytest.raises(pytest.fail.Exception, match=r"network namespaces cannot be made .* not root \(euid 1000\)"):
        with make_hosts({"a": 1}):
            raise AssertionError("the block must not run")
    monkeypatch.setattr("os.geteuid", lambda: 0)
    monkeypatch.setattr("shutil.which", lambda name: None)
    with pytest.raises(pytest.fail.Exception, match="install iproute2"):
        with make_hosts({"a": 1}):
            raise AssertionError("the block must not run")
