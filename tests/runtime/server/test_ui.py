"""``/ui``: the page behind the API key (header or login cookie), its live JSON, the
recent program runs with their traces and timelines; latency labels by prompt bucket and
tenant in ``/metrics``. (The page itself in a real browser: ``test_ui_browser.py``.)"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from server_helpers import API_KEY, LiveServer, samples

from frontend_dsl import gen, program
from runtime.server import create_app
from runtime.server.metrics import LatencyWindow, prompt_bucket
from runtime.server.tenant_labels import TenantLabels
from runtime.server.tenants import tenant_of


def test_ui_needs_the_key_and_a_login_sets_a_cookie_for_ui_paths_only(server: Any) -> None:
    with httpx.Client(base_url=server.url, timeout=30) as anon:
        page = anon.get("/ui")
        assert page.status_code == 401 and 'name="key"' in page.text  # the login form
        assert anon.get("/ui/api/live").status_code == 401
        for bad in ('arbor_ui="unterminated', "arbor_ui=" + API_KEY, "arbor_ui"):
            assert anon.get("/ui/api/live", headers={"cookie": bad}).status_code == 401
        wrong = anon.post("/ui/login", data={"key": "nope"})
        assert wrong.status_code == 401 and "Wrong key" in wrong.text
        assert "arbor_ui" not in anon.cookies
        ok = anon.post("/ui/login", data={"key": API_KEY})
        assert ok.status_code == 303 and ok.headers["location"] == "/ui"
        assert API_KEY not in anon.cookies["arbor_ui"]  # a derived token, never the key
        assert "<title>Arbor — live</title>" in anon.get("/ui").text
        assert anon.get("/ui/api/live").status_code == 200
        assert anon.get("/ui/static/ui.js").headers["content-type"].startswith("text/javascript")
        assert anon.get("/v1/models").status_code == 401  # the cookie opens /ui only
        assert anon.get("/ui/static/../app.py").status_code == 404
        assert anon.get("/ui/static/nope.js").status_code == 404


def test_live_figures_report_engine_state(http: Any, idle_engine: Any) -> None:
    before = http.get("/ui/api/live").json()  # NOTE: the app is shared: count what this test adds
    assert http.post("/generate", json={"text": "Hello there", "sampling_params": {
        "max_new_tokens": 4, "temperature": 0, "ignore_eos": True}}).status_code == 200
    live = http.get("/ui/api/live").json()
    kv = live["kv_pages"]
    assert kv["used"] + kv["evictable"] + kv["free"] == kv["total"] > 0
    assert kv["evictable"] > 0  # the finished request's prefix stays cached
    assert live["requests"]["running"] == 0
    assert live["requests"]["finished"] - before["requests"]["finished"] == 1
    ttft, old_ttft = live["latency"]["60s"]["ttft"], before["latency"]["60s"]["ttft"]
    assert ttft["count"] - old_ttft["count"] == 1 and 0 < ttft["p50"] <= ttft["p95"] <= ttft["p99"]
    assert live["latency"]["60s"]["itl"]["count"] - before["latency"]["60s"]["itl"]["count"] == 3
    assert set(live["programs"]) == {"qa", "two_steps", "long_story", "fan_out"}
    assert 0 <= live["prefix_cache"]["hit_rate"] <= 1


def test_program_runs_are_kept_with_their_trace_and_timeline(http: Any) -> None:
    r = http.post("/programs/two_steps", json={"arguments": {"topic": "owls"}, "trace": True})
    assert r.status_code == 200, r.text
    body = r.json()
    trace = body["trace"]
    assert trace["format"] == "arbor.run_trace/1" and trace["program"] == "two_steps"
    gens = [n for n in trace["nodes"] if n["kind"] == "gen"]
    assert [g["name"] for g in gens] == ["first", "second"]
    assert all(g["output_tokens"] > 0 and g["prompt_tokens"] > 0 and g["end_s"] > g["start_s"] for g in gens)
    assert gens[1]["cached_tokens"] > 0  # the second gen continues the first's prefix
    got = samples(http.get("/metrics").text)
    gen_ttft = [v for (name, labels), v in got.items() if name == "arbor_time_to_first_token_seconds_count"
                and ("endpoint", "program_gen") in labels]
    assert sum(gen_ttft) >= 2  # the run's generations are timed like HTTP requests
    runs = http.get("/ui/api/runs").json()["runs"]
    assert runs[0]["run_id"] == body["run_id"] and runs[0]["status"] == "ok"
    assert runs[0]["totals"]["generations"] == 2
    assert http.get(f"/ui/api/runs/{body['run_id']}").json()["trace"] == trace
    svg = http.get(f"/ui/api/runs/{body['run_id']}/timeline.svg")
    assert svg.headers["content-type"].startswith("image/svg+xml")
    assert svg.text.count('class="node node-gen"') == 2
    missing = http.get("/ui/api/runs/run-999999/timeline.svg")
    assert missing.status_code == 404 and "no recent run" in missing.json()["error"]["message"]


@program
def fails_after_a_gen(s: Any, topic: str) -> None:
    """Generates, then raises."""
    s += "Topic: " + topic + gen("x", max_tokens=2, temperature=0)
    if s["x"] is not None:
        raise ValueError("the program gave up")


def test_a_failed_run_is_listed_as_failed_with_its_partial_trace(engine: Any) -> None:
    app = create_app(engine, programs={"fails_after_a_gen": fails_after_a_gen})
    with LiveServer(app) as live, httpx.Client(base_url=live.url, timeout=30) as client:
        r = client.post("/programs/fails_after_a_gen", json={"arguments": {"topic": "owls"}})
        assert r.status_code == 500 and "the program gave up" in r.json()["error"]["message"]
        run = client.get("/ui/api/runs").json()["runs"][0]
        assert run["status"] == "failed" and "the program gave up" in run["error"]
        trace = client.get(f"/ui/api/runs/{run['run_id']}").json()["trace"]
        assert [n["kind"] for n in trace["nodes"]] == ["text", "gen"] and trace["nodes"][1]["output_tokens"] > 0
        assert client.get(f"/ui/api/runs/{run['run_id']}/timeline.svg").status_code == 200


def test_the_ui_runs_programs_with_the_cookie(server: Any) -> None:
    with httpx.Client(base_url=server.url, timeout=30) as browser:
        browser.post("/ui/login", data={"key": API_KEY})
        with browser.stream("POST", "/ui/api/programs/qa",
                            json={"arguments": {"question": "Hi?"}, "stream": True}) as r:
            assert r.status_code == 200
            events = [json.loads(line[6:]) for line in r.iter_lines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
        assert events[-1]["event"] == "result" and events[-1]["run_id"].startswith("run-")
        assert browser.post("/programs/qa", json={"arguments": {"question": "Hi?"}}).status_code == 401


def test_latency_histograms_carry_prompt_bucket_and_tenant(http: Any) -> None:
    request = {"model": "m", "prompt": "Hi", "max_tokens": 2, "temperature": 0}

    def counts() -> list[float]:
        got = samples(http.get("/metrics").text)
        keys = [(("endpoint", "completions"), ("prompt_bucket", "0-128"), ("tenant", tenant))
                for tenant in ("acme", "globex")]
        return [got.get(("arbor_time_to_first_token_seconds_count", key), 0.0) for key in keys]

    before = counts()  # NOTE: the app is shared: count what this test adds
    assert http.post("/v1/completions", json={**request, "user": "acme"}).status_code == 200
    assert http.post("/v1/completions", json=request, headers={"X-Tenant": "globex"}).status_code == 200
    assert [a - b for a, b in zip(counts(), before, strict=True)] == [1, 1]


def test_tenant_rule_and_bounded_labels() -> None:
    assert tenant_of({"x-tenant": "t1"}, "u") == "t1"  # the header wins
    assert tenant_of({}, "u") == "u"
    assert tenant_of({}, None) is None
    labels = TenantLabels(max_labels=2)
    assert [labels.label(t) for t in ("a", "b", "c", "a", None, "bad label!", "other")] == [
        "a", "b", "other", "a", "none", "other", "other"]


def test_latency_window_percentiles_use_recent_samples_only(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [1000.0]
    monkeypatch.setattr("runtime.server.metrics.time.monotonic", lambda: clock[0])
    window = LatencyWindow(window_s=300.0)
    window.observe(9.0)  # old: outside the 60 s window, inside the 300 s one
    clock[0] += 100
    for v in range(1, 101):
        window.observe(v / 1000)
    window.observe(0.5, count=3)
    recent = window.percentiles(60.0)
    assert recent["count"] == 103 and recent["p50"] == 0.052 and recent["p99"] == 0.5
    assert window.percentiles()["count"] == 104 and window.percentiles()["p99"] == 0.5
    clock[0] += 1000
    assert window.percentiles() == {"count": 0, "p50": None, "p95": None, "p99": None}


@pytest.mark.parametrize(("prompt_len", "bucket"), [
    (0, "0-128"), (128, "0-128"), (129, "129-512"), (2048, "513-2048"), (8193, ">8192")])
def test_prompt_buckets(prompt_len: int, bucket: str) -> None:
    assert prompt_bucket(prompt_len) == bucket


def test_without_a_key_the_page_is_open(engine: Any) -> None:
    with LiveServer(create_app(engine)) as live, httpx.Client(base_url=live.url, timeout=30) as anon:
        assert anon.get("/ui").status_code == 200
        assert anon.post("/ui/login", data={"key": ""}).status_code == 303
        assert anon.get("/ui/api/runs").json() == {"runs": []}
