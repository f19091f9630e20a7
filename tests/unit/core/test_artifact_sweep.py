"""core/jobs/artifact_store.sweep_incoming: what uploads cut off by a crash left is removed at the
API's start; what a running upload holds now (young entries, the lock) is kept."""

from __future__ import annotations

import os
import time

from core.jobs.artifact_store import incoming_dir, sweep_incoming
from core.settings import Settings


def test_stale_leftovers_go_young_ones_and_the_lock_stay(tmp_path) -> None:
    settings = Settings(data_dir=tmp_path).resolved()
    incoming = incoming_dir(settings, "job-1")
    (incoming / "dead.d" / "sub").mkdir(parents=True)
    (incoming / "dead.d" / "sub" / "w.bin").write_bytes(b"x")
    (incoming / "dead.tar").write_bytes(b"x")
    (incoming / "live.tar").write_bytes(b"x")
    (incoming / ".lock").write_text("")
    old = time.time() - 7200
    for name in ("dead.d", "dead.tar", ".lock"):
        os.utime(incoming / name, (old, old))
    removed = sweep_incoming(settings)
    assert sorted(p.name for p in removed) == ["dead.d", "dead.tar"]
    assert sorted(p.name for p in incoming.iterdir()) == [".lock", "live.tar"]
    assert sweep_incoming(settings) == []
