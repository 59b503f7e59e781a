"""Program run traces: node times that nest, token costs, tool calls, constraint verdicts,
and the exports (JSON, OpenTelemetry spans, SVG timeline)."""

from __future__ import annotations

import importlib.util
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from frontend_dsl import ProgramError, gen, program, select, tool, user
from frontend_dsl.fake_backend import FakeBackend

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def load_example(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(f"arbor_example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def check_nesting(trace: dict[str, Any]) -> None:
    """Every node runs after its dependencies; nodes lie inside their stream's span;
    a branch starts after its fork node and ends before its parent's join starts."""
    nodes = {n["id"]: n for n in trace["nodes"]}
    streams = {s["id"]: s for s in trace["streams"]}
    for n in nodes.values():
        assert n["start_s"] is not None and n["start_s"] <= n["end_s"] <= trace["duration_s"]
        for dep in n["deps"]:
            assert nodes[dep]["end_s"] <= n["start_s"], (dep, n["id"])
        stream = streams[n["stream"]]
        assert stream["start_s"] <= n["start_s"] and n["end_s"] <= stream["end_s"]
    for s in streams.values():
        if s["parent"] is None:
            continue
        assert nodes[s["fork_node"]]["end_s"] <= s["start_s"]
        joins = [n for n in nodes.values() if n["kind"] == "join" and s["id"] in n["branches"]]
        assert joins and all(s["end_s"] <= j["start_s"] for j in joins)
        parent = streams[s["parent"]]
        assert parent["start_s"] <= s["start_s"] and s["end_s"] <= parent["end_s"]


def test_tree_search_trace_has_nine_leaves_cached_branches_and_nested_times(engine: Any) -> None:
    """On the tiny random model and (slow) on the default one."""
    module = load_example("tree_search")
    state = module.tree_search.run(engine, task="Write a slogan for a bakery.", width=3, max_tokens=4)
    trace = json.loads(state.run_trace().to_json_str())  # what the JSON file holds
    assert trace["format"] == "arbor.run_trace/1" and trace["status"] == "ok"
    leaves = [s for s in trace["streams"] if s["leaf"]]
    assert len(leaves) == 9 and len(trace["streams"]) == 1 + 3 + 9
    assert all(streams_depth(trace, s["id"]) == 2 for s in leaves)
    gens = [n for n in trace["nodes"] if n["kind"] == "gen"]
    assert len(gens) == 12 and sum(n["kind"] == "select" for n in trace["nodes"]) == 9
    for g in gens:  # every gen runs on a branch, after its fork cached the shared prefix
        assert g["stream"] != 0 and 0 < g["cached_tokens"] <= g["prompt_tokens"]
        assert g["computed_tokens"] == g["prompt_tokens"] - g["cached_tokens"]
        # every cached token a pool hit: the engine has no host tier (yet)
        assert (g["pool_cached_tokens"], g["tier_cached_tokens"]) == (g["cached_tokens"], 0)
        assert 0 < g["output_tokens"] <= 4
    drafts = [g for g in gens if g["name"] == "draft"]
    ideas = {g["stream"]: g for g in gens if g["name"] == "idea"}
    for d in drafts:  # a draft's cached prefix covers its idea's whole prompt at least
        parent = next(s["parent"] for s in trace["streams"] if s["id"] == d["stream"])
        assert d["cached_tokens"] > ideas[parent]["prompt_tokens"]
    check_nesting(trace)
    totals = trace["totals"]
    assert totals["generations"] == 12 and totals["cached_tokens"] == sum(g["cached_tokens"] for g in gens)
    assert totals["pool_cached_tokens"] == totals["cached_tokens"] and totals["tier_cached_tokens"] == 0


def streams_depth(trace: dict[str, Any], sid: int) -> int:
    parents = {s["id"]: s["parent"] for s in trace["streams"]}
    depth = 0
    while parents[sid] is not None:
        sid, depth = parents[sid], depth + 1
    return depth


@tool
def slow_add(a: int, b: int) -> int:
    """Add, slowly."""
    time.sleep(0.05)
    return a + b


@program
def calls_a_tool(s: Any) -> None:
    s += "Action: " + gen("call", tools=[slow_add], max_tokens=64)


def test_tool_calls_are_timed(make_fake: Callable[..., FakeBackend]) -> None:
    backend = make_fake(lambda r: '{"name": "slow_add", "arguments": {"a": 2, "b": 3}}')
    trace = calls_a_tool.run(backend).run_trace().to_json()
    node = next(n for n in trace["nodes"] if n["kind"] == "tool_call")
    tool_span = node["tool"]
    assert tool_span["name"] == "slow_add" and tool_span["ok"] and tool_span["error"] is None
    assert tool_span["end_s"] - tool_span["start_s"] >= 0.05
    assert node["start_s"] <= tool_span["start_s"] <= tool_span["end_s"] <= node["end_s"]
    assert node["constraint"]["kind"] == "json_schema"
    assert trace["totals"]["tool_calls"] == 1 and trace["totals"]["tool_seconds"] >= 0.05


@program
def constrained(s: Any) -> None:
    s += user("Pick.") + gen("code", regex="[ab]{3}", max_tokens=8, temperature=0)
    s += select("verdict", ["yes", "no"])


def test_constraint_verdict_speculation_and_select_are_recorded(tiny_engine: Any) -> None:
    trace = constrained.run(tiny_engine).run_trace().to_json()
    g = next(n for n in trace["nodes"] if n["kind"] == "gen")
    assert g["constraint"] == {"kind": "regex", "value": "[ab]{3}"}
    assert g["output_tokens"] >= 1 and g["finish_reason"] == "stop" and g["valid"] is True
    assert 0 <= g["accepted_tokens"] <= g["draft_tokens"] and g["forced_tokens"] <= g["draft_tokens"]
    sel = next(n for n in trace["nodes"] if n["kind"] == "select")
    assert sel["choice"] in ("yes", "no") and sel["num_choices"] == 2


@program
def fails(s: Any) -> None:
    s += "x" + gen("a", max_tokens=2)
    if s["a"] is not None:
        raise ValueError("gave up")


def test_a_failed_run_keeps_its_partial_trace(make_fake: Callable[..., FakeBackend]) -> None:
    with pytest.raises(ProgramError) as caught:
        fails.run(make_fake())
    state = caught.value.state
    trace = state.run_trace().to_json()  # type: ignore[attr-defined]
    assert [n["kind"] for n in trace["nodes"]] == ["text", "gen"]
    assert trace["nodes"][1]["output_tokens"] == 2


def test_otel_spans_form_one_tree_and_go_through_the_sdk(make_fake: Callable[..., FakeBackend]) -> None:
    module = load_example("tree_search")
    run_trace = module.tree_search.run(make_fake(), task="t", width=2, max_tokens=2).run_trace()
    spans = run_trace.to_otel_spans()
    ids = {s["spanId"] for s in spans}
    assert len(ids) == len(spans) and len({s["traceId"] for s in spans}) == 1
    roots = [s for s in spans if not s["parentSpanId"]]
    assert len(roots) == 1 and all(s["parentSpanId"] in ids for s in spans if s is not roots[0])
    by_id = {s["spanId"]: s for s in spans}
    for s in spans[1:]:  # a child lies inside its parent
        parent = by_id[s["parentSpanId"]]
        assert parent["startTimeUnixNano"] <= s["startTimeUnixNano"] <= s["endTimeUnixNano"] <= parent["endTimeUnixNano"]
    assert sum(s["name"].startswith("branch") for s in spans) == 2 + 4
    from opentelemetry.sdk import trace as sdk  # the dev extra installs it
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = sdk.TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    assert run_trace.emit_otel(provider.get_tracer("test")) == len(spans)
    finished = exporter.get_finished_spans()
    assert len(finished) == len(spans) and len({s.context.trace_id for s in finished}) == 1
    root = next(s for s in finished if s.parent is None)
    assert root.name == "program tree_search" and root.attributes["arbor.generations"] == 6
    assert {s.name for s in finished} == {s["name"] for s in spans}


def test_svg_timeline_draws_every_run_node_in_its_lane(make_fake: Callable[..., FakeBackend]) -> None:
    module = load_example("tree_search")
    trace = module.tree_search.run(make_fake(), task="t", width=2, max_tokens=2).run_trace()
    svg = trace.to_svg()
    assert svg.startswith("<svg") and svg.rstrip().endswith("</svg>")
    assert svg.count('<g class="node ') == len(trace.to_json()["nodes"])
    assert svg.count(">branch ") == 6 and 'class="cached"' in svg
    import xml.etree.ElementTree as ET

    ET.fromstring(svg)  # well-formed XML
