"""Start estimates replay the project GPU quota as the claims apply it (core/jobs/eta.py over
core/jobs/placement.py): a project's second job waits for its first one to end."""

from __future__ import annotations

import datetime as dt

from core.jobs.eta import Busy, replay_starts
from core.jobs.placement import Waiting

T0 = dt.datetime(2026, 11, 1, tzinfo=dt.UTC)


def waiting(job_id: str, project: str, age: int) -> Waiting:
    return Waiting(job_id, f"user-{job_id}", "normal", 1, "tiny", 10, T0 + dt.timedelta(seconds=age), project_id=project)


def test_a_projects_jobs_start_one_after_another_under_a_quota_of_one() -> None:
    jobs = [waiting("a1", "p", 0), waiting("a2", "p", 1), waiting("b1", "q", 2)]
    durations = {"a1": 100.0, "a2": 100.0, "b1": 100.0}
    hosts = {"w": (0, 1, 2, 3)}
    assert replay_starts(hosts, [], jobs, {}, durations) == {"a1": 0.0, "a2": 0.0, "b1": 0.0}
    assert replay_starts(hosts, [], jobs, {}, durations, quota_caps={"p": 1}) == {"a1": 0.0, "a2": 100.0, "b1": 0.0}


def test_a_running_job_counts_against_its_projects_quota() -> None:
    running = [Busy("user-x", 30.0, 1, "w", (0,), project_id="p")]
    starts = replay_starts({"w": (0, 1)}, running, [waiting("a1", "p", 0)], {}, {"a1": 10.0}, quota_caps={"p": 1})
    assert starts == {"a1": 30.0}
