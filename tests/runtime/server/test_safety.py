"""Bad requests get a 4xx with a message and the server keeps serving; API key; size
limits; the bounded queue answers 429 rather than growing."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from server_helpers import LiveServer

from runtime.server import ServerLimits, create_app
from runtime.server.limits import AdmissionGate, Overloaded

GOOD = {"text": "Hello", "sampling_params": {"max_new_tokens": 2, "temperature": 0}}


def test_api_key_guards_every_route_but_health(server: Any) -> None:
    assert httpx.get(server.url + "/health").status_code == 200
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "test-key"}):
        for method, path in (("POST", "/generate"), ("GET", "/metrics"), ("GET", "/v1/models"),
                             ("GET", "/programs"), ("POST", "/programs/qa")):
            r = httpx.request(method, server.url + path, headers=headers, json=GOOD)
            assert r.status_code == 401, (method, path, headers)
            assert "API key" in r.json()["error"]["message"]


@pytest.mark.parametrize(("body", "status", "message"), [
    (b'{"text": "Hello", ', 400, "malformed JSON"),
    ({"text": "Hi", "sampling_params": {"max_new_tokens": "lots"}}, 422, "sampling_params.max_new_tokens"),
    ({"text": "Hi", "sampling_params": {"bogus": 1}}, 400, "unknown field: sampling_params.bogus"),
    ({"text": "Hi", "input_ids": [1]}, 422, "exactly one of text or input_ids"),
    ({"text": "Hi", "sampling_params": {"temperature": -1}}, 400, "temperature must be >= 0"),
    ({"input_ids": [1, 10**9]}, 400, "input_ids must be integers"),
    ({"text": "Hi", "sampling_params": {"max_new_tokens": 100_000}}, 400, "at most 256"),
    ({"text": "word " * 600, "sampling_params": {"max_new_tokens": 4}}, 400, "maximum context length"),
    ({"text": "Hi", "sampling_params": {"max_new_tokens": 4, "constraint": {"json_schema": {"type": "nonsense"}}}},
     400, "schema"),
    ({"text": "Hi", "sampling_params": {"max_new_tokens": 4, "constraint": {"regex": "a(b"}}}, 400, "regex"),
    ({"text": "Hi", "sampling_params": {"constraint": {"regex": "a", "choices": ["a"]}}}, 422, "exactly one"),
])
def test_bad_generate_requests_are_4xx_and_the_server_keeps_serving(
        http: Any, body: Any, status: int, message: str) -> None:
    if isinstance(body, bytes):
        r = http.post("/generate", content=body, headers={"Content-Type": "application/json"})
    else:
        r = http.post("/generate", json=body)
    assert r.status_code == status, r.text
    assert message in r.json()["error"]["message"]
    assert http.post("/generate", json=GOOD).status_code == 200


@pytest.mark.parametrize(("body", "status", "message"), [
    ({"model": "m", "messages": []}, 422, "messages"),
    ({"model": "m", "messages": [{"role": "wizard", "content": "x"}]}, 422, "role"),
    ({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**6}, 400, "at most"),
    ({"model": "m", "messages": [{"role": "user", "content": "hi"}], "n": 99}, 400, "n is 99"),
    ({"model": "m", "messages": [{"role": "user", "content": "hi"}],
      "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}}, 400, "schema"),
    ({"model": "m", "prompt": "word " * 600, "max_tokens": 4}, 400, "maximum context length"),
])
def test_bad_openai_requests_are_4xx(http: Any, body: dict[str, Any], status: int, message: str) -> None:
    path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
    r = http.post(path, json=body)
    assert r.status_code == status, r.text
    assert message in r.json()["error"]["message"]


def test_oversize_body_is_413(http: Any) -> None:
    r = http.post("/generate", json={"text": "x" * 300_000})
    assert r.status_code == 413 and "exceeds" in r.json()["error"]["message"]
    chunked = http.post("/generate", content=iter([b'{"text": "', b"x" * 300_000, b'"}']),
                        headers={"Content-Type": "application/json"})
    assert chunked.status_code == 413
    assert http.post("/generate", json=GOOD).status_code == 200


def test_full_server_answers_429_and_recovers(engine: Any) -> None:
    app = create_app(engine, limits=ServerLimits(max_inflight=1, max_tokens=256), model_name="m")
    long = {"text": "Hi", "stream": True,
            "sampling_params": {"max_new_tokens": 250, "temperature": 0, "ignore_eos": True}}
    with LiveServer(app) as live, httpx.Client(base_url=live.url, timeout=30) as c:
        with c.stream("POST", "/generate", json=long) as first:
            assert first.status_code == 200
            lines = first.iter_lines()  # NOTE: keep it referenced: a dropped one closes the connection
            next(lines)
            refused = c.post("/generate", json=GOOD)
            assert refused.status_code == 429 and "too many requests" in refused.json()["error"]["message"]
        assert engine.wait_idle(5)
        assert c.post("/generate", json=GOOD).status_code == 200


def test_admission_gate_limits() -> None:
    gate = AdmissionGate(ServerLimits(max_inflight=2, max_waiting=1))
    gate.admit()
    gate.num_waiting = 1
    with pytest.raises(Overloaded) as err:
        gate.admit()
    assert err.value.status == 503
    gate.num_waiting = 0
    gate.admit()
    with pytest.raises(Overloaded) as err:
        gate.admit()
    assert err.value.status == 429
    gate.release()
    gate.closing = True
    with pytest.raises(Overloaded) as err:
        gate.admit()
    assert err.value.status == 503


@pytest.mark.parametrize(("path", "raw"), [
    ("/generate", b'{"text": "a\\udcffb", "sampling_params": {"max_new_tokens": 2}}'),
    ("/v1/completions", b'{"model": "m", "prompt": "\\ud800", "max_tokens": 2}'),
    ("/v1/chat/completions", b'{"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "x\\uDFFF"}]}'),
    ("/tokenize", b'{"text": "\\udcff"}'),
    ("/programs/qa", b'{"arguments": {"question": "\\udcff"}}'),
])
def test_a_lone_surrogate_is_a_400_not_a_500(http: Any, path: str, raw: bytes) -> None:
    r = http.post(path, content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    assert "lone UTF-16 surrogate" in r.json()["error"]["message"]
    paired = raw.replace(b"\\udcff", b"\\ud83d\\ude00").replace(b"\\ud800", b"\\ud83d\\ude00")
    if paired != raw:  # a surrogate *pair* is an ordinary character (an emoji)
        assert http.post(path, content=paired, headers={"Content-Type": "application/json"}).status_code == 200


def test_engine_refuses_a_lone_surrogate_with_a_typed_error(engine: Any) -> None:
    from runtime.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="lone UTF-16 surrogate"):
        engine.add_request("a\udcff")


def test_an_unknown_model_is_a_404(http: Any) -> None:
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                       ("/v1/completions", {"prompt": "hi"})):
        r = http.post(path, json={**body, "model": "gpt-17", "max_tokens": 2})
        assert r.status_code == 404, r.text
        assert r.json()["error"]["type"] == "model_not_found"
        assert "'gpt-17' does not exist" in r.json()["error"]["message"]
        assert http.post(path, json={**body, "model": "m", "max_tokens": 2}).status_code == 200
        assert http.post(path, json={**body, "max_tokens": 2}).status_code == 200  # no model: the served one
    assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["m"]


@pytest.mark.parametrize(("path", "body", "message"), [
    ("/apply_chat_template", {"messages": []}, "no messages"),
    ("/apply_chat_template", {"messages": [{"role": "user"}]}, "chat template cannot render"),
    ("/apply_chat_template", {"messages": [{"role": "user", "content": 5}]}, "chat template cannot render"),
    ("/v1/chat/completions", {"model": "m", "max_tokens": 2, "messages": [
        {"role": "assistant", "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": "00"}}]}]},
     "function.arguments is not JSON"),
])
def test_fuzzer_found_500s_are_now_400s(http: Any, path: str, body: dict[str, Any], message: str) -> None:
    r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]["message"]
