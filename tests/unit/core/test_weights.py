"""core.weights: a safetensors file checked against its header's byte ranges, no tensor read."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from core.weights import WeightsError, check_safetensors, check_shard_index


def write_safetensors(path: Path, tensors: dict[str, tuple[list[int], int]], *, data_bytes: int | None = None) -> int:
    """A float32 safetensors file of ``name -> (shape, nbytes)``; ``data_bytes`` overrides how many
    data bytes are written. Returns the size a whole file has."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, (shape, nbytes) in tensors.items():
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * (offset if data_bytes is None else data_bytes))
    return 8 + len(raw) + offset


class TestCheckSafetensors:
    def test_a_whole_file_returns_its_header(self, tmp_path: Path) -> None:
        path = tmp_path / "model.safetensors"
        write_safetensors(path, {"a": ([2, 3], 24), "b": ([4], 16)})
        header = check_safetensors(path)
        assert header["a"]["shape"] == [2, 3] and header["b"]["data_offsets"] == [24, 40]

    def test_a_file_cut_short_names_both_sizes_and_the_fix(self, tmp_path: Path) -> None:
        path = tmp_path / "model-00001-of-00002.safetensors"
        whole = write_safetensors(path, {"a": ([2, 3], 24), "b": ([4], 16)}, data_bytes=30)
        with pytest.raises(WeightsError) as info:
            check_safetensors(path)
        message = str(info.value)
        assert message.startswith(f"model-00001-of-00002.safetensors: it is {whole - 10:,} bytes, but its header "
                                  f"declares {whole:,}")
        assert message.endswith("re-download it")

    def test_a_file_cut_inside_its_header_or_before_it(self, tmp_path: Path) -> None:
        path = tmp_path / "model.safetensors"
        write_safetensors(path, {"a": ([2], 8)})
        path.write_bytes(path.read_bytes()[:20])
        with pytest.raises(WeightsError, match="its header alone declares"):
            check_safetensors(path)
        path.write_bytes(b"\1\0")
        with pytest.raises(WeightsError, match="shorter than a safetensors header.*re-download it"):
            check_safetensors(path)

    def test_extra_bytes_after_the_data_are_refused_as_safetensors_refuses_them(self, tmp_path: Path) -> None:
        path = tmp_path / "model.safetensors"
        write_safetensors(path, {"a": ([2], 8)}, data_bytes=9)
        with pytest.raises(WeightsError, match="longer than its header says"):
            check_safetensors(path)

    def test_no_tensors_is_a_header_alone(self, tmp_path: Path) -> None:
        path = tmp_path / "empty.safetensors"
        write_safetensors(path, {})
        assert check_safetensors(path) == {"__metadata__": {"format": "pt"}}

    @pytest.mark.parametrize("offsets", [[8], [8, 4], ["0", 8], [-1, 8], None])
    def test_bad_data_offsets_are_not_safetensors(self, tmp_path: Path, offsets) -> None:
        raw = json.dumps({"a": {"dtype": "F32", "shape": [2], "data_offsets": offsets}}).encode()
        path = tmp_path / "x.safetensors"
        path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * 8)
        with pytest.raises(WeightsError, match="'a' has no valid data_offsets"):
            check_safetensors(path)

    def test_not_json_or_an_implausible_length(self, tmp_path: Path) -> None:
        path = tmp_path / "x.safetensors"
        path.write_bytes(struct.pack("<Q", 4) + b"nope")
        with pytest.raises(WeightsError, match="not JSON"):
            check_safetensors(path)
        path.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
        with pytest.raises(WeightsError, match="not plausible"):
            check_safetensors(path)


class TestShardIndex:
    def test_missing_shards_are_listed(self, tmp_path: Path) -> None:
        assert check_shard_index(tmp_path) == []
        (tmp_path / "model-00001-of-00003.safetensors").write_bytes(b"")
        weight_map = {"a": "model-00001-of-00003.safetensors", "b": "model-00003-of-00003.safetensors",
                      "c": "model-00002-of-00003.safetensors"}
        (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
        assert check_shard_index(tmp_path) == ["model-00002-of-00003.safetensors", "model-00003-of-00003.safetensors"]

    def test_an_index_without_a_weight_map_is_refused(self, tmp_path: Path) -> None:
        for text, problem in (("{", "does not parse"), ("[]", "has no weight_map"), ("{}", "has no weight_map")):
            (tmp_path / "model.safetensors.index.json").write_text(text)
            with pytest.raises(WeightsError, match=problem):
                check_shard_index(tmp_path)
