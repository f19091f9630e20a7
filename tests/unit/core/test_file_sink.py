"""core.files.service.FileSink: hashes and counts while writing, refuses past the limit, cleans up."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from core.errors import TooLarge
from core.files.service import FileSink


def test_hash_and_count_match_what_was_written(tmp_path: Path) -> None:
    with FileSink(tmp_path, max_bytes=100) as sink:
        for chunk in (b"abc", b"", b"defg"):
            sink.write(chunk)
        sink.close()
        assert (sink.bytes, sink.sha256) == (7, hashlib.sha256(b"abcdefg").hexdigest())
        assert sink.path.read_bytes() == b"abcdefg"
        assert sink.path.parent == tmp_path / ".incoming"
    assert not sink.path.exists(), "a sink left without keep() removes its file"


def test_refuses_the_byte_past_the_limit_and_removes_the_file(tmp_path: Path) -> None:
    with pytest.raises(TooLarge, match="limit of 4 bytes"):
        with FileSink(tmp_path, max_bytes=4) as sink:
            sink.write(b"1234")
            sink.write(b"5")
    assert list((tmp_path / ".incoming").iterdir()) == []


def test_kept_file_survives(tmp_path: Path) -> None:
    with FileSink(tmp_path, max_bytes=10) as sink:
        sink.write(b"x")
        sink.keep()
    assert sink.path.read_bytes() == b"x"
