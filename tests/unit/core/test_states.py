"""core.jobs.states: the transition table as data."""

from __future__ import annotations

from core.jobs.states import (
    ACTIVE_STATUSES,
    ALLOWED_TRANSITIONS,
    CANCELABLE_STATUSES,
    FINISHED_STATUSES,
    JobStatus,
    sources_of,
)


def test_finished_states_are_terminal() -> None:
    for status in FINISHED_STATUSES:
        assert ALLOWED_TRANSITIONS[status] == frozenset()


def test_sources_follow_the_diagram() -> None:
    assert sources_of(JobStatus.running) == {JobStatus.queued}
    assert sources_of(JobStatus.cancelled) == {JobStatus.queued, JobStatus.running}
    assert sources_of(JobStatus.succeeded) == {JobStatus.running}
    assert sources_of(JobStatus.queued) == {JobStatus.running}
    assert sources_of(JobStatus.failed) == {JobStatus.queued, JobStatus.running}


def test_groups_partition_the_states() -> None:
    assert ACTIVE_STATUSES | FINISHED_STATUSES == set(JobStatus)
    assert not ACTIVE_STATUSES & FINISHED_STATUSES
    assert CANCELABLE_STATUSES == ACTIVE_STATUSES
