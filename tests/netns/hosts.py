"""Separate "hosts" on one box: Linux network namespaces joined by a bridge that lives in a
namespace of its own, so traffic flows only between them (nothing is added to the box's own
namespace: no interface, no route, no address).

    ftqn-<sid>-br   bridge br0; one veth end per host (``p-<host>``)
    ftqn-<sid>-api  eth0 10.A.B.1/24   (PostgreSQL, Redis, the API)
    ftqn-<sid>-m1   eth0 10.A.B.11/24  (worker machine 1)
    ftqn-<sid>-m2   eth0 10.A.B.12/24  (worker machine 2)

``sid`` is random per test session; the /24 is reserved by creating
``/run/ftq-netns/10.A.B`` exclusively (``mkdir``), so two sessions (pytest-xdist workers, or a
run beside an earlier one's leftovers) never share names or a subnet. Every namespace has its
``lo`` up (servers bound to 127.0.0.1 inside one work as on a box of their own).

Processes are put in a namespace by starting them from a thread that has joined it
(``inside(ns)``: ``setns(2)`` on the calling thread only, restored on exit; a child forked
from that thread is born in the namespace). The test process itself talks to the API the same
way: an HTTP client used inside ``inside(api)`` opens its sockets in the API's namespace.
Teardown ends exactly the processes found in this session's namespaces (``ip netns pids``),
then deletes the namespaces and the subnet's reservation.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import random
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

CLONE_NEWNET = 0x40000000
RESERVATIONS = Path("/run/ftq-netns")
_libc = ctypes.CDLL(None, use_errno=True)


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns(CLONE_NEWNET): {os.strerror(err)}")


@contextlib.contextmanager
def inside(netns: str) -> Iterator[None]:
    """Run the block (and every process it starts) in network namespace ``netns``; only the
    calling thread moves, and it moves back when the block ends, however it ends."""
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        target = os.open(f"/run/netns/{netns}", os.O_RDONLY)
        try:
            _setns(target)
        finally:
            os.close(target)
        try:
            yield
        finally:
            _setns(own)
    finally:
        os.close(own)


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=False)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} exited with {done.returncode}: {done.stderr.strip()}")
    return done


def cannot_make_namespaces() -> str | None:
    """Why this box cannot make network namespaces here, or None when it can."""
    if os.geteuid() != 0:
        return f"not root (euid {os.geteuid()}): `ip netns add` needs CAP_SYS_ADMIN and CAP_NET_ADMIN"
    if shutil.which("ip") is None:
        return "no `ip` command (install iproute2)"
    probe = f"ftqn-probe-{secrets.token_hex(3)}"
    done = _ip("netns", "add", probe, check=False)
    if done.returncode != 0:
        return f"`ip netns add` failed ({done.returncode}): {done.stderr.strip()}"
    try:
        bridge = _ip("-n", probe, "link", "add", "br0", "type", "bridge", check=False)
        if bridge.returncode != 0:
            return f"cannot make a bridge in a namespace: {bridge.stderr.strip()}"
    finally:
        _ip("netns", "del", probe, check=False)
    return None


@dataclass
class Hosts:
    """This session's namespaces: ``names[host]`` and ``addresses[host]`` for each host."""

    sid: str
    subnet: str
    """``10.A.B`` (the /24 without its last byte)."""
    names: dict[str, str] = field(default_factory=dict)
    addresses: dict[str, str] = field(default_factory=dict)

    @property
    def bridge(self) -> str:
        return f"ftqn-{self.sid}-br"

    def add(self, host: str, last_byte: int) -> None:
        netns, address = f"ftqn-{self.sid}-{host}", f"{self.subnet}.{last_byte}"
        _ip("netns", "add", netns)
        self.names[host], self.addresses[host] = netns, address
        _ip("-n", netns, "link", "set", "lo", "up")
        _ip("-n", self.bridge, "link", "add", f"p-{host}", "type", "veth", "peer", "name", "eth0", "netns", netns)
        _ip("-n", self.bridge, "link", "set", f"p-{host}", "master", "br0", "up")
        _ip("-n", netns, "addr", "add", f"{address}/24", "dev", "eth0")
        _ip("-n", netns, "link", "set", "eth0", "up")

    def inside(self, host: str) -> contextlib.AbstractContextManager[None]:
        return inside(self.names[host])

    def pids(self, host: str) -> list[int]:
        """The processes living in ``host``'s namespace now."""
        done = _ip("netns", "pids", self.names[host], check=False)
        return [int(p) for p in done.stdout.split()] if done.returncode == 0 else []

    def kill_all(self, host: str, sig: int = signal.SIGKILL) -> list[int]:
        """Signal every process in ``host``'s namespace (ours alone: nothing else lives there)."""
        pids = self.pids(host)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        return pids

    def link_down(self, host: str) -> None:
        _ip("-n", self.names[host], "link", "set", "eth0", "down")

    def link_up(self, host: str) -> None:
        _ip("-n", self.names[host], "link", "set", "eth0", "up")

    def empty(self, host: str, timeout_s: float = 30) -> bool:
        deadline = time.monotonic() + timeout_s
        while self.pids(host):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)
        return True

    def remove(self) -> list[str]:
        """End every process in these namespaces (TERM, then KILL), delete them; the problems."""
        problems: list[str] = []
        for host in self.names:
            self.kill_all(host, signal.SIGTERM)
        for host in self.names:
            if not self.empty(host, timeout_s=15):
                self.kill_all(host, signal.SIGKILL)
                if not self.empty(host, timeout_s=15):
                    problems.append(f"{host}: processes {self.pids(host)} outlived SIGKILL")
        for netns in [*self.names.values(), self.bridge]:
            if not Path(f"/run/netns/{netns}").exists():
                continue
            done = _ip("netns", "del", netns, check=False)
            if done.returncode != 0:
                problems.append(f"ip netns del {netns}: {done.stderr.strip()}")
        with contextlib.suppress(OSError):
            (RESERVATIONS / self.subnet / "owner").unlink()
            (RESERVATIONS / self.subnet).rmdir()
        return problems


def _reserve_subnet() -> str:
    RESERVATIONS.mkdir(parents=True, exist_ok=True)
    rng = random.SystemRandom()
    for _ in range(200):
        subnet = f"10.{rng.randrange(100, 250)}.{rng.randrange(0, 256)}"
        try:
            (RESERVATIONS / subnet).mkdir()
        except FileExistsError:
            continue
        (RESERVATIONS / subnet / "owner").write_text(f"{os.getpid()}\n")
        return subnet
    raise RuntimeError(f"no free 10.x.y.0/24 left to reserve under {RESERVATIONS}")


@contextlib.contextmanager
def make_hosts(hosts: dict[str, int]) -> Iterator[Hosts]:
    """Namespaces for ``hosts`` (name -> last byte of its address) on a fresh bridge; removed
    after the block, even when it or the set-up failed. Fails the test when the box cannot."""
    reason = cannot_make_namespaces()
    if reason is not None:
        pytest.fail(f"network namespaces cannot be made on this machine, so the multi-machine tests "
                    f"cannot run: {reason}", pytrace=False)
    made = Hosts(sid=secrets.token_hex(3), subnet=_reserve_subnet())
    try:
        _ip("netns", "add", made.bridge)
        _ip("-n", made.bridge, "link", "set", "lo", "up")
        _ip("-n", made.bridge, "link", "add", "br0", "type", "bridge")
        _ip("-n", made.bridge, "link", "set", "br0", "up")
        for host, last in hosts.items():
            made.add(host, last)
        yield made
    finally:
        problems = made.remove()
        if problems:
            raise AssertionError("the namespaces were not removed cleanly: " + "; ".join(problems))
