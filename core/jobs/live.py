"""Live event notifications over Redis pub/sub.

The worker publishes ``{"seq": N}`` on ``channel(job_id)`` after the events up to seq N are
committed; live viewers (the SSE endpoint) treat it as a wake-up and read the events from
the store, so a missed message costs latency, never data. Without Redis, viewers poll.
"""

from __future__ import annotations

import json


def channel(job_id: str) -> str:
    return f"ftq:jobs:{job_id}:events"


def message(seq: int) -> str:
    return json.dumps({"seq": seq})


def parse_message(data: bytes | str) -> int | None:
    try:
        return int(json.loads(data)["seq"])
    except (ValueError, KeyError, TypeError):
        return None
