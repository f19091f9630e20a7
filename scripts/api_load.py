"""Load test of a running ftq API (issue 10, item 5): submissions and listings beside live SSE
viewers, measured side by side with the same requests on the idle API, in one run.

    phase   what runs                                                      measured
    idle    1 submission/s, 2 listings/s (GET /v1/jobs?limit=50)           latencies
    load    --rate submissions/s (open loop: sent on schedule, however     latencies, errors
            slow the answers), --viewers SSE streams on one job, 5
            listings/s, for --seconds
    both    the step time of the job the viewers watch (step_ms of its      median per phase
            step metrics), when that job is running on a worker

Targets (issue 10): submission p99 < 300 ms, listing p99 < 200 ms under 20 submissions/s + 100
viewers, the trainer's step within 10% of idle. Every job it submits is cancelled at the end.

    python scripts/api_load.py --url http://127.0.0.1:8000 --key ftq_... [--model tiny-llama]
        [--watch JOB_ID] [--rate 20] [--viewers 100] [--seconds 30] [--idle-seconds 10]
        [--json out.json]

``--watch`` names a running job for the viewers (and the step-time figure); without it the
viewers watch the first job this script submits (queued: no steps, the stream only waits).
On a shared machine pin the API and the worker apart first (``taskset -pc 0 <api pid>``,
``taskset -pc 1 <worker and trainer pids>``) and say so next to the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

import httpx

DATASET = '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]}\n'


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def summary(values: list[float]) -> dict[str, Any]:
    return {"n": len(values), "p50_ms": percentile(values, 50), "p99_ms": percentile(values, 99),
            "max_ms": max(values) if values else None}


class Load:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.client = httpx.AsyncClient(base_url=args.url, headers={"Authorization": f"Bearer {args.key}"},
                                        timeout=60, limits=httpx.Limits(max_connections=None))
        self.submitted: list[str] = []
        self.errors: dict[str, int] = {}
        self.file_id = ""
        self.last_error = ""

    async def timed(self, kind: str, method: str, path: str, sink: list[float], **kwargs: Any) -> httpx.Response | None:
        start = time.perf_counter()
        try:
            response = await self.client.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            self.errors[f"{kind}: {type(exc).__name__}"] = self.errors.get(f"{kind}: {type(exc).__name__}", 0) + 1
            return None
        sink.append((time.perf_counter() - start) * 1000)
        if response.status_code >= 400:
            key = f"{kind}: HTTP {response.status_code}"
            self.errors[key] = self.errors.get(key, 0) + 1
            self.last_error = response.text[:300]
        return response

    async def submit(self, sink: list[float]) -> None:
        body = {"model": self.args.model, "training_file": self.file_id, "name": "api-load",
                "hyperparameters": {"max_steps": 1}, "priority": "low"}
        response = await self.timed("submit", "POST", "/v1/jobs", sink, json=body)
        if response is not None and response.status_code == 201:
            self.submitted.append(response.json()["id"])

    async def every(self, per_s: float, seconds: float, action) -> None:  # type: ignore[no-untyped-def]
        """Open loop: start ``action`` on schedule, whether or not earlier ones have answered."""
        tasks, start, n = [], time.perf_counter(), 0
        while (due := start + n / per_s) < start + seconds:
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            tasks.append(asyncio.create_task(action()))
            n += 1
        await asyncio.gather(*tasks)

    async def viewer(self, job_id: str, stop: asyncio.Event, counts: list[int]) -> None:
        try:
            async with self.client.stream("GET", f"/v1/jobs/{job_id}/events", timeout=None) as response:
                async for line in response.aiter_lines():
                    if line.startswith("id: "):
                        counts.append(1)
                    if stop.is_set():
                        return
        except httpx.HTTPError as exc:
            self.errors[f"viewer: {type(exc).__name__}"] = self.errors.get(f"viewer: {type(exc).__name__}", 0) + 1

    async def phase(self, seconds: float, submit_rate: float, list_rate: float, viewers: int, job: str | None) -> dict[str, Any]:
        submits: list[float] = []
        lists: list[float] = []
        stop, counts = asyncio.Event(), []
        streams = [asyncio.create_task(self.viewer(job, stop, counts)) for _ in range(viewers if job else 0)]
        await asyncio.sleep(1.0 if streams else 0)
        started = time.time()
        await asyncio.gather(
            self.every(submit_rate, seconds, lambda: self.submit(submits)),
            self.every(list_rate, seconds, lambda: self.timed("list", "GET", "/v1/jobs", lists, params={"limit": 50})),
        )
        ended = time.time()
        stop.set()
        for task in streams:
            task.cancel()
        await asyncio.gather(*streams, return_exceptions=True)
        return {"submit": summary(submits), "list": summary(lists), "viewers": viewers if job else 0,
                "viewer_events": len(counts), "window": (started, ended)}

    async def run(self) -> dict[str, Any]:
        upload = await self.client.post("/v1/files", files={"file": ("load.jsonl", DATASET)}, data={"purpose": "train"})
        upload.raise_for_status()
        self.file_id = upload.json()["id"]
        await self.submit([])  # warm-up, not measured: the first submission starts the preflight's tokenizer pool
        watch = self.args.watch
        steps_before = await self.steps(watch)
        idle = await self.phase(self.args.idle_seconds, 1, 2, 0, None)
        steps_idle = await self.steps(watch)
        if watch is None and self.submitted:
            watch = self.submitted[0]
        load = await self.phase(self.args.seconds, self.args.rate, 5, self.args.viewers, watch)
        steps_load = await self.steps(self.args.watch)
        await self.cancel_all()
        result = {"idle": idle, "load": load, "errors": self.errors, "last_error": self.last_error, "submitted": len(self.submitted),
                  "args": {k: v for k, v in vars(self.args).items() if k != "key"}}
        if self.args.watch:
            result["step_ms"] = {"idle": _median_new(steps_before, steps_idle), "load": _median_new(steps_idle, steps_load)}
        await self.client.aclose()
        return result

    async def steps(self, job: str | None) -> dict[int, float]:
        if job is None:
            return {}
        response = await self.client.get(f"/v1/jobs/{job}/metrics", params={"limit": 1000})
        return {r["step"]: r["step_ms"] for r in response.json().get("data", []) if r.get("step_ms")}

    async def cancel_all(self) -> None:
        sem = asyncio.Semaphore(20)

        async def cancel(job_id: str) -> None:
            async with sem:
                try:
                    await self.client.post(f"/v1/jobs/{job_id}/cancel")
                except httpx.HTTPError:
                    pass

        await asyncio.gather(*(cancel(j) for j in self.submitted))


def _median_new(before: dict[int, float], after: dict[int, float]) -> float | None:
    new = [ms for step, ms in after.items() if step not in before]
    return statistics.median(new) if new else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", required=True)
    parser.add_argument("--key", required=True)
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--watch", help="a running job for the viewers and the step-time figure")
    parser.add_argument("--rate", type=float, default=20.0, help="submissions per second under load")
    parser.add_argument("--viewers", type=int, default=100)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--idle-seconds", type=float, default=10.0)
    parser.add_argument("--json", help="also write the result here")
    args = parser.parse_args()
    result = asyncio.run(Load(args).run())
    for phase in ("idle", "load"):
        r = result[phase]
        print(f"{phase:5} submit p50 {r['submit']['p50_ms']} ms p99 {r['submit']['p99_ms']} ms (n={r['submit']['n']}) | "
              f"list p50 {r['list']['p50_ms']} ms p99 {r['list']['p99_ms']} ms (n={r['list']['n']}) | "
              f"viewers {r['viewers']} events {r['viewer_events']}")
    if "step_ms" in result:
        print(f"trainer step_ms median: idle {result['step_ms']['idle']}, load {result['step_ms']['load']}")
    print(f"errors: {result['errors'] or 'none'}; submitted {result['submitted']} (all cancelled)")
    if result['last_error']:
        print(f"last error: {result['last_error']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2, default=str)


if __name__ == "__main__":
    main()
