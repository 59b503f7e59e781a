"""The retention hint on /generate and /v1/chat/completions: honoured per tenant, bounded
(TTL cap → 400), and namespaced so one tenant's session id never names another's."""

from __future__ import annotations

import time
from typing import Any

import pytest
from server_helpers import auth

HINT = {"session_id": "conv-1", "ttl_s": 30}
GENERATE = {"text": "Hello there, how are you", "sampling_params": {"max_new_tokens": 3, "temperature": 0}}
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0}


def retained(engine: Any) -> float:
    return float(engine.metrics()["kv_pages_retained"])


def end(engine: Any, session_id: str) -> None:
    engine.end_session(session_id)
    deadline = time.monotonic() + 10
    while session_id in engine.cache.retention.sessions and time.monotonic() < deadline:
        time.sleep(0.01)
    assert session_id not in engine.cache.retention.sessions


def test_generate_hint_pins_under_the_tenants_namespace(http: Any, idle_engine: Any) -> None:
    before = retained(idle_engine)
    r = http.post("/generate", json={**GENERATE, "retention": HINT}, headers={**auth(), "X-Tenant": "acme"})
    assert r.status_code == 200, r.text
    assert idle_engine.wait_idle(30)
    session = idle_engine.cache.retention.sessions["acme/conv-1"]
    assert session.owner == "acme" and retained(idle_engine) > before
    end(idle_engine, "acme/conv-1")
    assert retained(idle_engine) == before


def test_chat_hint_pins_the_conversation(http: Any, idle_engine: Any) -> None:
    r = http.post("/v1/chat/completions", json={**CHAT, "retention": HINT, "user": "globex"})
    assert r.status_code == 200, r.text
    assert idle_engine.wait_idle(30)
    assert "globex/conv-1" in idle_engine.cache.retention.sessions
    end(idle_engine, "globex/conv-1")


def test_anonymous_caller_gets_its_own_owner(http: Any, idle_engine: Any) -> None:
    r = http.post("/generate", json={**GENERATE, "retention": HINT})
    assert r.status_code == 200, r.text
    assert idle_engine.wait_idle(30)
    assert idle_engine.cache.retention.sessions["anonymous/conv-1"].owner == "anonymous"
    end(idle_engine, "anonymous/conv-1")


@pytest.mark.parametrize("hint, message", [
    ({"session_id": "s", "ttl_s": 10_000}, "at most 600 seconds"),
    ({"session_id": "s", "ttl_s": 0}, "more than 0"),
    ({"session_id": "s", "ttl_s": -1}, "more than 0"),
    ({"session_id": "", "ttl_s": 5}, "session_id"),
    ({"session_id": "x" * 129, "ttl_s": 5}, "session_id"),
])
@pytest.mark.parametrize("path, body", [("/generate", GENERATE), ("/v1/chat/completions", CHAT)])
def test_bad_hints_are_a_400(http: Any, idle_engine: Any, path: str, body: dict[str, Any],
                             hint: dict[str, Any], message: str) -> None:
    r = http.post(path, json={**body, "retention": hint})
    assert r.status_code == 400, r.text
    assert message in r.text
    assert not idle_engine.cache.retention.sessions


def test_delete_ends_a_session_now_within_the_tenant(http: Any, idle_engine: Any) -> None:
    before = retained(idle_engine)
    acme, globex = {**auth(), "X-Tenant": "acme"}, {**auth(), "X-Tenant": "globex"}
    r = http.post("/generate", json={**GENERATE, "retention": {"session_id": "early", "ttl_s": 300}},
                  headers=acme)
    assert r.status_code == 200, r.text
    assert idle_engine.wait_idle(30)
    pinned = retained(idle_engine) - before
    assert pinned > 0
    r = http.delete("/sessions/early", headers=globex)  # another tenant: not its session
    assert r.status_code == 404, r.text
    assert "acme/early" in idle_engine.cache.retention.sessions
    r = http.delete("/sessions/early", headers=acme)
    assert r.status_code == 200, r.text
    assert r.json() == {"session_id": "early", "pages_released": pinned}
    assert retained(idle_engine) == before  # released before the answer, not on a later step
    assert http.delete("/sessions/early", headers=acme).status_code == 404  # ended already


def test_delete_of_an_unknown_or_malformed_session(http: Any, idle_engine: Any) -> None:
    r = http.delete("/sessions/never-seen", headers=auth())
    assert r.status_code == 404 and "never-seen" in r.text
    r = http.delete("/sessions/" + "x" * 129, headers=auth())
    assert r.status_code == 400 and "session_id" in r.text
