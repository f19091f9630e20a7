"""The tars carrying a job's artifacts (``core.workers.archive``) and the paths they may land on
(``trainer.training.layout.check_artifact_path``): hostile archives never write outside the staging dir."""

from __future__ import annotations

import hashlib
import tarfile
from pathlib import Path

import pytest

from core.errors import ChecksumMismatch, TooLarge, UnsafeArchive
from core.workers import archive
from tests.hostile_tars import (
    GIB,
    HOSTILE,
    Hostile,
    files_tar,
    forged_size_tar,
    gnu_sparse_tar,
    many_members_tar,
    member,
    tar_bytes,
)
from trainer.training import layout


class TestArtifactPaths:
    @pytest.mark.parametrize("path", ["job.json", "adapter", "model", "checkpoints/step-000042",
                                      "checkpoints/step-1234567", "exports/exp-0123abcdef",
                                      "completions.jsonl", "completions.parts"])
    def test_the_layouts_artifacts_are_allowed(self, path: str) -> None:
        assert layout.check_artifact_path(path) == path

    @pytest.mark.parametrize("path", [
        "", "/etc/passwd", "..", "../job-x/adapter", "checkpoints/../adapter", "checkpoints/step-000042.tmp",
        "checkpoints/step-42", "checkpoints/step-0000042", "checkpoints/step-000042/dcp", "adapter/x",
        "adapter/", "exports/../x", "exports/EXP-1", "exports", "unrecorded-checkpoints", ".incoming",
        "job.json/", "checkpoints//step-000042", "trainer.stderr.log", "completions.parts/rank-0.jsonl",
        "completions.jsonl.tmp",
    ])
    def test_anything_else_is_refused_naming_the_allowed_ones(self, path: str) -> None:
        with pytest.raises(ValueError, match=r"path: .* use one of job.json, checkpoints/step-NNNNNN"):
            layout.check_artifact_path(path)


class TestRoundTrip:
    def test_a_directory_comes_back_whole_and_the_hash_is_of_the_bytes(self, tmp_path: Path) -> None:
        src = tmp_path / "step-000002"
        (src / "dcp").mkdir(parents=True)
        (src / "state.json").write_text('{"step": 2}')
        (src / "dcp" / "0.distcp").write_bytes(b"\x00" * 1000)
        (src / "link").symlink_to(tmp_path)  # never packed
        out = tmp_path / "a.tar"
        digest, size = archive.write_tar(src, out)
        assert digest == hashlib.sha256(out.read_bytes()).hexdigest() and size == out.stat().st_size
        assert archive.extract_into(out, tmp_path / "back") == 2
        got = sorted(p.relative_to(tmp_path / "back").as_posix() for p in (tmp_path / "back").rglob("*"))
        assert got == ["dcp", "dcp/0.distcp", "state.json"]
        assert (tmp_path / "back" / "dcp" / "0.distcp").read_bytes() == b"\x00" * 1000

    def test_hard_linked_files_are_packed_as_files(self, tmp_path: Path) -> None:
        src = tmp_path / "adapter"
        src.mkdir()
        (src / "a").write_text("same inode")
        (src / "b").hardlink_to(src / "a")
        archive.write_tar(src, tmp_path / "a.tar")
        with tarfile.open(tmp_path / "a.tar") as tar:
            assert all(m.isfile() for m in tar.getmembers())
        assert archive.extract_into(tmp_path / "a.tar", tmp_path / "back") == 2

    def test_a_single_file_is_one_member_named_by_its_basename(self, tmp_path: Path) -> None:
        (tmp_path / "job.json").write_text("{}")
        archive.write_tar(tmp_path / "job.json", tmp_path / "a.tar")
        with tarfile.open(tmp_path / "a.tar") as tar:
            assert tar.getnames() == ["job.json"]


class TestHostileTars:
    @pytest.mark.parametrize("hostile", HOSTILE, ids=lambda h: h.id)
    def test_each_is_refused_and_nothing_is_written(self, tmp_path: Path, hostile: Hostile) -> None:
        bad = tmp_path / "bad.tar"
        bad.write_bytes(hostile.build())
        staging = tmp_path / "jobs" / "job-1" / ".incoming" / "x.d"
        with pytest.raises(TooLarge if hostile.too_large else UnsafeArchive, match=hostile.says):
            archive.extract_into(bad, staging)
        assert not staging.exists()
        assert {p.name for p in tmp_path.rglob("*")} == {"bad.tar", "jobs", "job-1", ".incoming"}
        assert not (tmp_path / "evil").exists() and not Path("/etc/evil").exists()

    def test_a_safe_member_before_a_hostile_one_is_not_left_behind(self, tmp_path: Path) -> None:
        bad = tmp_path / "bad.tar"
        bad.write_bytes(tar_bytes((member("fine.txt"), b"x"), (member("../evil"), b"x")))
        with pytest.raises(UnsafeArchive):
            archive.extract_into(bad, tmp_path / "staging")
        assert not (tmp_path / "staging").exists() and not (tmp_path / "evil").exists()


class TestChecks:
    def test_the_sha256_header_must_be_64_hex(self) -> None:
        assert archive.check_sha256_header(" " + "AB" * 32 + " ") == "ab" * 32
        for bad in (None, "", "x" * 64, "a" * 63):
            with pytest.raises(ValueError, match="X-Ftq-Sha256"):
                archive.check_sha256_header(bad)

    def test_a_short_or_changed_body_is_a_checksum_mismatch(self, tmp_path: Path) -> None:
        body = tmp_path / "b"
        body.write_bytes(b"abc")
        good = hashlib.sha256(b"abc").hexdigest()
        assert archive.verify_received(body, sha256=good, got_sha256=good, expected_bytes=3) == 3
        with pytest.raises(ChecksumMismatch, match="received 3 bytes of the 10"):
            archive.verify_received(body, sha256=good, got_sha256=good, expected_bytes=10)
        with pytest.raises(ChecksumMismatch, match="corrupted"):
            archive.verify_received(body, sha256="0" * 64, got_sha256=good, expected_bytes=None)

    def test_replacing_renames_the_old_copy_aside_then_removes_it(self, tmp_path: Path) -> None:
        target, scratch = tmp_path / "job" / "adapter", tmp_path / "job" / ".incoming"
        scratch.mkdir(parents=True)
        target.mkdir()
        (target / "old").write_text("old")
        staging = scratch / "x.d"
        staging.mkdir()
        (staging / "new").write_text("new")
        archive.replace_atomically(staging, target, scratch)
        assert [p.name for p in target.iterdir()] == ["new"] and not staging.exists()
        assert list(scratch.iterdir()) == []


class TestBounds:
    """The requests that broke the API (issue 23): each refused before its bytes land."""

    def test_a_10_kb_tar_with_a_gnu_sparse_member_of_3_gib_writes_nothing(self, tmp_path: Path) -> None:
        bad = tmp_path / "sparse.tar"
        bad.write_bytes(gnu_sparse_tar(3 * GIB))
        assert bad.stat().st_size == 10240
        with pytest.raises(UnsafeArchive, match=r"tar member 'big' is a sparse file"):
            archive.extract_into(bad, tmp_path / "staging")
        assert not (tmp_path / "staging").exists()

    def test_a_tar_of_60000_members_is_refused_naming_the_cap(self, tmp_path: Path) -> None:
        bad = tmp_path / "many.tar"
        bad.write_bytes(many_members_tar(60_000))
        with pytest.raises(TooLarge, match=r"more than 10,000 members; pack fewer files"):
            archive.extract_into(bad, tmp_path / "staging")
        assert not (tmp_path / "staging").exists()

    def test_a_tar_of_a_directorys_dot_unpacks(self, tmp_path: Path) -> None:
        (tmp_path / "a.tar").write_bytes(tar_bytes((member("./", tarfile.DIRTYPE), None), (member("./a"), b"1")))
        assert archive.extract_into(tmp_path / "a.tar", tmp_path / "out") == 1
        assert (tmp_path / "out" / "a").read_bytes() == b"1"

    def test_a_tar_at_the_member_cap_unpacks(self, tmp_path: Path) -> None:
        (tmp_path / "five.tar").write_bytes(many_members_tar(5))
        assert archive.extract_into(tmp_path / "five.tar", tmp_path / "out", archive.Limits(max_members=5)) == 5
        with pytest.raises(TooLarge, match="more than 4 members"):
            archive.extract_into(tmp_path / "five.tar", tmp_path / "again", archive.Limits(max_members=4))

    def test_files_past_the_byte_limit_are_refused_with_the_callers_hint(self, tmp_path: Path) -> None:
        (tmp_path / "a.tar").write_bytes(files_tar({"a": b"x" * 6, "b": b"y" * 6}))
        limits = archive.Limits(max_bytes=11, bytes_hint="the job's quota (FTQ_X)")
        with pytest.raises(TooLarge, match=r"unpacks to more than 11 bytes; the job's quota \(FTQ_X\)"):
            archive.extract_into(tmp_path / "a.tar", tmp_path / "staging", limits)
        assert not (tmp_path / "staging").exists()
        assert archive.extract_into(tmp_path / "a.tar", tmp_path / "out", archive.Limits(max_bytes=12)) == 2

    def test_a_size_the_tar_cannot_hold_is_refused(self, tmp_path: Path) -> None:
        (tmp_path / "a.tar").write_bytes(forged_size_tar())
        with pytest.raises(UnsafeArchive, match="more than the tar holds"):
            archive.extract_into(tmp_path / "a.tar", tmp_path / "staging")


def test_members_without_a_time_are_stored_with_a_time_a_zip_download_accepts(tmp_path: Path) -> None:
    bad = tmp_path / "a.tar"
    bad.write_bytes(tar_bytes((member("state.json"), b"{}")))  # TarInfo's mtime is 0: 1970
    archive.extract_into(bad, tmp_path / "out")
    assert (tmp_path / "out" / "state.json").stat().st_mtime >= archive.EARLIEST_MTIME
