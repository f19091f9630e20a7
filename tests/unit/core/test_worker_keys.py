"""Worker keys (``core.workers.keys``): their shape, hashing, revocation and verification."""

from __future__ import annotations

import datetime as dt
import hashlib
import re

import pytest
from sqlalchemy import create_engine
from sqlalchemy.orm import Session

from core.errors import Conflict, InvalidInput, NotFound, Unauthenticated
from core.models import metadata
from core.users import service as users
from core.workers import keys
from core.workers.models import Worker, WorkerKey


@pytest.fixture
def session() -> Session:
    engine = create_engine("sqlite://")
    metadata.create_all(engine)
    with Session(engine) as s:
        yield s
    engine.dispose()


class TestCreate:
    def test_the_key_has_its_own_scheme_and_only_its_hash_is_kept(self, session: Session) -> None:
        row, raw = keys.create_worker_key(session, "box-2", created_by=None)
        assert re.fullmatch(r"ftqw_[0-9a-f]{8}_[A-Za-z0-9_-]{43}", raw)
        prefix, secret = keys.split_worker_key(raw)
        assert row.prefix == prefix and row.worker_key_id.startswith("wkey-")
        assert row.key_hash == hashlib.sha256(raw.encode()).hexdigest()
        assert secret not in (row.key_hash, row.prefix, row.name)
        assert users.split_key(raw) is None  # a user's key check never mistakes it for one of theirs

    def test_names_are_unique_and_checked(self, session: Session) -> None:
        keys.create_worker_key(session, "box-2", created_by=None)
        with pytest.raises(Conflict, match="box-2"):
            keys.create_worker_key(session, "box-2", created_by=None)
        for bad in ("", "Box", "a b", "-x", "x" * 65):
            with pytest.raises(InvalidInput) as caught:
                keys.create_worker_key(session, bad, created_by=None)
            assert caught.value.param == "name"


class TestVerify:
    def test_a_good_key_verifies_and_each_bad_one_says_why(self, session: Session) -> None:
        row, raw = keys.create_worker_key(session, "box-2", created_by=None)
        assert keys.verify_worker_key(session, raw).worker_key_id == row.worker_key_id
        with pytest.raises(Unauthenticated, match="malformed"):
            keys.verify_worker_key(session, "ftq_0123abcd_secret")  # a user's key
        with pytest.raises(Unauthenticated, match="not valid"):
            keys.verify_worker_key(session, raw[:-1] + ("A" if raw[-1] != "A" else "B"))
        with pytest.raises(Unauthenticated, match="not valid"):
            keys.verify_worker_key(session, "ftqw_0123abcd_" + "A" * 43)

    def test_a_revoked_key_stops_at_once_and_revoking_again_keeps_the_first_time(self, session: Session) -> None:
        _row, raw = keys.create_worker_key(session, "box-2", created_by=None)
        first = keys.revoke_worker_key(session, "box-2").revoked_at
        assert first is not None
        assert keys.revoke_worker_key(session, keys.split_worker_key(raw)[0]).revoked_at == first  # by prefix
        with pytest.raises(Unauthenticated, match="revoked"):
            keys.verify_worker_key(session, raw)
        assert keys.worker_key_active(session, raw) is None
        with pytest.raises(NotFound):
            keys.revoke_worker_key(session, "nope")

    def test_last_used_moves_at_most_once_a_minute(self, session: Session) -> None:
        row, raw = keys.create_worker_key(session, "box-2", created_by=None)
        keys.verify_worker_key(session, raw)
        session.refresh(row)
        first = row.last_used_at
        assert first is not None
        keys.verify_worker_key(session, raw)
        session.refresh(row)
        assert row.last_used_at == first
        row.last_used_at = first - dt.timedelta(minutes=2)
        session.flush()
        keys.verify_worker_key(session, raw)
        session.refresh(row)
        assert row.last_used_at > first - dt.timedelta(minutes=2)


def test_the_list_names_the_workers_using_each_key(session: Session) -> None:
    row, _raw = keys.create_worker_key(session, "box-2", created_by=None)
    other, _ = keys.create_worker_key(session, "box-3", created_by=None)
    session.add_all([Worker(worker_id="w1@box2", hostname="box2", device="cpu", key_id=row.worker_key_id),
                     Worker(worker_id="w0@box1", hostname="box1", device="cpu")])
    session.flush()
    assert [k.name for k in keys.list_worker_keys(session)] == ["box-2", "box-3"]
    assert keys.workers_by_key(session, {row.worker_key_id, other.worker_key_id}) == {
        row.worker_key_id: ["w1@box2"], other.worker_key_id: []
    }
    assert isinstance(keys.find_worker_key(session, row.worker_key_id), WorkerKey)
