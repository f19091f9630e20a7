"""``trainer.parallel.distributed``: each rank's share of a global step, and who this process is."""

from __future__ import annotations

import random

import pytest
import torch

from trainer.parallel.distributed import Comm, World, share
from trainer.errors import ConfigError


class TestShare:
    def test_hand_checked_split(self):
        # Longest first to the lightest rank: 8 -> r0; 5 -> r1; 3 -> r1 (5 < 8); 2 -> r0 (8 = 8,
        # r0 has fewer micro-batches). Each rank keeps its micro-batches in step order.
        assert share([5, 3, 8, 2], 2) == [[2, 3], [0, 1]]

    def test_one_rank_takes_every_micro_batch_in_order(self):
        assert share([4, 9, 1], 1) == [[0, 1, 2]]

    def test_equal_lengths_alternate_from_rank_zero(self):
        assert share([7, 7, 7, 7], 2) == [[0, 2], [1, 3]]

    @pytest.mark.parametrize("world", [2, 3, 4, 8])
    def test_disjoint_complete_deterministic_and_balanced(self, world):
        rng = random.Random(world)
        for _ in range(50):
            tokens = [rng.randint(1, 4096) for _ in range(rng.randint(world, 4 * world))]
            parts = share(tokens, world)
            assert parts == share(list(tokens), world), "the same lengths give the same split"
            flat = [i for part in parts for i in part]
            assert sorted(flat) == list(range(len(tokens))), "every micro-batch on exactly one rank"
            assert all(part == sorted(part) and part for part in parts)
            loads = [sum(tokens[i] for i in part) for part in parts]
            # longest-first greedy: the heaviest rank exceeds the lightest by at most one micro-batch
            assert max(loads) - min(loads) <= max(tokens), (tokens, parts)

    def test_a_short_step_leaves_the_last_ranks_empty(self):
        # the last step of an epoch may hold fewer micro-batches than there are ranks
        assert share([10, 20, 30], 4) == [[2], [1], [0], []]
        assert share([5], 2) == [[0], []]


class TestPadding:
    """What each rank runs of a step: its share plus zero-weighted stand-ins for the collectives."""

    def test_one_rank_runs_its_share(self):
        from trainer.training.step import _padded

        assert _padded([0, 1], [[0, 1]], None) == [0, 1]

    def test_ddp_gives_only_an_empty_rank_a_stand_in(self):
        from trainer.training.step import _padded

        parts = [[0, 1, 2], [3], []]
        assert [_padded(p, parts, "ddp") for p in parts] == [[0, 1, 2], [3], [0]]

    def test_fsdp2_gives_every_rank_as_many_forwards_as_the_busiest(self):
        from trainer.training.step import _padded

        parts = share([4096, 2000, 2000, 100], 2)  # token-balanced: one big, three small
        assert parts == [[0], [1, 2, 3]]
        assert [_padded(p, parts, "fsdp2") for p in parts] == [[0, 0, 0], [1, 2, 3]]


class TestWorld:
    def test_without_torchrun_it_is_one_rank(self, monkeypatch):
        for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
            monkeypatch.delenv(name, raising=False)
        world = World.from_env()
        assert world == World(rank=0, world_size=1, local_rank=0)
        assert world.is_main and not world.is_distributed

    def test_reads_torchruns_variables(self, monkeypatch):
        monkeypatch.setenv("RANK", "3")
        monkeypatch.setenv("WORLD_SIZE", "4")
        monkeypatch.setenv("LOCAL_RANK", "1")
        world = World.from_env()
        assert world == World(rank=3, world_size=4, local_rank=1)
        assert not world.is_main and world.is_distributed

    @pytest.mark.parametrize(
        ("rank", "size", "message"),
        [("x", "2", "must be integers"), ("2", "2", "RANK=2 is outside WORLD_SIZE=2"), ("-1", "2", "outside")],
    )
    def test_bad_variables_are_config_errors(self, monkeypatch, rank, size, message):
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv("WORLD_SIZE", size)
        with pytest.raises(ConfigError, match=message):
            World.from_env()


class TestOneRankComm:
    def test_collectives_return_their_input_without_a_process_group(self):
        comm = Comm(World(), torch.device("cpu")).start()
        value = torch.tensor([1.5])
        assert comm.all_reduce_sum(value) is value and value.item() == 1.5
        assert comm.gather_host([1.0, 2.0], "test") == [[1.0, 2.0]]
        assert comm.any_rank(True) and not comm.any_rank(False)
        comm.barrier()
        comm.close()
        assert not torch.distributed.is_initialized()


_MISMATCH = """
import json, torch
from trainer.parallel.distributed import Comm, World

world = World.from_env()
comm = Comm(world, torch.device("cpu"), timeout_s=60).start()
try:
    comm.gather_host([1.0] if world.rank == 0 else [0.0], "stop vote" if world.rank == 0 else "oom agree")
    out = {"rank": world.rank, "raised": None}
except RuntimeError as exc:
    out = {"rank": world.rank, "raised": str(exc)}
out["after"] = comm.gather_host([float(world.rank)], "check")  # the group still pairs matched gathers
print(json.dumps(out), flush=True)
comm.close()
"""


def test_ranks_meeting_in_host_gathers_of_different_purposes_raise_naming_both(tmp_path) -> None:
    """Two gloo ranks under torchrun: rank 0 in the stop vote, rank 1 in the OOM agreement (same
    shape, one float each): both raise instead of pairing silently, naming where each rank was."""
    import json
    import subprocess
    import sys

    from distributed_helpers import job_env

    script = tmp_path / "mismatch.py"
    script.write_text(_MISMATCH)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(script)], env=job_env(), capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = sorted((json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")), key=lambda r: r["rank"])
    assert [r["rank"] for r in rows] == [0, 1]
    for row in rows:
        assert row["raised"] == "ranks out of step in a host collective: rank 0 at 'stop vote', rank 1 at 'oom agree'"
        assert row["after"] == [[0.0], [1.0]]


def test_every_host_gather_of_the_trainer_names_a_known_purpose() -> None:
    """A purpose missing from ``HOST_GATHERS`` would still raise on a mismatch, but could only be
    named by its tag on the other rank."""
    import re
    from pathlib import Path

    from trainer.parallel.distributed import HOST_GATHERS

    root = Path(__file__).resolve().parents[4] / "trainer"
    used = {m for path in root.rglob("*.py") for m in re.findall(r'gather_host\([^\n]*?, "([^"]+)"\)', path.read_text())}
    used.add("stop vote")  # any_rank's, written inside the method
    assert used == set(HOST_GATHERS)
