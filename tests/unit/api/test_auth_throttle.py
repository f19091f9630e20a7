"""api/auth_throttle.py: failures counted per bucket (a stored key's id, or an address), each
bucket locked on its own past the limit until its oldest failure leaves the window; a fake clock,
so nothing waits."""

from __future__ import annotations

import logging

import pytest

from api.auth_throttle import FailedKeyThrottle, by_address, by_key


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def fail(throttle: FailedKeyThrottle, bucket: str, n: int = 1, key_id: str | None = None) -> None:
    for _ in range(n):
        throttle.record_failure(bucket, address="10.0.0.1", path="/v1/jobs", key_id=key_id, reason="bad key")


def test_a_bucket_locks_at_the_limit_and_opens_when_its_oldest_failure_leaves_the_window() -> None:
    clock = Clock()
    throttle = FailedKeyThrottle(limit=3, window_s=60.0, clock=clock)
    fail(throttle, by_key("ftq_0123abcd"), 2)
    assert throttle.retry_after(by_key("ftq_0123abcd")) is None
    clock.now += 10
    fail(throttle, by_key("ftq_0123abcd"))
    assert throttle.retry_after(by_key("ftq_0123abcd")) == 50  # the first two leave at +60
    clock.now += 50
    assert throttle.retry_after(by_key("ftq_0123abcd")) is None


def test_buckets_are_separate_keys_from_addresses_and_from_each_other() -> None:
    throttle = FailedKeyThrottle(limit=2, clock=Clock())
    fail(throttle, by_key("ftq_0123abcd"), 5)
    fail(throttle, by_address("10.0.0.1"), 5)
    assert throttle.retry_after(by_key("ftq_0123abcd")) is not None
    assert throttle.retry_after(by_address("10.0.0.1")) is not None
    assert throttle.retry_after(by_key("ftq_99999999")) is None
    assert throttle.retry_after(by_key("ftqw_0123abcd")) is None  # a worker key's id is another key
    assert throttle.retry_after(by_address("10.0.0.2")) is None


def test_a_limit_of_zero_never_locks() -> None:
    throttle = FailedKeyThrottle(limit=0, clock=Clock())
    fail(throttle, by_address("10.0.0.1"), 100)
    assert throttle.retry_after(by_address("10.0.0.1")) is None


def test_memory_is_bounded_dropping_the_least_recently_failing_bucket() -> None:
    throttle = FailedKeyThrottle(limit=1, max_buckets=2, clock=Clock())
    fail(throttle, by_address("a"))
    fail(throttle, by_address("b"))
    fail(throttle, by_address("a"))
    fail(throttle, by_address("c"))
    assert throttle.retry_after(by_address("b")) is None
    assert throttle.retry_after(by_address("a")) is not None and throttle.retry_after(by_address("c")) is not None


def test_each_failure_is_logged_with_address_key_id_and_bucket(caplog: pytest.LogCaptureFixture) -> None:
    throttle = FailedKeyThrottle(limit=5, clock=Clock())
    with caplog.at_level(logging.WARNING, logger="api.auth"):
        fail(throttle, by_key("ftq_0123abcd"), 2, key_id="ftq_0123abcd")
    assert [r.getMessage() for r in caplog.records][-1] == (
        "failed API key from 10.0.0.1 on /v1/jobs (key ftq_0123abcd; 2 in the last 60 s for key ftq_0123abcd): "
        "bad key")
