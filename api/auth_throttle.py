"""Slow down repeated failed API-key attempts, per key where the key is known, and log every one.

Keys carry 256 random bits, so guessing one is hopeless; this is hygiene, not the lock: an
operator sees who is trying (address, key id, never the secret) in the log, and a client that
keeps failing is answered 429 with ``Retry-After`` instead of a fresh key check (each check is a
store query and a hash).

Failures are counted in buckets, and ``api.auth.AuthGate`` picks the bucket:

- ``by_key(key_id)``: a key the store has (``ftq_<prefix>``, a worker key's ``ftqw_<prefix>``)
  refused for its secret, its revocation or its disabled user. Past the limit that id answers 429
  before any check, even with the right secret, until its oldest failure leaves the window: a
  guesser of one key's secret learns nothing during the lock, and the script that keeps sending a
  revoked key keeps getting 429. Someone who knows a key's id (it is in this log; only its owner
  and admins can list it) can hold that key at 429 this way; a new key has a new id.
- ``by_address(address)``: everything else that failed, with no key id the store knows (an
  unknown id, a malformed key, none at all). Past the limit that address gets 429 for such
  requests only.

A request with a valid key is never refused for other keys' failures: its own id's bucket is
the only one consulted before its check, and the address's only after a check that failed with
no known id. So a team behind one NAT or proxy, or the dashboard and CLI on the box itself, keep
working while one script there fails. A success clears nothing: one good key and a stream of bad
ones from the same place still pay for the bad ones. Memory is bounded: at most ``max_buckets``
are tracked (known ids are as many as the store's keys), the least recently failing dropped
first. State is per API process (each uvicorn worker counts on its own).
"""

from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable

log = logging.getLogger("api.auth")


def by_key(key_id: str) -> str:
    """The bucket of a stored key's failures (``key_id``: ``ftq_<prefix>`` or ``ftqw_<prefix>``)."""
    return f"key {key_id}"


def by_address(address: str) -> str:
    """The bucket of an address's failures that named no stored key."""
    return f"address {address}"


class FailedKeyThrottle:
    """Failures per bucket (``by_key``/``by_address``) over the last ``window_s`` seconds; a
    bucket with ``limit`` of them is locked until its oldest leaves the window. ``limit`` 0: off."""

    def __init__(
        self,
        limit: int = 20,
        window_s: float = 60.0,
        *,
        max_buckets: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.limit = limit
        self.window_s = window_s
        self.max_buckets = max_buckets
        self._clock = clock
        self._failures: OrderedDict[str, deque[float]] = OrderedDict()

    def retry_after(self, bucket: str) -> int | None:
        """Seconds ``bucket`` must wait before its next attempt, or None if it may try now."""
        if self.limit <= 0:
            return None
        times = self._recent(bucket)
        if times is None or len(times) < self.limit:
            return None
        return max(1, math.ceil(times[0] + self.window_s - self._clock()))

    def record_failure(self, bucket: str, *, address: str, path: str, key_id: str | None, reason: str) -> None:
        """Count one failure against ``bucket`` and log it (``key_id``: the public id the request
        tried, known or not; never the secret)."""
        times = self._recent(bucket)
        if times is None:
            times = self._failures[bucket] = deque()
        times.append(self._clock())
        self._failures.move_to_end(bucket)
        while len(times) > max(self.limit, 1):
            times.popleft()
        while len(self._failures) > self.max_buckets:
            self._failures.popitem(last=False)
        log.warning(
            "failed API key from %s on %s (key %s; %d in the last %.0f s for %s): %s",
            address, path, key_id or "-", len(times), self.window_s, bucket, reason,
        )

    def _recent(self, bucket: str) -> deque[float] | None:
        times = self._failures.get(bucket)
        if times is None:
            return None
        horizon = self._clock() - self.window_s
        while times and times[0] <= horizon:
            times.popleft()
        if not times:
            del self._failures[bucket]
            return None
        return times
