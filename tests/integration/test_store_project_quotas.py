"""Per-project GPU quota and priority ceiling on the real stores (``core.jobs.scheduling``,
``core.jobs.placement``), beside the per-user cap: what the claims start, what submission refuses."""

from __future__ import annotations

import pytest

from core.errors import InvalidInput, Unsupported
from core.jobs import scheduling
from core.projects import service as projects
from tests.fixtures.scheduling import add_job, add_user, claim_all, runtime_for, status_of

pytestmark = pytest.mark.integration


def add_project(store, name: str, *, max_gpus: int | None = None, max_priority: str | None = None) -> str:
    with store.sessions.begin() as session:
        return projects.create_project(session, name, max_gpus=max_gpus, max_priority=max_priority).project_id


@pytest.fixture
def no_user_cap(sched_settings):
    return sched_settings.model_copy(update={"max_running_jobs_per_user": 0})


class TestGpuQuota:
    def test_a_project_holds_at_most_its_quota_while_another_projects_jobs_run(self, store, no_user_cap) -> None:
        small, other = add_project(store, "small", max_gpus=2), add_project(store, "other")
        alice, bob = add_user(store, "alice"), add_user(store, "bob")
        first = add_job(store, owner=alice, project_id=small, age_s=0)
        second = add_job(store, owner=bob, project_id=small, age_s=1)  # another user: still the project's quota
        third = add_job(store, owner=alice, project_id=small, age_s=2)
        outside = add_job(store, owner=bob, project_id=other, gpus=4, age_s=3)
        assert claim_all(store, no_user_cap, slots=8) == [first, second, outside]
        assert status_of(store, third) == "queued"

    def test_running_jobs_count_against_the_quota(self, store, no_user_cap) -> None:
        team = add_project(store, "team", max_gpus=3)
        add_job(store, project_id=team, status="running", gpus=2)
        too_many = add_job(store, project_id=team, gpus=2, age_s=1)
        fits = add_job(store, project_id=team, gpus=1, age_s=2, priority="low")
        assert claim_all(store, no_user_cap, slots=8) == []  # the 2-GPU job waits and holds its project back
        assert status_of(store, too_many) == status_of(store, fits) == "queued"

    def test_a_quota_of_zero_starts_nothing_and_no_quota_starts_everything(self, store, no_user_cap) -> None:
        stopped, free = add_project(store, "stopped", max_gpus=0), add_project(store, "free")
        held = add_job(store, project_id=stopped, age_s=0)
        runs = [add_job(store, project_id=free, gpus=2, age_s=s) for s in (1, 2, 3)]
        assert claim_all(store, no_user_cap, slots=6) == runs
        assert status_of(store, held) == "queued"

    def test_the_per_user_cap_still_applies_inside_a_project(self, store, sched_settings) -> None:
        team = add_project(store, "team", max_gpus=8)
        alice = add_user(store, "alice")  # the settings' cap: 1 running GPU per user
        first, second = add_job(store, owner=alice, project_id=team), add_job(store, owner=alice, project_id=team, age_s=1)
        assert claim_all(store, sched_settings, slots=4) == [first]
        assert status_of(store, second) == "queued"

    def test_a_claim_checks_the_quota_itself(self, store, no_user_cap) -> None:
        """The store's conditional UPDATE holds the quota even for a placement computed before a job started."""
        team = add_project(store, "team", max_gpus=1)
        first, second = add_job(store, project_id=team), add_job(store, project_id=team, age_s=1)
        runtime_for(store, no_user_cap, "w", slots=2).ensure_registered()
        with store.sessions() as session:
            [placed] = scheduling.schedule(session, no_user_cap).placements
        assert placed.job_id == first
        with store.sessions() as session:
            assert scheduling.try_claim(session, placed, no_user_cap)
            session.commit()
        stale = scheduling.Placement(second, "w", (1,))
        with store.sessions() as session:
            assert not scheduling.try_claim(session, stale, no_user_cap)
            session.rollback()
        assert status_of(store, second) == "queued"


class TestPriorityCeiling:
    def test_a_job_is_ordered_at_no_more_than_its_projects_ceiling(self, store, no_user_cap) -> None:
        capped, free = add_project(store, "capped", max_priority="low"), add_project(store, "free")
        lowered = add_job(store, project_id=capped, priority="high", age_s=0)  # queued before the ceiling fell
        normal = add_job(store, project_id=free, priority="normal", age_s=1)
        low = add_job(store, project_id=free, priority="low", age_s=2)
        assert claim_all(store, no_user_cap, slots=1)[:1] == [normal]
        assert claim_all(store, no_user_cap.model_copy(), slots=3) == [lowered, low]


class TestSubmission:
    def test_more_gpus_than_the_quota_or_a_priority_over_the_ceiling_is_refused(self, store) -> None:
        team = add_project(store, "team", max_gpus=2, max_priority="normal")
        with store.sessions() as session:
            with pytest.raises(Unsupported, match=r"gpus: 4 is more than project 'team' may hold at once \(2 GPUs"):
                scheduling.check_project(session, team, 4, "normal")
            with pytest.raises(InvalidInput, match="priority: 'high' is above project 'team''s ceiling 'normal'; "
                               "use normal or low") as info:
                scheduling.check_project(session, team, 1, "high")
            assert info.value.param == "priority"
            scheduling.check_project(session, team, 2, "normal")
            scheduling.check_project(session, None, 64, "high")
