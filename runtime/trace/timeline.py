"""A program run's trace (``arbor.run_trace/1``, see ``frontend_dsl.run_trace``) as an
SVG timeline. Pure Python, no dependencies: the server draws it for ``/ui`` and ``arbor
trace`` writes it next to the JSON.

Layout: one lane per stream, the root first and each fork's branches right below their
parent (depth-first), so a fork fans out into lanes and a join gathers them back. Each
node is a bar from its start to its end on a shared time axis; gen and tool-call bars
carry a strip along their bottom edge split by the prompt's cached share (shaded) and
computed share, so the prefix reuse of a fork's branches is visible at a glance.

    label column | 0           50           100   (time, ms)
    stream 0     | [text][gen a ][fork]               [join]
      branch 1   |                   [text][gen b    ]
      branch 2   |                   [text][gen b  ]
"""

from __future__ import annotations

import math
from typing import Any
from xml.sax.saxutils import escape

LANE_H = 24  # px per lane
BAR_H = 16
LABEL_W = 130  # px of the lane-name column
PLOT_W = 860
TOP = 34  # room for the title and the axis
KIND_COLORS = {"text": "#b8c0cc", "gen": "#3b82f6", "tool_call": "#f59e0b", "select": "#8b5cf6",
               "fork": "#334155", "join": "#334155"}
CACHED_COLOR = "#16a34a"
COMPUTED_COLOR = "#dc2626"


def lane_order(trace: dict[str, Any]) -> list[tuple[int, int]]:
    """``(stream id, depth)`` in drawing order: depth-first from the root."""
    streams = {s["id"]: s for s in trace["streams"]}
    order: list[tuple[int, int]] = []

    def visit(sid: int, depth: int) -> None:
        order.append((sid, depth))
        for child in streams[sid]["children"]:
            visit(child, depth + 1)

    if 0 in streams:
        visit(0, 0)
    return order


def nice_step(span: float, target_ticks: int = 6) -> float:
    """A 1/2/5 x 10^k tick step giving about ``target_ticks`` ticks over ``span``."""
    if span <= 0:
        return 1.0
    raw = span / target_ticks
    base = 10 ** math.floor(math.log10(raw))
    return next(m * base for m in (1, 2, 5, 10) if m * base >= raw)


def render_timeline(trace: dict[str, Any], width: int = LABEL_W + PLOT_W) -> str:
    """The SVG document (a string) of ``trace``."""
    lanes = lane_order(trace)
    row = {sid: i for i, (sid, _) in enumerate(lanes)}
    duration = max(trace.get("duration_s") or 0.0, 1e-6)
    plot_w = width - LABEL_W - 10
    height = TOP + LANE_H * len(lanes) + 40

    def x(t: float) -> float:
        return LABEL_W + plot_w * t / duration

    def y(sid: int) -> float:
        return TOP + LANE_H * row[sid]

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="11" class="arbor-timeline">',
             '<rect width="100%" height="100%" fill="#ffffff"/>',
             f'<text x="4" y="14" font-size="13" font-weight="bold">{escape(_title(trace))}</text>']
    parts += _axis(duration, x, TOP + LANE_H * len(lanes), plot_w)
    for sid, depth in lanes:
        label = "root" if sid == 0 else f"branch {sid}"
        parts.append(f'<text x="{4 + 10 * depth}" y="{y(sid) + 16}" fill="#334155">{escape(label)}</text>')
        parts.append(f'<line x1="{LABEL_W}" x2="{width - 10}" y1="{y(sid) + LANE_H - 2}" '
                     f'y2="{y(sid) + LANE_H - 2}" stroke="#eef2f7"/>')
    parts += _fork_links(trace, x, y)
    for node in trace["nodes"]:
        if node["start_s"] is not None and node["end_s"] is not None and node["stream"] in row:
            parts += _bar(node, x, y(node["stream"]))
    parts += _legend(TOP + LANE_H * len(lanes) + 26)
    parts.append("</svg>")
    return "\n".join(parts)


def _title(trace: dict[str, Any]) -> str:
    t = trace.get("totals", {})
    status = trace.get("status", "ok")
    return (f"{trace.get('program')}: {1000 * trace.get('duration_s', 0.0):.0f} ms, {status}; "
            f"{t.get('generations', 0)} gens, prompt {t.get('prompt_tokens', 0)} tok "
            f"({t.get('cached_tokens', 0)} cached), {t.get('output_tokens', 0)} out")


def _axis(duration: float, x: Any, bottom: float, plot_w: float) -> list[str]:
    step = nice_step(duration)
    parts = []
    for i in range(int(duration / step) + 1):
        t = i * step
        parts.append(f'<line x1="{x(t):.1f}" x2="{x(t):.1f}" y1="{TOP - 4}" y2="{bottom}" stroke="#e2e8f0"/>')
        if x(t) < LABEL_W + plot_w - 30:  # no label squeezed against the right edge
            parts.append(f'<text x="{x(t) + 2:.1f}" y="{TOP - 6}" fill="#64748b">{_fmt_time(t)}</text>')
    return parts


def _fmt_time(t: float) -> str:
    return f"{t:.2f} s" if t >= 1 else f"{1000 * t:.0f} ms"


def _fork_links(trace: dict[str, Any], x: Any, y: Any) -> list[str]:
    """Dashed lines from each fork node down to its branches' lanes."""
    nodes = {n["id"]: n for n in trace["nodes"]}
    parts = []
    for stream in trace["streams"]:
        fork = nodes.get(stream["fork_node"]) if stream["fork_node"] is not None else None
        if fork is None or fork["end_s"] is None:
            continue
        x0 = x(fork["end_s"])
        parts.append(f'<line x1="{x0:.1f}" x2="{x0:.1f}" y1="{y(stream["parent"]) + 12}" '
                     f'y2="{y(stream["id"]) + 12}" stroke="#94a3b8" stroke-dasharray="3,2"/>')
    return parts


def _bar(node: dict[str, Any], x: Any, top: float) -> list[str]:
    x0, x1 = x(node["start_s"]), x(node["end_s"])
    w = max(x1 - x0, 1.5)
    color = "#ef4444" if node.get("error") else KIND_COLORS.get(node["kind"], "#64748b")
    tip = escape(_tooltip(node))
    parts = [f'<g class="node node-{node["kind"]}" data-node="{node["id"]}">',
             f'<rect x="{x0:.1f}" y="{top + 2}" width="{w:.1f}" height="{BAR_H}" rx="2" fill="{color}">'
             f'<title>{tip}</title></rect>']
    prompt = node.get("prompt_tokens") or 0
    if node["kind"] in ("gen", "tool_call") and prompt:
        cached_w = w * node.get("cached_tokens", 0) / prompt
        parts.append(f'<rect x="{x0:.1f}" y="{top + BAR_H - 2}" width="{cached_w:.1f}" height="4" '
                     f'fill="{CACHED_COLOR}" class="cached"><title>{tip}</title></rect>')
        parts.append(f'<rect x="{x0 + cached_w:.1f}" y="{top + BAR_H - 2}" width="{w - cached_w:.1f}" '
                     f'height="4" fill="{COMPUTED_COLOR}" class="computed"><title>{tip}</title></rect>')
    tool = node.get("tool")
    if tool is not None:
        tx0, tx1 = x(tool["start_s"]), x(tool["end_s"])
        parts.append(f'<rect x="{tx0:.1f}" y="{top + 4}" width="{max(tx1 - tx0, 1.0):.1f}" height="{BAR_H - 8}" '
                     f'fill="#78350f"><title>tool {escape(str(tool["name"]))}: '
                     f'{1000 * (tool["end_s"] - tool["start_s"]):.1f} ms</title></rect>')
    if w > 7 * len(node["label"]) * 0.8:
        parts.append(f'<text x="{x0 + 3:.1f}" y="{top + 13}" fill="#ffffff" font-size="10" '
                     f'pointer-events="none">{escape(node["label"])}</text>')
    parts.append("</g>")
    return parts


def _tooltip(node: dict[str, Any]) -> str:
    ms = 1000 * (node["end_s"] - node["start_s"])
    lines = [f"#{node['id']} {node['label']}: {ms:.1f} ms"]
    if node["kind"] in ("gen", "tool_call"):
        lines.append(f"prompt {node['prompt_tokens']} = cached {node['cached_tokens']} + computed "
                     f"{node['computed_tokens']}; output {node['output_tokens']}")
        lines.append(f"drafts {node['draft_tokens']}, accepted {node['accepted_tokens']}, "
                     f"forced {node['forced_tokens']}; finish {node['finish_reason']}")
        if node.get("constraint") is not None:
            lines.append(f"constraint {node['constraint']}; valid {node['valid']}")
    if node.get("choice") is not None:
        lines.append(f"chose {node['choice']!r}")
    if node.get("error"):
        lines.append(f"error: {node['error']}")
    return "\n".join(lines)


def _legend(top: float) -> list[str]:
    items = [("text", KIND_COLORS["text"]), ("gen", KIND_COLORS["gen"]), ("select", KIND_COLORS["select"]),
             ("tool call", KIND_COLORS["tool_call"]), ("fork/join", KIND_COLORS["fork"]),
             ("prompt cached", CACHED_COLOR), ("prompt computed", COMPUTED_COLOR), ("failed", "#ef4444")]
    parts, x0 = [], LABEL_W
    for name, color in items:
        parts.append(f'<rect x="{x0}" y="{top - 9}" width="10" height="10" fill="{color}"/>')
        parts.append(f'<text x="{x0 + 14}" y="{top}" fill="#334155">{escape(name)}</text>')
        x0 += 24 + 7 * len(name)
    return parts

