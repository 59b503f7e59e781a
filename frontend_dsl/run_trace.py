"""What one program run did, and when: its trace.

The executor tells a ``RunRecorder`` when each node starts and ends, what each
generation cost (prompt, cached and computed tokens, output and speculated tokens, the
constraint's verdict) and how long each tool call took. ``RunTrace`` joins that record
with the request graph and exports it:

- ``to_json()``: one JSON document (format ``arbor.run_trace/1``, below);
- ``to_otel_spans()``: an OpenTelemetry-compatible span list (OTLP/JSON field names,
  ``runtime.trace.otel``, which ``arbor trace`` uses too), and
  ``emit_otel(tracer)`` sends the same spans through the ``opentelemetry`` SDK when a user
  has it installed (no collector needed: any span processor/exporter they configure);
- ``to_svg()``: a timeline (``runtime.trace.timeline``): nodes as bars on a time axis,
  one lane per stream (fork branches as lanes), the cached share of each prompt shaded.

Times are seconds from the run's start (``started_at`` is its wall-clock time). A
stream's span runs from its first node's start to its last node's end; a branch starts
after its fork node ended and ends before its join node starts (the executor runs a
node only when its dependencies are done), so spans nest: node ⊂ stream ⊂ parent stream.

Format ``arbor.run_trace/1``::

    {"format", "program", "started_at", "duration_s", "status": "ok"|"failed", "error",
     "streams": [{"id", "parent", "fork_node", "children", "leaf", "start_s", "end_s"}],
     "nodes": [{"id", "kind", "stream", "deps", "label", "start_s", "end_s", "error",
                # gen / tool_call:
                "name", "prompt_tokens", "cached_tokens", "computed_tokens",
                "pool_cached_tokens", "tier_cached_tokens",  # cached = pool + tier
                "output_tokens", "draft_tokens", "accepted_tokens", "forced_tokens",
                "finish_reason", "constraint", "valid", "validation_error",
                # tool_call: "tool": {"name", "start_s", "end_s", "ok", "error"}
                # select: "name", "choice", "num_choices"; fork / join: "branches"}],
     "totals": {...sums over the nodes...}}
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any

from frontend_dsl.graph import Graph, Node, node_label

TRACE_FORMAT = "arbor.run_trace/1"
_GEN_COUNTS = ("prompt_tokens", "cached_tokens", "pool_cached_tokens", "tier_cached_tokens",
               "computed_tokens", "output_tokens",
               "draft_tokens", "accepted_tokens", "forced_tokens")


@dataclasses.dataclass
class NodeRecord:
    """What the executor reported about one node (perf-counter seconds)."""

    started: float | None = None
    ended: float | None = None
    error: str | None = None
    details: dict[str, Any] = dataclasses.field(default_factory=dict)


class RunRecorder:
    """Collects node timings of one run. Written on the DSL loop thread only; read once
    the run has ended (``RunTrace.build``)."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.started_at = time.time()
        self.records: dict[int, NodeRecord] = {}

    def _since(self) -> float:
        return time.perf_counter() - self.t0

    def start(self, node: Node) -> None:
        self.records.setdefault(node.id, NodeRecord()).started = self._since()

    def end(self, node: Node, error: BaseException | None) -> None:
        record = self.records.setdefault(node.id, NodeRecord())
        record.ended = self._since()
        if error is not None:
            record.error = f"{type(error).__name__}: {error}"

    def generated(self, node: Node, meta: dict[str, Any]) -> None:
        """A generation finished; ``meta`` is the executor's ``_gen_meta``."""
        prompt, cached = meta["prompt_len"], meta["num_cached_tokens"]
        # NOTE: of the cached tokens, those the backend reloaded from a host tier (0 without one)
        tier = meta.get("num_tier_cached_tokens", 0)
        check = meta.get("constraint_check") or {}
        self.records.setdefault(node.id, NodeRecord()).details.update({
            "prompt_tokens": prompt, "cached_tokens": cached, "computed_tokens": prompt - cached,
            "pool_cached_tokens": cached - tier, "tier_cached_tokens": tier,
            "output_tokens": meta["num_output_tokens"],
            "draft_tokens": meta.get("num_draft_tokens", 0),
            "accepted_tokens": meta.get("num_accepted_tokens", 0),
            "forced_tokens": meta.get("num_forced_tokens", 0),
            "finish_reason": meta["finish_reason"], "valid": check.get("valid"),
            "validation_error": check.get("error")})

    def tool_called(self, node: Node, name: str | None, started: float, ended: float,
                    error: str | None) -> None:
        """A tool call ran from ``started`` to ``ended`` (``time.perf_counter()``)."""
        self.records.setdefault(node.id, NodeRecord()).details["tool"] = {
            "name": name, "start_s": started - self.t0, "end_s": ended - self.t0,
            "ok": error is None, "error": error}


@dataclasses.dataclass(frozen=True)
class RunTrace:
    """The trace of one run, as the JSON document described in the module docstring."""

    data: dict[str, Any]

    @classmethod
    def build(cls, graph: Graph, recorder: RunRecorder) -> RunTrace:
        """Join ``graph`` (its nodes so far) with what ``recorder`` saw."""
        nodes = [_node_json(n, recorder.records.get(n.id, NodeRecord())) for n in graph.nodes]
        ends = [n["end_s"] for n in nodes if n["end_s"] is not None]
        errors = [n["error"] for n in nodes if n["error"] is not None]
        return cls({
            "format": TRACE_FORMAT, "program": graph.name, "started_at": recorder.started_at,
            "duration_s": max(ends, default=0.0), "status": "failed" if errors else "ok",
            "error": errors[0] if errors else None,
            "streams": _streams(graph, nodes), "nodes": nodes, "totals": _totals(nodes)})

    def to_json(self) -> dict[str, Any]:
        return self.data

    def to_json_str(self, indent: int | None = 2) -> str:
        return json.dumps(self.data, indent=indent, default=str)

    def leaves(self) -> list[dict[str, Any]]:
        """The streams that forked no further (the search tree's leaves)."""
        return [s for s in self.data["streams"] if s["leaf"]]

    def to_svg(self) -> str:
        from runtime.trace.timeline import render_timeline  # NOTE: lazy, as every runtime import of
        # the DSL: `import frontend_dsl` loads nothing of the engine side

        return render_timeline(self.data)

    def to_otel_spans(self) -> list[dict[str, Any]]:
        """Spans in OTLP/JSON shape: the run, one per stream, one per node (and tool call).

        Ids are derived from the run's start time and the program's name, so one trace's
        ids are stable across exports.
        """
        from runtime.trace.otel import otel_spans

        return otel_spans(self.data)

    def emit_otel(self, tracer: Any = None) -> int:
        """Send the spans through the ``opentelemetry`` API (``tracer``: default, the
        global provider's tracer "arbor"). Returns the number of spans emitted.

        Raises:
            ModuleNotFoundError: ``opentelemetry`` is not installed.
        """
        from opentelemetry import trace as otel_trace

        from runtime.trace.otel import otel_value

        tracer = tracer or otel_trace.get_tracer("arbor")
        spans = self.to_otel_spans()
        live: dict[str, Any] = {}
        for span in spans:  # parents come before their children
            parent = live.get(span["parentSpanId"])
            context = otel_trace.set_span_in_context(parent) if parent is not None else None
            live[span["spanId"]] = tracer.start_span(
                span["name"], context=context, start_time=span["startTimeUnixNano"],
                attributes={a["key"]: otel_value(a["value"]) for a in span["attributes"]})
        for span in reversed(spans):
            live[span["spanId"]].end(end_time=span["endTimeUnixNano"])
        return len(spans)


def _node_json(node: Node, record: NodeRecord) -> dict[str, Any]:
    out: dict[str, Any] = {"id": node.id, "kind": node.kind, "stream": node.stream_id,
                           "deps": list(node.deps), "label": node_label(node),
                           "start_s": record.started, "end_s": record.ended, "error": record.error}
    attrs = node.attrs
    if node.kind in ("gen", "tool_call", "select"):
        out["name"] = attrs.get("name")
    if node.kind in ("gen", "tool_call"):
        out.update({k: 0 for k in _GEN_COUNTS})
        out.update({"finish_reason": None, "valid": None, "validation_error": None,
                    "constraint": attrs.get("constraint")})
    if node.kind in ("fork", "join"):
        out["branches"] = list(attrs["branches"])
    if node.kind == "select":
        out["num_choices"] = len(attrs.get("choices", []))
        out["choice"] = node.done.result() if _succeeded(node) else None
    out.update(record.details)
    return out


def _succeeded(node: Node) -> bool:
    return node.done.done() and not node.done.cancelled() and node.done.exception() is None


def _streams(graph: Graph, nodes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per stream: its parent (through the fork that made it) and its span."""
    streams: dict[int, dict[str, Any]] = {0: {"id": 0, "parent": None, "fork_node": None, "children": []}}
    for node in graph.nodes:
        if node.kind == "fork":
            for branch in node.attrs["branches"]:
                streams[branch] = {"id": branch, "parent": node.stream_id, "fork_node": node.id,
                                   "children": []}
                streams[node.stream_id]["children"].append(branch)
    for sid, stream in streams.items():
        own = [n for n in nodes if n["stream"] == sid and n["start_s"] is not None]
        stream["start_s"] = 0.0 if sid == 0 else min((n["start_s"] for n in own), default=None)
        stream["end_s"] = max((n["end_s"] for n in own if n["end_s"] is not None), default=None)
        stream["leaf"] = sid != 0 and not stream["children"]
    return [streams[k] for k in sorted(streams)]


def _totals(nodes: list[dict[str, Any]]) -> dict[str, Any]:
    gens = [n for n in nodes if n["kind"] in ("gen", "tool_call")]
    tools = [n["tool"] for n in nodes if "tool" in n]
    totals: dict[str, Any] = {"nodes": len(nodes), "generations": len(gens),
                              "selects": sum(n["kind"] == "select" for n in nodes)}
    totals.update({k: sum(n[k] for n in gens) for k in _GEN_COUNTS})
    totals["invalid_outputs"] = sum(n["valid"] is False for n in gens)
    totals["tool_calls"] = len(tools)
    totals["tool_seconds"] = sum(t["end_s"] - t["start_s"] for t in tools)
    return totals
