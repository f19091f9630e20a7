"""The tokenizer pool behind GET /v1/files/{id}/tokens (``api.files.tokenizer_pool``).

- ``TokenizerCache``, which each worker process keeps: loaded once per model version, bounded,
  a failed load not kept (a fake loader, in this process).
- ``TokenizerPool``: the tokenizing runs in a spawned worker process and gives what training's
  own tokenization gives; a model without a tokenizer is the same InvalidInput as before; the
  process that awaits the pool never imports transformers (run in a fresh interpreter); a
  worker process that died is replaced for the next request; a request past the budget is an
  InvalidInput naming the line and its process is replaced.
- Fair turns (fake workers, in this process): one user never holds every worker while another
  waits, and a freed worker goes to the user with the fewest requests running.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from api.files.tokenizer_pool import TOKENIZER_CACHE_SIZE, TokenizerCache, TokenizerPool, token_stats
from core.errors import InvalidInput, Unavailable
from core.jobs.model_source import ModelSource
from tests.helpers import CHAT_RECORD

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture
def loads() -> list[str]:
    return []


@pytest.fixture
def cache(loads: list[str]) -> TokenizerCache:
    def fake_load(model: str, source: ModelSource) -> object:
        loads.append(source.name_or_path)
        return object()

    return TokenizerCache(load=fake_load)


def _model_dir(root: Path, name: str) -> ModelSource:
    directory = root / name
    directory.mkdir()
    (directory / "tokenizer.json").write_text("{}")
    return ModelSource("local", str(directory))


class TestTokenizerCache:
    def test_second_request_reuses_the_loaded_tokenizer(self, tmp_path: Path, cache, loads) -> None:
        source = _model_dir(tmp_path, "a")
        first = cache.get("a", source)
        second = cache.get("a", source)
        assert first is second and loads == [source.name_or_path]

    def test_changed_tokenizer_files_load_again(self, tmp_path: Path, cache, loads) -> None:
        source = _model_dir(tmp_path, "a")
        first = cache.get("a", source)
        path = Path(source.name_or_path) / "tokenizer.json"
        path.write_text('{"changed": true}')
        os.utime(path, ns=(1, 10**18))  # a different mtime even on coarse filesystem clocks
        assert cache.get("a", source) is not first
        assert len(loads) == 2

    def test_cache_keeps_the_most_recent_few(self, tmp_path: Path, cache, loads) -> None:
        sources = [_model_dir(tmp_path, f"m{i}") for i in range(TOKENIZER_CACHE_SIZE + 1)]
        for source in sources:
            cache.get(source.name_or_path, source)
        assert len(cache) == TOKENIZER_CACHE_SIZE
        cache.get("m0", sources[0])  # evicted first: loaded again
        assert loads.count(sources[0].name_or_path) == 2

    def test_a_failed_load_is_not_cached(self, tmp_path: Path) -> None:
        source = _model_dir(tmp_path, "a")

        def broken(model: str, source: ModelSource) -> object:
            raise InvalidInput("no tokenizer")

        cache = TokenizerCache(load=broken)
        with pytest.raises(InvalidInput):
            cache.get("a", source)
        assert len(cache) == 0


# A fresh interpreter that awaits the pool twice (a tokenizer, then a model without one) and
# reports what came back and which heavy modules it imported itself.
POOL_RUN = """
import asyncio, json, os, sys
from api.files.tokenizer_pool import TokenizerPool
from core.errors import InvalidInput
from core.jobs.model_source import ModelSource

data, tiny, bare = sys.argv[1:4]

async def main():
    pool = TokenizerPool(workers=1)
    try:
        stats = await pool.token_stats(data, "chat", "tiny", ModelSource("local", tiny), max_seq_len=8)
        try:
            await pool.token_stats(data, "chat", "bare", ModelSource("local", bare), max_seq_len=8)
            error = None
        except InvalidInput as exc:
            error = {"type": type(exc).__name__, "param": exc.param, "message": exc.message}
    finally:
        pool.shutdown()
    heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("transformers", "torch", "tokenizers"))
    print(json.dumps({"stats": stats, "error": error, "heavy": heavy}))

asyncio.run(main())
"""


@pytest.fixture
def dataset(tmp_path: Path) -> tuple[Path, Path, Path]:
    """A two-record chat dataset, a directory with the tiny tokenizer, one with no tokenizer."""
    from trainer.model.tiny import build_tokenizer

    tiny, bare = tmp_path / "tiny", tmp_path / "bare"
    build_tokenizer().save_pretrained(tiny)
    bare.mkdir()
    long_record = {"messages": [{"role": "user", "content": "count to ten " * 5}, CHAT_RECORD["messages"][1]]}
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in (CHAT_RECORD, long_record)))
    return data, tiny, bare


@pytest.mark.slow  # ~5 s: the worker process imports transformers
def test_the_pool_tokenizes_in_a_worker_process_as_training_does(dataset) -> None:
    from transformers import AutoTokenizer

    data, tiny, bare = dataset
    done = subprocess.run(
        [sys.executable, "-c", POOL_RUN, str(data), str(tiny), str(bare)],
        cwd=REPO, capture_output=True, text=True, timeout=300, check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])

    assert out["stats"] == token_stats(data, "chat", AutoTokenizer.from_pretrained(tiny), max_seq_len=8)
    assert out["stats"]["records"] == 2 and out["stats"]["over_max_seq_len"]["records"] >= 1
    assert out["error"]["type"] == "InvalidInput" and out["error"]["param"] == "model"
    assert "no tokenizer could be loaded" in out["error"]["message"]
    assert out["heavy"] == [], "the process that awaits the pool must not import transformers"


@pytest.mark.slow  # ~12 s: two worker processes import transformers
def test_a_worker_process_that_died_is_replaced_for_the_next_request(dataset) -> None:
    data, tiny, _ = dataset
    source = ModelSource("local", str(tiny))

    def stats() -> dict:
        return asyncio.run(pool.token_stats(str(data), "chat", "tiny", source, max_seq_len=8))

    pool = TokenizerPool(workers=1)
    try:
        assert stats()["records"] == 2
        [worker] = pool._idle  # as the kernel's OOM killer would
        worker.process.kill()
        worker.process.join()
        with pytest.raises(Unavailable, match="FTQ_TOKENIZER_WORKERS"):
            stats()
        assert stats()["records"] == 2
    finally:
        pool.shutdown()


class FakeWorker:
    """Stands for a worker process: a call runs until the test releases its user's gate."""

    ready = True

    def __init__(self, gates: dict[str, asyncio.Event], log: list[str]) -> None:
        self.gates, self.log = gates, log

    async def call(self, task: tuple, budget_s: float, model: str) -> str:
        user = task[3][0]
        self.log.append(f"start {user}")
        await self.gates[user].wait()
        self.log.append(f"end {user}")
        return user

    def stop(self) -> None:
        self.ready = False


class TestFairTurns:
    def run_pool(self, monkeypatch, workers: int, script) -> list[str]:
        from api.files import tokenizer_pool

        log: list[str] = []
        gates: dict[str, asyncio.Event] = {}
        monkeypatch.setattr(tokenizer_pool._Worker, "start", classmethod(lambda cls, size: FakeWorker(gates, log)))

        async def main() -> None:
            pool = TokenizerPool(workers=workers)
            for user in ("alice", "bob", "carol"):
                gates[user] = asyncio.Event()

            def request(user: str) -> asyncio.Task:
                return asyncio.create_task(pool.run(len, "m", ModelSource("local", "/m"), user, user=user))

            await script(pool, request, gates, log)

        asyncio.run(main())
        return log

    def test_one_users_requests_leave_a_worker_for_another_user(self, monkeypatch) -> None:
        async def script(pool, request, gates, log):
            alice = [request("alice") for _ in range(3)]
            await asyncio.sleep(0.05)
            assert pool.running == 1, "alice holds all workers but one"
            bob = request("bob")
            await asyncio.sleep(0.05)
            assert log == ["start alice", "start bob"]
            gates["bob"].set()
            assert await bob == "bob"
            assert not any(task.done() for task in alice), "bob was answered while alice's first still ran"
            gates["alice"].set()
            assert await asyncio.gather(*alice) == ["alice"] * 3

        self.run_pool(monkeypatch, 2, script)

    def test_a_freed_worker_goes_to_the_user_with_fewest_running(self, monkeypatch) -> None:
        async def script(pool, request, gates, log):
            bob = [request("bob"), request("bob")]
            alice = [request("alice"), request("alice")]
            await asyncio.sleep(0.05)
            assert pool.running == 4
            later = [request("alice"), request("carol")]  # alice asked first, carol has none running
            await asyncio.sleep(0.05)
            gates["bob"].set()
            await bob[0]
            await asyncio.sleep(0.05)
            starts = [line for line in log if line.startswith("start")]
            assert starts[4:] == ["start carol", "start alice"]
            for gate in gates.values():
                gate.set()
            await asyncio.gather(*alice, *bob, *later)

        self.run_pool(monkeypatch, 4, script)
