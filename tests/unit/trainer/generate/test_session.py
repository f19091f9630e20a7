"""``trainer.generate.session``: a chat session's requests in on a pipe, its ``reply`` events out.

On the tiny Llama with a random LoRA adapter (one session serving the base and the adapter): the
greedy tokens a session streams equal ``Engine.generate``'s for the same prompt ids, an over-long
request is refused naming its field, a cancel ends a request, an idle session ends by itself and a
stop lets the running request finish (drain) before the session ends.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest

from trainer.generate.session import IDLE, STOPPED, run_session
from trainer.generate.session_config import BASE, SessionConfig

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")]
MESSAGES = [{"role": "user", "content": "What is 2 plus 2?"}]


@pytest.fixture(scope="module")
def adapter_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    config = peft.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", init_lora_weights=False)
    out = tmp_path_factory.mktemp("adapter")
    peft.get_peft_model(model, config).save_pretrained(out)
    return out


class Running:
    """A session on a thread: ``send`` writes a line to its stdin, ``replies`` are its reply events."""

    def __init__(self, config: SessionConfig) -> None:
        read_fd, write_fd = os.pipe()
        self.inbox, self._out = os.fdopen(read_fd, "r"), os.fdopen(write_fd, "w")
        self.events: list[tuple[str, dict]] = []
        self.stop = threading.Event()
        self.result: str | None = None
        self._thread = threading.Thread(target=self._run, args=(config,), daemon=True)
        self._thread.start()

    def _run(self, config: SessionConfig) -> None:
        self.result = run_session(config, lambda t, **p: self.events.append((t, p)), self.inbox, self.stop,
                                  poll_s=0.02)

    def send(self, **message: object) -> None:
        self._out.write(json.dumps(message) + "\n")
        self._out.flush()

    def replies(self, request_id: str, timeout: float = 60.0) -> list[dict]:
        """Its replies once it finished (every choice's last delta, or an error)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = [p for t, p in list(self.events) if t == "reply" and p.get("id") == request_id]
            n = next((p.get("n", 1) for p in got if p["kind"] == "accepted"), 1)
            if any(p["kind"] == "error" for p in got) or sum(p.get("finish_reason") is not None for p in got) >= n:
                return got
            time.sleep(0.01)
        raise AssertionError(f"request {request_id} did not finish: {got}")

    def join(self, timeout: float = 30.0) -> str | None:
        self._thread.join(timeout)
        self._out.close()  # the session's reader sees the end of its stdin and stops
        deadline = time.monotonic() + 5
        while any(t.name == "session-inbox" for t in threading.enumerate()) and time.monotonic() < deadline:
            time.sleep(0.01)
        self.inbox.close()
        return self.result


def _tokens(replies: list[dict], choice: int = 0) -> list[int]:
    return [t for r in replies if r["kind"] == "delta" and r["choice"] == choice for t in r["token_ids"]]


def test_greedy_replies_equal_the_engines_tokens_for_the_base_and_the_adapter(tiny_model_dir, adapter_dir):
    from trainer.generate.chat import render_messages
    from trainer.generate.engine import Engine
    from trainer.generate.params import BASE_ADAPTER, Request, SamplingParams
    from trainer.generate.session import load_session_model

    config = SessionConfig(model=str(tiny_model_dir), adapters={"a0": str(adapter_dir)}, slots=2, max_len=64,
                           device="cpu", idle_timeout_s=60)
    session = Running(config)
    params = {"max_tokens": 12, "temperature": 0.0, "logprobs": True, "top_logprobs": 2}
    session.send(op="request", id="r-base", adapter=BASE, messages=MESSAGES, params=params)
    session.send(op="request", id="r-tuned", adapter="a0", messages=MESSAGES, params=params)
    base, tuned = session.replies("r-base"), session.replies("r-tuned")
    session.stop.set()
    assert session.join() == STOPPED

    model, tokenizer = load_session_model(config, __import__("torch").device("cpu"))
    ids = tuple(render_messages(tokenizer, MESSAGES))
    engine = Engine(model, tokenizer, slots=1, max_len=64)
    want = {name: engine.generate([Request(ids, SamplingParams(max_tokens=12, temperature=0.0), adapter=name)])[0]
            for name in (BASE_ADAPTER, "a0")}
    assert _tokens(base) == want[BASE_ADAPTER].completions[0].token_ids
    assert _tokens(tuned) == want["a0"].completions[0].token_ids
    assert _tokens(base) != _tokens(tuned), "the adapter changes the answer"
    assert "".join(r["text"] for r in tuned if r["kind"] == "delta") == want["a0"].completions[0].text
    accepted = next(r for r in base if r["kind"] == "accepted")
    assert accepted["prompt_tokens"] == len(ids)
    logprobs = [e for r in base if r["kind"] == "delta" for e in r["logprobs"]]
    assert len(logprobs) == len(_tokens(base)) and all(len(e["top"]) == 2 for e in logprobs)
    ready = [p for t, p in session.events if t == "reply" and p["kind"] == "ready"]
    assert ready and ready[0]["adapters"] == [BASE, "a0"]


def test_refuses_a_prompt_beyond_the_context_and_an_unknown_adapter_naming_the_field(tiny_model_dir):
    session = Running(SessionConfig(model=str(tiny_model_dir), max_len=16, device="cpu"))
    session.send(op="request", id="long", adapter=BASE, prompt="one two three four five six seven",
                 params={"max_tokens": 12})
    session.send(op="request", id="who", adapter="nobody", prompt="hi", params={})
    session.send(op="request", id="bad", adapter=BASE, prompt="hi", params={"top_p": 0})
    (long,), (who,), (bad,) = session.replies("long"), session.replies("who"), session.replies("bad")
    session.stop.set()
    session.join()
    assert (long["code"], long["param"]) == ("context_length_exceeded", "prompt")
    assert "maximum context length is 16 tokens" in long["message"]
    assert (who["code"], who["param"]) == ("model_not_found", "model")
    assert (bad["code"], bad["param"]) == ("invalid_value", "top_p")


def test_a_cancel_ends_a_request_and_an_idle_session_ends_by_itself(tiny_model_dir):
    session = Running(SessionConfig(model=str(tiny_model_dir), max_len=2048, device="cpu", idle_timeout_s=0.5))
    session.send(op="request", id="long", adapter=BASE, prompt="Once",
                 params={"max_tokens": 2000, "ignore_eos": True, "temperature": 0.0})
    while not any(p.get("kind") == "delta" for _, p in list(session.events)):
        time.sleep(0.01)
    session.send(op="cancel", id="long")
    last = session.replies("long")[-1]
    assert last["finish_reason"] == "cancelled"
    assert session.join(timeout=30) == IDLE


def test_a_stop_drains_the_running_request_then_refuses_new_ones(tiny_model_dir):
    session = Running(SessionConfig(model=str(tiny_model_dir), max_len=256, device="cpu", drain_s=30))
    session.send(op="request", id="running", adapter=BASE, prompt="Once",
                 params={"max_tokens": 40, "ignore_eos": True, "temperature": 0.0})
    while not any(p.get("kind") == "accepted" for _, p in list(session.events)):
        time.sleep(0.01)
    session.stop.set()
    time.sleep(0.1)
    session.send(op="request", id="late", adapter=BASE, prompt="hi", params={})
    assert session.replies("late")[-1]["code"] == "session_ending"
    assert session.replies("running")[-1]["finish_reason"] == "length", "drained: it finished, not cancelled"
    assert len(_tokens(session.replies("running"))) == 40
    assert session.join() == STOPPED
