"""The playground in Chromium on the embedded stack (SQLite store and relay, one local worker): the base
in both columns, one message, and both answers stream side by side from the chat session the first
request started, each with its tokens, time to first token and tokens/s; greedy, so the two are the
same text. A second message continues each column's conversation: the request carries the first
message and that column's own answer before the new one, and the first turn stays on the page. The
session is ended at the end so the single worker is free for the next test."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.fixtures.stack import Stack

pytestmark = [pytest.mark.integration, pytest.mark.browser]


def test_two_columns_stream_side_by_side_and_keep_their_conversations(page: Any, dashboard_stack: Stack,
                                                            api: httpx.Client) -> None:
    model = dashboard_stack.model
    try:
        page.goto("/#/playground")
        page.get_by_test_id("playground-model-a").select_option(model)
        page.get_by_test_id("playground-model-b").select_option(model)
        page.get_by_test_id("playground-temperature").fill("0")
        page.get_by_test_id("playground-max-tokens").fill("8")
        page.get_by_test_id("playground-message").fill("Tell me a story.")
        page.get_by_test_id("playground-send").click()
        for column in (0, 1):
            stats = page.get_by_test_id(f"playground-stats-{column}")
            stats.and_(page.locator("[data-tokens]")).wait_for(timeout=180_000)
            assert "tokens/s" in stats.inner_text() and "first token" in stats.inner_text()
            assert int(stats.get_attribute("data-tokens")) > 0
        texts = [page.get_by_test_id(f"playground-text-{column}").inner_text() for column in (0, 1)]
        assert texts[0] == texts[1] and texts[0], texts

        page.get_by_test_id("playground-message").fill("And then?")
        with page.expect_request(lambda r: r.url.endswith("/openai/v1/chat/completions")) as sent:
            page.get_by_test_id("playground-send").click()
        assert json.loads(sent.value.post_data)["messages"] == [
            {"role": "user", "content": "Tell me a story."},
            {"role": "assistant", "content": texts[0]},
            {"role": "user", "content": "And then?"},
        ]
        for column in (0, 1):
            stats = page.get_by_test_id(f"playground-stats-{column}")
            stats.and_(page.locator("[data-tokens]")).wait_for(timeout=180_000)
            assert page.get_by_test_id(f"playground-text-{column}-1").inner_text() == texts[0]
            assert page.get_by_test_id(f"playground-user-{column}-2").inner_text() == "And then?"
        assert page.get_by_test_id("playground-message").input_value() == ""
    finally:
        for session in api.get("/v1/sessions").json()["data"]:
            api.delete(f"/v1/sessions/{session['id']}")
