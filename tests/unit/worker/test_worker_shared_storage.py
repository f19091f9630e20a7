"""Shared checkpoint storage (``FTQ_SHARED_DIR``, worker/shared_storage.py) over a SQLite store:
the marker's id, what a worker publishes, the leader's claim of a full fine-tuning job over two
machines of one storage (its ``shared_home``, job.json's ``shared_checkpoint_dir``), the refusal at
submission when no storage has enough machines, a remote worker recording shared checkpoints
without uploading them, a retry on fewer machines (its one machine's ``job_node`` row, a later loss
judged on it) and a retry kept on the storage that holds its checkpoints (waiting, saying so once)."""

from __future__ import annotations

import queue
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from core.db import utcnow
from core.errors import Unsupported
from core.jobs.models import Job
from core.jobs.scheduling import check_gpus
from core.jobs.states import JobStatus
from core.settings import Settings
from core.workers.models import Worker
from core.workers.pool import register_pool
from tests.fixtures.worker_runtime import queued_job, recording_runtime
from trainer.config import DataConfig, ModelConfig, OptimConfig, TrainConfig
from worker import shared_storage
from worker.claim import Claim
from worker.prepare import with_shared_home
from worker.remote import RemoteOutputs
from worker.runner import claim_next_job
from worker.runtime import Runtime

LEADER, FOLLOWER = "box-a/gpu0", "box-b/gpu0"


class TestMarker:
    def test_the_first_worker_writes_an_id_and_every_later_one_reads_it(self, tmp_path: Path):
        first = shared_storage.storage_id(tmp_path)
        assert len(first) == 32 and shared_storage.storage_id(tmp_path) == first
        assert (tmp_path / shared_storage.MARKER).read_text().strip() == first
        assert [p.name for p in tmp_path.iterdir()] == [shared_storage.MARKER], "a temporary file was left"

    def test_another_directory_at_the_same_path_elsewhere_gets_another_id(self, tmp_path: Path):
        (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
        assert shared_storage.storage_id(tmp_path / "a") != shared_storage.storage_id(tmp_path / "b")

    @pytest.mark.parametrize("bad, says", [("relative/dir", "not an absolute path"), ("/nonexistent/ftq-shared",
                                                                                       "not a directory")])
    def test_a_path_that_cannot_be_used_is_refused_naming_the_variable(self, bad: str, says: str):
        with pytest.raises(ValueError, match=f"FTQ_SHARED_DIR: .*{says}"):
            shared_storage.storage_id(Path(bad))

    def test_an_empty_marker_is_refused_saying_how_to_fix_it(self, tmp_path: Path):
        (tmp_path / shared_storage.MARKER).write_text("\n")
        with pytest.raises(ValueError, match="holds no id; remove it"):
            shared_storage.storage_id(tmp_path)

    def test_a_worker_publishes_none_without_it_and_none_when_it_broke_after_start(self, tmp_path: Path):
        assert shared_storage.published(Settings(data_dir=tmp_path)) == {"shared_dir": None, "shared_id": None}
        gone = Settings(data_dir=tmp_path, shared_dir=tmp_path / "unmounted")
        with pytest.raises(ValueError):
            shared_storage.published(gone)
        assert shared_storage.published(gone, strict=False) == {"shared_dir": None, "shared_id": None}


@pytest.fixture
def shared(tmp_path: Path) -> Path:
    directory = tmp_path / "shared"
    directory.mkdir()
    return directory


@pytest.fixture
def leader(settings: Settings, shared: Path) -> Iterator[Runtime]:
    """A leader machine mounting ``shared`` and a follower machine's worker row; the follower
    mounts the same storage unless a test changes its row."""
    settings = settings.model_copy(update={"max_running_jobs_per_user": 0, "worker_address": "127.0.0.1",
                                           "rdzv_port": 29750, "shared_dir": shared})
    rt = recording_runtime(settings, ("0",), LEADER)
    rt.celery = None  # no follower is started: only the claim is under test
    rt.ensure_registered()
    with rt.sessionmaker.begin() as session:
        now = utcnow()
        session.add(Worker(worker_id=FOLLOWER, hostname="b", device="cuda:0", hardware={}, started_at=now,
                           heartbeat_at=now, address="127.0.0.2", shared_dir=str(shared),
                           shared_id=shared_storage.storage_id(shared)))
        session.flush()
        register_pool(session, FOLLOWER, ("0",))
    yield rt
    rt.engine.dispose()


def _follower_mounts(rt: Runtime, shared_id: str | None) -> None:
    with rt.sessionmaker.begin() as session:
        session.get(Worker, FOLLOWER).shared_id = shared_id


class TestFullFineTuningOverMachines:
    def test_the_leader_publishes_its_storage_and_claims_the_job_with_its_shared_home(self, leader, shared):
        with leader.sessionmaker() as session:
            row = session.get(Worker, LEADER)
            assert (row.shared_dir, row.shared_id) == (str(shared), shared_storage.storage_id(shared))
        job_id = queued_job(leader, method="full")
        claim = claim_next_job(leader)
        assert claim is not None and claim.job_id == job_id
        assert claim.shared_home == shared / "jobs" / job_id == claim.checkpoint_home

    def test_machines_of_two_storages_take_no_such_job(self, leader):
        _follower_mounts(leader, "another-filesystem")
        queued_job(leader, method="full")
        assert claim_next_job(leader) is None

    def test_submission_is_refused_naming_nodes_when_no_storage_has_enough_machines(self, leader):
        with leader.sessionmaker() as session:
            check_gpus(session, 2, leader.settings, nodes=2, method="full")
        _follower_mounts(leader, None)
        with leader.sessionmaker() as session, pytest.raises(Unsupported) as refused:
            check_gpus(session, 2, leader.settings, nodes=2, method="full")
        assert refused.value.param == "nodes" and "FTQ_SHARED_DIR" in str(refused.value), refused.value
        with leader.sessionmaker() as session:
            check_gpus(session, 2, leader.settings, nodes=2, method="lora")  # adapters need no shared storage

    def test_a_lora_job_over_machines_sharing_a_storage_checkpoints_there_too(self, leader, shared):
        job_id = queued_job(leader, method="full")
        with leader.sessionmaker.begin() as session:
            session.get(Job, job_id).method = "lora"
        claim = claim_next_job(leader)
        assert claim is not None and claim.shared_home == shared / "jobs" / job_id


def _lose_follower(rt: Runtime, job_id: str, silent_s: float) -> None:
    """The job's attempt ended (it went back to the queue) and the follower machine has been
    silent ``silent_s`` seconds."""
    import datetime as dt

    from core.jobs.service import transition

    with rt.sessionmaker.begin() as session:
        assert transition(session, job_id, JobStatus.queued, only_from=[JobStatus.running], worker_id=None)
        session.get(Worker, FOLLOWER).heartbeat_at = utcnow() - dt.timedelta(seconds=silent_s)


class TestARetryOnFewerMachines:
    """A retry whose follower machine is gone resumes on the leader's machine alone, from the
    shared directory, once the follower has been gone ``shrink_after_s`` (core/jobs/fewer_machines.py)."""

    def test_after_the_grace_it_resumes_alone_from_the_shared_home_saying_so(self, leader, shared):
        from core.jobs.models import JobEvent

        job_id = queued_job(leader, method="full")
        assert claim_next_job(leader) is not None
        timeout = leader.settings.heartbeat_timeout_s
        _lose_follower(leader, job_id, silent_s=timeout + 60)
        leader.settings = leader.settings.model_copy(update={"shrink_after_s": 120.0})
        assert claim_next_job(leader) is None, "gone 60 s of a 120 s grace: it waits for the full set"
        leader.settings = leader.settings.model_copy(update={"shrink_after_s": 30.0})
        claim = claim_next_job(leader)
        assert claim is not None and claim.job_id == job_id and claim.attempt == 2
        assert claim.rendezvous is None and claim.executor == "local" and claim.slots == (0,)
        assert claim.shared_home == shared / "jobs" / job_id, "its checkpoints are in the shared directory"
        with leader.sessionmaker() as session:
            job = session.get(Job, job_id)
            assert (job.gpus, job.nodes, job.worker_id) == (2, 2, LEADER), "the job keeps its gpus: its global batch"
            said = [e.data for e in session.query(JobEvent).filter_by(job_id=job_id, type="log")]
        assert [(d["machines"], d["nodes"]) for d in said] == [(1, 2)]
        assert "resumed on 1 of 2 machines" in said[0]["message"] and str(shared) in said[0]["message"]

    def test_a_second_loss_is_judged_on_the_machine_the_attempt_alone_ran_on(self, leader, shared):
        from core.jobs.models import JobNode

        job_id = queued_job(leader, method="full")
        third = _machine(leader, "box-c/gpu0", "127.0.0.3", shared)
        _beat(leader, 3600, third.worker_id)
        assert claim_next_job(leader) is not None, "attempt 1: box-a and box-b"
        _requeue(leader, job_id)
        _beat(leader, 3600, LEADER, FOLLOWER)
        _beat(leader, 0, third.worker_id)
        claim = claim_next_job(third)
        assert claim is not None and claim.attempt == 2 and claim.rendezvous is None, "attempt 2: box-c alone"
        with leader.sessionmaker() as session:
            rows = session.query(JobNode).filter_by(job_id=job_id, attempt=2).all()
            assert [(r.node_rank, r.worker_id, r.address, r.rdzv_endpoint) for r in rows] == \
                [(0, third.worker_id, "127.0.0.3", "")]
        _requeue(leader, job_id)
        _beat(leader, leader.settings.heartbeat_timeout_s + 10, third.worker_id)
        _beat(leader, 0, LEADER)
        assert claim_next_job(leader) is None, "box-c was lost 10 s ago, within the 120 s grace: it may come back"
        leader.settings = leader.settings.model_copy(update={"shrink_after_s": 5.0})
        claim = claim_next_job(leader)
        assert claim is not None and claim.attempt == 3 and claim.slots == (0,)

    def test_an_attempt_alone_that_ended_while_its_machine_lives_may_resume_alone_again(self, leader):
        job_id = queued_job(leader, method="full")
        assert claim_next_job(leader) is not None
        _requeue(leader, job_id)
        _beat(leader, 3600, FOLLOWER)
        assert claim_next_job(leader).attempt == 2, "alone: box-b is gone"
        _requeue(leader, job_id)  # it ended for another reason (a kill worth a retry); box-a lives
        claim = claim_next_job(leader)
        assert claim is not None and claim.attempt == 3 and claim.slots == (0,), "box-b is still gone"

    def test_a_first_attempt_never_starts_on_fewer_machines(self, leader):
        import datetime as dt

        queued_job(leader, method="full")
        with leader.sessionmaker.begin() as session:
            session.get(Worker, FOLLOWER).heartbeat_at = utcnow() - dt.timedelta(hours=1)
        leader.settings = leader.settings.model_copy(update={"shrink_after_s": 0.0})
        assert claim_next_job(leader) is None


class TestJobJson:
    def test_the_shared_home_becomes_shared_checkpoint_dir(self, tmp_path: Path):
        config = TrainConfig(ModelConfig("m"), DataConfig("t"), OptimConfig(max_steps=1), output_dir=str(tmp_path))
        claim = Claim("job-1", 1, tmp_path, shared_home=Path("/shared/jobs/job-1"))
        assert with_shared_home(config, claim).shared_checkpoint_dir == "/shared/jobs/job-1"
        assert with_shared_home(config, claim).checkpoint_home == "/shared/jobs/job-1"  # where the trainer checkpoints
        assert with_shared_home(config, Claim("job-1", 1, tmp_path)).shared_checkpoint_dir is None
        assert config.checkpoint_home == str(tmp_path)


class _Recorder:
    def __init__(self) -> None:
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()

    def add(self, event: dict[str, Any]) -> None:
        self.events.put(event)


class _NoUploads:
    def upload_artifact(self, *args: Any) -> None:
        raise AssertionError(f"uploaded {args}")

    def close(self) -> None:
        pass


def test_a_remote_worker_records_a_shared_checkpoint_without_uploading_it(tmp_path: Path):
    recorder = _Recorder()
    claim = Claim("job-1", 1, tmp_path, shared_home=tmp_path / "shared" / "jobs" / "job-1")
    outputs = RemoteOutputs(_NoUploads(), claim, recorder, max_attempts=2)  # type: ignore[arg-type]
    event = {"type": "checkpoint", "step": 3, "path": str(claim.shared_home / "checkpoints" / "step-000003")}
    outputs.add(event)
    outputs.drain()
    assert recorder.events.get_nowait() == event


def _beat(rt: Runtime, seconds_ago: float, *worker_ids: str) -> None:
    """The workers' last heartbeat was ``seconds_ago`` (0: live now)."""
    import datetime as dt

    with rt.sessionmaker.begin() as session:
        for worker_id in worker_ids:
            session.get(Worker, worker_id).heartbeat_at = utcnow() - dt.timedelta(seconds=seconds_ago)


def _requeue(rt: Runtime, job_id: str) -> None:
    from core.jobs.service import transition

    with rt.sessionmaker.begin() as session:
        assert transition(session, job_id, JobStatus.queued, only_from=[JobStatus.running], worker_id=None)


def _machine(rt: Runtime, name: str, address: str, shared_dir: Path) -> Runtime:
    """Another machine's worker over the same store, mounting ``shared_dir`` (its own marker)."""
    from worker.runtime import WorkerOptions

    settings = rt.settings.model_copy(update={"worker_address": address, "shared_dir": shared_dir})
    other = Runtime(settings, WorkerOptions(gpus=("0",), name=name, trainer_argv=rt.options.trainer_argv),
                    engine=rt.engine, sessionmaker=rt.sessionmaker, config_builder=rt.config_builder)
    other.celery = None
    other.ensure_registered()
    return other


def _checkpoint_at(rt: Runtime, job_id: str, path: Path) -> None:
    from core.jobs.models import Checkpoint

    with rt.sessionmaker.begin() as session:
        session.add(Checkpoint(job_id=job_id, step=5, path=str(path), bytes=1))


def _two_machines_elsewhere(rt: Runtime, root: Path) -> list[str]:
    """Two live machines (box-c, box-d) of another storage than the leader's."""
    other = root / "other-storage"
    other.mkdir()
    return [_machine(rt, name, address, other).worker_id
            for name, address in (("box-c/gpu0", "127.0.0.3"), ("box-d/gpu0", "127.0.0.4"))]


def _placed(rt: Runtime) -> list[tuple[str, list[str]]]:
    from core.jobs.scheduling import schedule

    with rt.sessionmaker() as session:
        return [(p.job_id, [part.worker_id for part in p.parts]) for p in schedule(session, rt.settings).placements]


class TestARetryStaysWithItsCheckpoints:
    """A retry whose newest checkpoint is in its machines' shared directory (never uploaded) is
    placed only on machines of that storage; with none live it waits, and says why once."""

    def _first_attempt(self, leader: Runtime) -> str:
        job_id = queued_job(leader, method="full")
        assert claim_next_job(leader) is not None
        return job_id

    def test_it_waits_for_its_storage_rather_than_start_on_another_saying_why_once(self, leader, shared):
        from core.jobs.models import JobEvent
        from worker.reaper import reap

        job_id = self._first_attempt(leader)
        _checkpoint_at(leader, job_id, shared / "jobs" / job_id / "checkpoints" / "step-000005")
        _requeue(leader, job_id)
        _two_machines_elsewhere(leader, shared.parent)
        _beat(leader, 3600, LEADER, FOLLOWER)
        assert _placed(leader) == [], "machines of another storage cannot read step 5"
        for _ in range(2):
            reap(leader.sessionmaker, leader.settings, enqueue=lambda *a: None)
        with leader.sessionmaker() as session:
            said = [e.data for e in session.query(JobEvent).filter_by(job_id=job_id, type="log")]
            assert session.get(Job, job_id).status == JobStatus.queued.value
        assert len(said) == 1 and said[0]["waits_for_storage"] == [str(shared), shared_storage.storage_id(shared)]
        assert "checkpoint step 5" in said[0]["message"] and f"FTQ_SHARED_DIR={shared}" in said[0]["message"]
        _beat(leader, 0, LEADER, FOLLOWER)
        assert _placed(leader) == [(job_id, [LEADER, FOLLOWER])]

    def test_a_checkpoint_in_the_store_lets_machines_of_any_storage_take_it(self, leader, shared):
        job_id = self._first_attempt(leader)
        _checkpoint_at(leader, job_id, leader.settings.jobs_dir / job_id / "checkpoints" / "step-000005")
        _requeue(leader, job_id)
        elsewhere = _two_machines_elsewhere(leader, shared.parent)
        _beat(leader, 3600, LEADER, FOLLOWER)
        assert _placed(leader) == [(job_id, elsewhere)]

    def test_a_job_resumed_from_a_checkpoint_linked_into_the_shared_directory_stays_on_that_storage(
            self, leader, shared):
        """A resume's new job (core/jobs/rerun.py ``seed_checkpoint``) has no attempt and no
        ``job_node`` rows: its recorded checkpoint's path in ``<shared>/jobs/<id>/`` alone keeps it
        on that storage's machines."""
        job_id = queued_job(leader, method="lora")
        _checkpoint_at(leader, job_id, shared / "jobs" / job_id / "checkpoints" / "step-000005")
        _two_machines_elsewhere(leader, shared.parent)
        _beat(leader, 3600, LEADER, FOLLOWER)
        assert _placed(leader) == [], "machines of another storage would start it over from step 0"
        _beat(leader, 0, LEADER, FOLLOWER)
        assert _placed(leader) == [(job_id, [LEADER, FOLLOWER])]
