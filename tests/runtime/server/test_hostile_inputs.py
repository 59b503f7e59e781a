"""The hostile-input probe: malformed, oversized and adversarial requests on every route
that takes a body (OpenAI chat and completions, native /generate, /programs), and on the
HTTP layer below them (invalid UTF-8, oversized headers, a stalled body). Every answer is
a 4xx with a message or a 2xx that the API documents (docs/operations-limits.md), never a
5xx, and the server stays healthy with sound page accounting afterwards.
"""

from __future__ import annotations

import json
import socket
import time
from typing import Any

import httpx
import pytest
from server_helpers import API_KEY, LiveServer

from runtime.server import ServerLimits, create_app

CHAT, COMPLETIONS, GENERATE = "/v1/chat/completions", "/v1/completions", "/generate"
USER = [{"role": "user", "content": "hi"}]


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": USER, "max_tokens": 4, **fields}


def schema_chat(schema: Any) -> dict[str, Any]:
    return chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})


def schema_tool(schema: Any) -> dict[str, Any]:
    return chat(tools=[{"type": "function", "function": {"name": "f", "parameters": schema}}],
                tool_choice="required")


def schema_generate(schema: Any) -> dict[str, Any]:
    return {"text": "hi", "sampling_params": {"max_new_tokens": 4, "constraint": {"json_schema": schema}}}


def nested_schema(levels: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


SELF_REF = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}
MUTUAL_REF = {"$ref": "#/$defs/a", "$defs": {"a": {"allOf": [{"$ref": "#/$defs/b"}]}, "b": {"$ref": "#/$defs/a"}}}
DEEP = nested_schema(200)

# (name, path, JSON body, expected status, a word the error message holds)
CASES: list[tuple[str, str, Any, int, str]] = [
    # the issue's cases: a self-referencing $ref and a schema nested 200 levels deep, on
    # every path that takes a schema
    ("self $ref, response_format", CHAT, schema_chat(SELF_REF), 400, "$ref cycle"),
    ("self $ref, tools", CHAT, schema_tool(SELF_REF), 400, "$ref cycle"),
    ("self $ref, /generate", GENERATE, schema_generate(SELF_REF), 400, "$ref cycle"),
    ("mutual $ref via allOf", GENERATE, schema_generate(MUTUAL_REF), 400, "$ref cycle"),
    ("200-deep schema, response_format", CHAT, schema_chat(DEEP), 400, "schema_max_depth"),
    ("200-deep schema, tools", CHAT, schema_tool(DEEP), 400, "schema_max_depth"),
    ("200-deep schema, /generate", GENERATE, schema_generate(DEEP), 400, "schema_max_depth"),
    ("200-deep schema, completions", COMPLETIONS, {"model": "m", "prompt": "hi", "max_tokens": 2,
     "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": DEEP}}}, 400, "too deep"),
    ("empty enum", GENERATE, schema_generate({"enum": []}), 400, "anyOf is empty"),
    ("minLength > maxLength", GENERATE, schema_generate({"type": "string", "minLength": 5, "maxLength": 2}),
     400, "Unsatisfiable"),
    ("conflicting allOf", GENERATE, schema_generate({"allOf": [{"type": "string"}, {"type": "integer"}]}),
     400, "Unsatisfiable"),
    ("remote $ref", GENERATE, schema_generate({"$ref": "http://example.com/s.json"}), 400, "non-local $ref"),
    ("dangling $ref", GENERATE, schema_generate({"$ref": "#/$defs/nope"}), 400, "does not exist"),
    ("look-behind pattern", GENERATE, schema_generate({"type": "string", "pattern": "(?<=a)b"}), 400, "look"),
    ("schema of the wrong type", CHAT, schema_chat([1, 2]), 422, "dictionary"),
    ("regex of a million repeats", GENERATE, {"text": "x", "sampling_params": {
        "max_new_tokens": 4, "constraint": {"regex": "a{1000000}"}}}, 400, "constraint"),
    ("empty choice list", GENERATE, {"text": "x", "sampling_params": {
        "max_new_tokens": 4, "constraint": {"choices": []}}}, 400, "empty"),
    ("broken Lark grammar", GENERATE, {"text": "x", "sampling_params": {
        "max_new_tokens": 4, "constraint": {"grammar": "start: ("}}}, 400, "line 1"),
    # sizes and counts
    ("huge n", CHAT, chat(n=10**9), 400, "at most"),
    ("huge max_tokens", CHAT, chat(max_tokens=10**12), 400, "at most"),
    ("max_tokens past 64 bits", CHAT, chat(max_tokens=2**70), 400, "at most"),
    ("negative max_tokens", CHAT, chat(max_tokens=-1), 422, "greater than or equal"),
    ("n = 0", CHAT, chat(n=0), 422, "greater than or equal"),
    ("huge top_logprobs", CHAT, chat(logprobs=True, top_logprobs=10**6), 422, "less than or equal"),
    ("huge presence_penalty", CHAT, chat(presence_penalty=1e9), 400, "presence_penalty"),
    ("top_p 2", CHAT, chat(top_p=2), 400, "top_p"),
    ("prompt token id past the vocabulary", COMPLETIONS, {"model": "m", "prompt": [10**10], "max_tokens": 2},
     400, "input_ids"),
    ("prompt over the context", GENERATE, {"text": "word " * 600, "sampling_params": {"max_new_tokens": 2}},
     400, "context length"),
    # logit_bias: refused whole, whatever the ids
    ("logit_bias, id past the vocabulary", CHAT, chat(logit_bias={"999999999": 5}), 400, "logit_bias"),
    ("logit_bias, negative id", CHAT, chat(logit_bias={"-1": 5}), 400, "logit_bias"),
    ("logit_bias, id not a number", CHAT, chat(logit_bias={"abc": 5}), 400, "logit_bias"),
    # wrong types and shapes
    ("max_tokens as a string", CHAT, chat(max_tokens="5"), 422, "max_tokens"),
    ("stream as a string", CHAT, chat(stream="true"), 422, "stream"),
    ("n as a boolean", CHAT, chat(n=True), 422, "n"),
    ("temperature as a string", CHAT, chat(temperature="0.5"), 422, "temperature"),
    ("user content null", CHAT, {"model": "m", "messages": [{"role": "user", "content": None}]}, 422, "needs content"),
    ("messages empty", CHAT, {"model": "m", "messages": []}, 422, "at least 1"),
    ("messages a string", CHAT, {"model": "m", "messages": "hi"}, 422, "list"),
    ("unknown role", CHAT, {"model": "m", "messages": [{"role": "wizard", "content": "x"}]}, 422, "role"),
    ("nested arrays as content", CHAT, {"model": "m", "messages": [{"role": "user", "content": [[[["x"]]]]}]},
     422, "content"),
    ("image content part", CHAT, {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "image_url"),
    ("tool without a function", CHAT, chat(tools=[{"type": "function"}]), 422, "function"),
    ("tool_choice names no tool", CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}],
     tool_choice={"type": "function", "function": {"name": "g"}}), 400, "not in tools"),
    ("body a JSON list", CHAT, [1, 2], 422, "dictionary"),
    ("body a JSON string", CHAT, "hello", 422, "dictionary"),
    ("text a nested list", GENERATE, {"text": [[["a"]]]}, 422, "string"),
    ("empty input_ids", GENERATE, {"input_ids": []}, 400, "empty"),
    ("unknown native field", GENERATE, {"text": "x", "sampling_params": {"min_new_tokenz": 1}}, 400,
     "unknown field: sampling_params.min_new_tokenz"),
    ("unknown OpenAI field", CHAT, chat(foo=1), 400, "unknown field: foo"),
    ("program arguments wrong", "/programs/qa", {"arguments": {"nope": 1}}, 422, "nope"),
    ("program arguments a list", "/programs/qa", {"arguments": [1]}, 422, "dictionary"),
    ("program negative timeout", "/programs/qa", {"arguments": {}, "timeout": -1}, 422, "greater than"),
    ("unknown program", "/programs/nope", {"arguments": {}}, 404, "no program"),
]

# (name, path, raw body, expected status, a word the error message holds)
RAW_CASES: list[tuple[str, str, bytes, int, str]] = [
    ("temperature NaN", CHAT, b'{"model":"m","messages":[{"role":"user","content":"hi"}],"temperature":NaN}',
     400, "temperature"),
    ("top_p Infinity", CHAT, b'{"model":"m","messages":[{"role":"user","content":"hi"}],"top_p":Infinity}',
     400, "top_p"),
    ("trailing garbage", CHAT, b'{"model":"m","messages":[{"role":"user","content":"hi"}]} xyz', 400, "JSON"),
    ("invalid UTF-8", CHAT, b'{"model":"m","messages":[{"role":"user","content":"h\xff\xfei"}]}', 400, "parsing"),
    ("100,000 nested arrays", CHAT, b"[" * 100_000 + b"]" * 100_000, 400, "parsing"),
    ("nested objects past the body limit", CHAT, b'{"a":' * 50_000 + b"1" + b"}" * 50_000, 413, "exceeds"),
    ("lone surrogate", GENERATE, b'{"text":"\\udcff"}', 400, "surrogate"),
    ("empty body", CHAT, b"", 422, "body"),
]

# Lenient parses that are documented extensions (docs/operations-limits.md), answered 200.
EXTENSIONS: list[tuple[str, str, Any]] = [
    ("no model: the served one", CHAT, {"messages": USER, "max_tokens": 2}),
    ("OpenAI fields that cannot change the answer are ignored", CHAT, chat(store=True, metadata={"a": "b"})),
    ("max_tokens 0: an empty completion", CHAT, chat(max_tokens=0)),
    ("more than 4 stop strings", CHAT, chat(stop=[f"s{i}" for i in range(50)])),
    ("unknown schema keywords are annotations", GENERATE,
     schema_generate({"type": "string", "contentEncoding": "base64", "x-vendor": 1})),
    ("recursion through properties compiles", GENERATE, schema_generate(
        {"$ref": "#/$defs/n", "$defs": {"n": {"type": "object", "properties": {
            "kids": {"type": "array", "items": {"$ref": "#/$defs/n"}}}}}})),
]


@pytest.fixture(scope="module")
def probe_server(engine: Any, programs: dict[str, Any]) -> Any:
    limits = ServerLimits(max_inflight=64, max_body_bytes=256 * 1024, max_tokens=256,
                          request_timeout_s=30.0, body_timeout_s=1.0)
    app = create_app(engine, programs=programs, api_key=API_KEY, limits=limits, model_name="m")
    with LiveServer(app) as live:
        yield live


@pytest.fixture()
def client(probe_server: LiveServer) -> Any:
    with httpx.Client(base_url=probe_server.url, headers={"Authorization": f"Bearer {API_KEY}"},
                      timeout=60) as c:
        yield c


def assert_refused(r: httpx.Response, status: int, word: str) -> None:
    assert r.status_code == status, r.text[:500]
    message = r.json()["error"]["message"]
    assert word.lower() in message.lower(), message


@pytest.mark.parametrize(("name", "path", "body", "status", "word"), CASES, ids=[c[0] for c in CASES])
def test_hostile_body_gets_a_4xx_naming_the_problem(client: Any, name: str, path: str, body: Any,
                                                    status: int, word: str) -> None:
    assert_refused(client.post(path, json=body), status, word)


@pytest.mark.parametrize(("name", "path", "raw", "status", "word"), RAW_CASES, ids=[c[0] for c in RAW_CASES])
def test_malformed_bytes_get_a_4xx(client: Any, name: str, path: str, raw: bytes, status: int, word: str) -> None:
    r = client.post(path, content=raw, headers={"Content-Type": "application/json"})
    assert_refused(r, status, word)


@pytest.mark.parametrize(("name", "path", "body"), EXTENSIONS, ids=[c[0] for c in EXTENSIONS])
def test_documented_extensions_are_served(client: Any, name: str, path: str, body: Any) -> None:
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text[:500]


def test_duplicate_keys_take_the_last_value(client: Any) -> None:
    """RFC 8259 leaves duplicate names to the receiver; Python's JSON keeps the last."""
    raw = b'{"model":"m","model":"other","messages":[{"role":"user","content":"hi"}],"max_tokens":2}'
    r = client.post(CHAT, content=raw, headers={"Content-Type": "application/json"})
    assert_refused(r, 404, "'other'")


def raw_exchange(url: str, request: bytes, read_timeout: float = 10.0) -> bytes:
    """Send ``request`` on a fresh socket; what came back before the server closed or
    ``read_timeout`` passed."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=read_timeout) as sock:
        sock.sendall(request)
        chunks = []
        try:
            while chunk := sock.recv(65536):
                chunks.append(chunk)
                if b"\r\n\r\n" in b"".join(chunks) and len(b"".join(chunks)) > 200:
                    break
        except (TimeoutError, ConnectionResetError):
            pass  # NOTE: a server that refuses before reading everything resets the socket
    return b"".join(chunks)


def status_of(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1])


def test_oversized_headers_get_a_4xx(probe_server: LiveServer) -> None:
    """uvicorn (h11) refuses a header block past 16 KiB with a 400, then closes; the
    socket may be reset before the answer is read (the rest was never read), never a 5xx."""
    request = (b"POST /generate HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 200_000 +
               b"\r\nContent-Length: 2\r\n\r\n{}")
    answer = raw_exchange(probe_server.url, request)
    assert answer == b"" or 400 <= status_of(answer) < 500, answer[:200]
    assert httpx.get(probe_server.url + "/health", timeout=5).status_code == 200


def test_garbage_request_line_gets_a_4xx(probe_server: LiveServer) -> None:
    answer = raw_exchange(probe_server.url, b"\x16\x03\x01\x02\x00 not http at all\r\n\r\n")
    assert 400 <= status_of(answer) < 500, answer[:200]


def test_a_stalled_body_is_answered_408_while_others_are_served(probe_server: LiveServer) -> None:
    """Slow loris: headers promise 1,000 bytes, 10 arrive, then nothing; the server
    answers 408 after body_timeout_s (1 s here) and serves everyone else meanwhile."""
    host, port = probe_server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        start = time.monotonic()
        sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + API_KEY.encode()
                     + b"\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n" + b'{"text": "')
        assert httpx.get(probe_server.url + "/health", timeout=5).status_code == 200
        answer = sock.recv(65536)
        elapsed = time.monotonic() - start
    assert status_of(answer) == 408, answer[:300]
    assert b"did not arrive within 1 s" in answer
    assert 0.9 < elapsed < 5, elapsed


def test_the_server_is_healthy_after_the_probe(client: Any, engine: Any) -> None:
    for name, path, body, _, _ in CASES[:10]:  # the schema cases once more, back to back
        assert client.post(path, json=body).status_code < 500, name
    assert client.get("/health").status_code == 200
    r = client.post(GENERATE, json={"text": "Hello", "sampling_params": {"max_new_tokens": 3, "temperature": 0}})
    assert r.status_code == 200 and len(r.json()["output_ids"]) == 3
    assert engine.wait_idle(30)
    engine.check_integrity()
    assert json.loads(client.get("/engine_metrics").text)["kv_pages_used"] == 0
