"""Graceful shutdown of a real ``arbor serve`` process: SIGTERM stops admission, a short
request in flight finishes, a long one is aborted at the deadline, the process exits 0."""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_helpers import start_server


def stops_listening(url: str, within: float) -> bool:
    """Whether the server refuses new requests (connection refused or 503) within the time."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            httpx.post(url + "/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 1}},
                       timeout=5).raise_for_status()
        except httpx.HTTPError:
            return True
        time.sleep(0.02)
    return False


def read_stream(url: str, max_new_tokens: int, started: threading.Event, result: dict[str, Any]) -> None:
    body = {"text": "Hello", "stream": True, "sampling_params": {
        "max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True, "speculation": False}}
    tokens = 0
    try:
        with httpx.stream("POST", url + "/generate", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    event = json.loads(line[6:])
                    if "error" in event:
                        result["error_event"] = event["error"]["message"]
                    tokens += len(event.get("delta_token_ids", []))
                    result["finish_reason"] = event.get("finish_reason")
                    started.set()
                elif line == "data: [DONE]":
                    result["done"] = True
    except httpx.HTTPError as exc:  # cut by the server at the deadline
        result["error"] = repr(exc)
    result["tokens"] = tokens
    started.set()


LONG_TOKENS = 4000  # the server's default cap on max_new_tokens is 4,096


@pytest.mark.slow
def test_sigterm_drains_then_aborts_at_the_deadline_and_exits_0(tiny_llama_dir: Path) -> None:
    # NOTE: the long request must outlast the deadline on a fast machine too: 1,000 tokens of
    # the tiny model once finished inside it (a Zen 5 core, ~1.5 ms a token).
    proc, url = start_server(tiny_llama_dir, "--shutdown-timeout", "1.5", "--num-pages", "4400",
                             "--max-model-len", "4200")
    try:
        short: dict[str, Any] = {}
        long: dict[str, Any] = {}
        short_started, long_started = threading.Event(), threading.Event()
        threads = [threading.Thread(target=read_stream, args=(url, LONG_TOKENS, long_started, long)),
                   threading.Thread(target=read_stream, args=(url, 24, short_started, short))]
        threads[0].start()
        assert long_started.wait(30)
        threads[1].start()
        assert short_started.wait(30)
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert stops_listening(url, within=5), "still admitting requests 5 s after SIGTERM"
        for t in threads:
            t.join(30)
        code = proc.wait(30)
        elapsed = time.monotonic() - signalled
    finally:
        if proc.poll() is None:
            proc.kill()
    log = proc.stdout.read().decode() if proc.stdout else ""
    assert code == 0, log
    assert short.get("done") and short["finish_reason"] == "length" and short["tokens"] == 24, short
    # Aborted at the deadline, with a clean last event saying why.
    assert long["tokens"] < LONG_TOKENS and long.get("done"), long
    assert "the engine was closed" in long["error_event"], long
    assert elapsed < 1.5 + 10, elapsed  # the deadline, plus closing the engine
    assert "Traceback" not in log, log
