"""Slow down repeated failed API-key attempts from one address, and log every one.

Keys carry 256 random bits, so guessing one is hopeless; this is hygiene, not the lock: an
operator sees who is trying (address, key prefix, never the secret) in the log, and a client
that keeps failing is answered 429 with ``Retry-After`` instead of a fresh key check (each check
is a store query and a hash).

Per address, the failures of the last ``window_s`` seconds are kept; past ``limit`` of them,
requests from that address are refused until the oldest one leaves the window. A success
does not clear the count: a caller with one good key and a stream of bad ones still pays for
the bad ones. Memory is bounded: at most ``max_addresses`` are tracked, the least recently
failing is dropped first. State is per API process (each uvicorn worker counts on its own).
"""

from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable

log = logging.getLogger("api.auth")


class FailedKeyThrottle:
    def __init__(
        self,
        limit: int = 20,
        window_s: float = 60.0,
        *,
        max_addresses: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.limit = limit
        self.window_s = window_s
        self.max_addresses = max_addresses
        self._clock = clock
        self._failures: OrderedDict[str, deque[float]] = OrderedDict()

    def retry_after(self, address: str) -> int | None:
        """Seconds ``address`` must wait before its next attempt, or None if it may try now."""
        if self.limit <= 0:
            return None
        times = self._recent(address)
        if times is None or len(times) < self.limit:
            return None
        return max(1, math.ceil(times[0] + self.window_s - self._clock()))

    def record_failure(self, address: str, *, path: str, prefix: str | None, reason: str) -> None:
        times = self._recent(address)
        if times is None:
            times = self._failures[address] = deque()
        times.append(self._clock())
        self._failures.move_to_end(address)
        while len(times) > max(self.limit, 1):
            times.popleft()
        while len(self._failures) > self.max_addresses:
            self._failures.popitem(last=False)
        log.warning(
            "failed API key from %s on %s (key prefix %s, %d in the last %.0f s): %s",
            address, path, prefix or "-", len(times), self.window_s, reason,
        )

    def _recent(self, address: str) -> deque[float] | None:
        times = self._failures.get(address)
        if times is None:
            return None
        horizon = self._clock() - self.window_s
        while times and times[0] <= horizon:
            times.popleft()
        if not times:
            del self._failures[address]
            return None
        return times
