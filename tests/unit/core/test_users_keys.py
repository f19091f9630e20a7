"""API key format and the ownership rule, without a store (the store side: tests/integration)."""

from __future__ import annotations

import hashlib
import re

import pytest
from sqlalchemy import create_engine
from sqlalchemy.orm import Session

from core.errors import InvalidInput, Unauthenticated
from core.models import metadata
from core.users import service
from core.users.service import Caller


@pytest.fixture
def session() -> Session:
    engine = create_engine("sqlite://")
    metadata.create_all(engine)
    with Session(engine) as s:
        yield s
    engine.dispose()


def test_issued_key_has_the_documented_shape_and_only_its_hash_is_kept(session: Session) -> None:
    user = service.create_user(session, "alice")
    issued = service.issue_key(session, user)
    assert re.fullmatch(r"ftq_[0-9a-f]{8}_[A-Za-z0-9_-]{43}", issued.secret)  # 32 bytes, base64url
    prefix, secret = service.split_key(issued.secret)
    assert issued.key.prefix == prefix
    assert issued.key.key_hash == hashlib.sha256(issued.secret.encode()).hexdigest()
    assert secret not in (issued.key.key_hash, issued.key.prefix, issued.key.name or "")


def test_split_key_accepts_underscores_in_the_secret_and_refuses_other_shapes() -> None:
    assert service.split_key("ftq_0123abcd_a_b-c") == ("0123abcd", "a_b-c")
    for bad in ("", "ftq_", "ftq_0123abcd", "ftq_0123abcd_", "xyz_0123abcd_s", "ftq_0123ABCD_s", "ftq_123_s"):
        assert service.split_key(bad) is None, bad


def test_verify_refuses_each_bad_key_with_its_reason(session: Session) -> None:
    user = service.create_user(session, "alice")
    good = service.issue_key(session, user).secret
    assert service.verify_key(session, good).name == "alice"
    with pytest.raises(Unauthenticated, match="malformed"):
        service.verify_key(session, "not-a-key")
    with pytest.raises(Unauthenticated, match="not valid"):
        service.verify_key(session, good[:-1] + ("A" if good[-1] != "A" else "B"))
    service.revoke_key(session, service.find_key(session, service.split_key(good)[0]))
    with pytest.raises(Unauthenticated, match="revoked"):
        service.verify_key(session, good)


def test_names_are_checked_and_me_is_reserved(session: Session) -> None:
    for bad in ("", "Alice", "a b", "me", "-x", "x" * 65):
        with pytest.raises(InvalidInput):
            service.create_user(session, bad)
    with pytest.raises(InvalidInput, match="max_running_jobs"):
        service.create_user(session, "bob", max_running_jobs=-1)


def test_owners_and_admins_may_act_nobody_else() -> None:
    alice = Caller(user_id="user-a", name="alice", is_admin=False)
    admin = Caller(user_id="user-z", name="root", is_admin=True)
    assert alice.may_act_on("user-a")
    assert not alice.may_act_on("user-b")
    assert not alice.may_act_on(None)  # rows from before users: admins only
    assert admin.may_act_on("user-b") and admin.may_act_on(None)
