"""api/responses.py: download archives are temporary files, and the API's start removes those a
crash left (the responses themselves are tested against the app in
tests/integration/test_api_worker_uploads_bounded.py)."""

from __future__ import annotations

import os
import time

from api.responses import sweep_temporaries, temporaries_dir
from core.settings import Settings


def test_the_start_removes_old_archives_and_keeps_young_ones(tmp_path) -> None:
    settings = Settings(data_dir=tmp_path).resolved()
    tmp = temporaries_dir(settings)
    tmp.mkdir()
    (tmp / "old.zip").write_bytes(b"x")
    (tmp / "young.zip").write_bytes(b"x")
    old = time.time() - 7200
    os.utime(tmp / "old.zip", (old, old))
    assert [p.name for p in sweep_temporaries(settings)] == ["old.zip"]
    assert [p.name for p in tmp.iterdir()] == ["young.zip"]


def test_no_directory_is_nothing_to_remove(tmp_path) -> None:
    assert sweep_temporaries(Settings(data_dir=tmp_path).resolved()) == []
