"""A program run's trace (``arbor.run_trace/1``, see ``frontend_dsl.run_trace``) as
OpenTelemetry spans, in OTLP/JSON shape: no SDK needed to write them, and
``otlp_document`` wraps them as an ``ExportTraceServiceRequest`` that an OpenTelemetry
collector's OTLP/JSON file or HTTP receiver reads as is.

Span tree: the run; under it one span per fork branch (nested under its parent branch);
under each stream its nodes; under a tool-call node its tool call. Ids are derived from
the run's start time and program name, so exporting one trace twice gives the same ids.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

SPAN_KIND_INTERNAL = 1
STATUS_OK, STATUS_ERROR = 1, 2


def otel_spans(trace: dict[str, Any]) -> list[dict[str, Any]]:
    """The spans of a trace document (see ``RunTrace.to_otel_spans``), parents first."""
    t0_ns = int(trace["started_at"] * 1e9)
    seed = f"{trace['program']}:{trace['started_at']!r}"
    trace_id = hashlib.sha256(seed.encode()).hexdigest()[:32]

    def span_id(key: str) -> str:
        return hashlib.sha256(f"{seed}:{key}".encode()).hexdigest()[:16]

    def span(key: str, name: str, parent: str | None, start: float, end: float,
             attrs: dict[str, Any], error: str | None = None) -> dict[str, Any]:
        return {"traceId": trace_id, "spanId": span_id(key), "parentSpanId": span_id(parent) if parent else "",
                "name": name, "kind": SPAN_KIND_INTERNAL, "startTimeUnixNano": t0_ns + int(start * 1e9),
                "endTimeUnixNano": t0_ns + int(end * 1e9),
                "attributes": [{"key": k, "value": otel_attr(v)} for k, v in attrs.items() if v is not None],
                "status": {"code": STATUS_ERROR, "message": error} if error else {"code": STATUS_OK}}

    spans = [span("run", f"program {trace['program']}", None, 0.0, trace["duration_s"],
                  {"arbor.program": trace["program"], **{f"arbor.{k}": v for k, v in trace["totals"].items()}},
                  trace["error"])]
    for stream in trace["streams"]:
        if stream["id"] == 0 or stream["start_s"] is None:
            continue
        parent = "run" if stream["parent"] == 0 else f"stream{stream['parent']}"
        spans.append(span(f"stream{stream['id']}", f"branch {stream['id']}", parent, stream["start_s"],
                          stream["end_s"] if stream["end_s"] is not None else stream["start_s"],
                          {"arbor.stream": stream["id"], "arbor.fork_node": stream["fork_node"]}))
    for node in trace["nodes"]:
        if node["start_s"] is None or node["end_s"] is None:
            continue
        parent = "run" if node["stream"] == 0 else f"stream{node['stream']}"
        attrs = {f"arbor.{k}": v for k, v in node.items()
                 if k not in ("id", "label", "start_s", "end_s", "error", "tool", "deps")}
        spans.append(span(f"node{node['id']}", node["label"], parent, node["start_s"], node["end_s"],
                          {"arbor.node": node["id"], **attrs}, node["error"]))
        tool = node.get("tool")
        if tool is not None:
            spans.append(span(f"tool{node['id']}", f"tool {tool['name']}", f"node{node['id']}",
                              tool["start_s"], tool["end_s"], {"arbor.tool": tool["name"]}, tool["error"]))
    return spans


def otel_attr(value: Any) -> dict[str, Any]:
    """An OTLP/JSON ``AnyValue``; dicts and lists travel as JSON strings."""
    if isinstance(value, bool):
        return {"boolValue": value}
    if isinstance(value, int):
        return {"intValue": str(value)}  # NOTE: OTLP/JSON writes 64-bit ints as strings
    if isinstance(value, float):
        return {"doubleValue": value}
    if isinstance(value, str):
        return {"stringValue": value}
    return {"stringValue": json.dumps(value, default=str)}


def otel_value(any_value: dict[str, Any]) -> Any:
    (kind, value), = any_value.items()
    return int(value) if kind == "intValue" else value


def otlp_document(spans: list[dict[str, Any]], service_name: str = "arbor") -> dict[str, Any]:
    """``spans`` as one OTLP/JSON ``ExportTraceServiceRequest``."""
    resource = {"attributes": [{"key": "service.name", "value": {"stringValue": service_name}}]}
    return {"resourceSpans": [{"resource": resource,
                               "scopeSpans": [{"scope": {"name": "arbor"}, "spans": spans}]}]}
