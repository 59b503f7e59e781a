r"""The request graph a program becomes.

Nodes are the program's operations; an edge ``a -> b`` means ``b`` needs ``a``'s result.
Every state (the root, each fork branch) is a *stream*: its nodes form a chain, because a
node continues the text its predecessor left. Forks and joins connect streams:

    root:   text -> gen -> fork ---------------------> join -> text
    branch 1:                 \-> text -> gen --------/
    branch 2:                  \-> text -> gen ------/

Independent chains (the branches) have no edges between them, so the executor runs them
at the same time and the backend batches them. A generated value that flows into a later
prompt is a ``var`` node with an edge from the node that made it (possibly in another
stream): the graph goes on past such reads.

``complete`` is False when tracing stopped at a use of a generated value in control flow
(``stop`` says which); the graph holds the operations before that use.
"""

from __future__ import annotations

import concurrent.futures
import json
from dataclasses import dataclass, field
from typing import Any, Literal

# text: constant text; var: the text of a variable's value (an edge from the node that
# defines it); set: ``s[name] = value``; capture: begin/end of a ``var_scope``.
NodeKind = Literal["text", "gen", "select", "fork", "join", "tool_call", "var", "set", "capture"]


@dataclass(eq=False)
class Node:
    """One operation of the program."""

    id: int  # position in Graph.nodes; set by Graph.add
    kind: NodeKind
    stream_id: int  # the state it belongs to (0 = the program's root state)
    deps: tuple[int, ...]  # ids of the nodes whose results it needs
    attrs: dict[str, Any]  # JSON-able description (text, variable name, params...)
    payload: Any = None  # the Python objects the executor needs (GenParams, tools...)
    # Completed by the executor with the node's result or exception; waited on by readers.
    done: concurrent.futures.Future[Any] = field(default_factory=concurrent.futures.Future)

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "kind": self.kind, "stream": self.stream_id,
                "deps": list(self.deps), **self.attrs}


@dataclass
class GraphStop:
    """Where and why tracing stopped."""

    after_node: int | None  # the last node recorded before the read
    stream_id: int
    variable: str | None  # the variable whose value control flow needed (None: the text)
    reason: str


class Graph:
    """A growing list of nodes; append-only, so node ids are stable."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.nodes: list[Node] = []
        self.complete = True
        self.stop: GraphStop | None = None

    def add(self, kind: NodeKind, stream_id: int, deps: tuple[int, ...],
            attrs: dict[str, Any], payload: Any = None) -> Node:
        """Append a node and return it."""
        node = Node(len(self.nodes), kind, stream_id, deps, attrs, payload)
        self.nodes.append(node)
        return node

    def edges(self) -> list[tuple[int, int]]:
        """``(src, dst)`` pairs: ``dst`` depends on ``src``."""
        return [(d, n.id) for n in self.nodes for d in n.deps]

    def to_json(self) -> dict[str, Any]:
        """The graph as a JSON-able dict: nodes, edges, completeness and stop point."""
        stop = None if self.stop is None else vars(self.stop).copy()
        return {"program": self.name, "complete": self.complete, "stop": stop,
                "nodes": [n.to_json() for n in self.nodes],
                "edges": [list(e) for e in self.edges()]}

    def to_json_str(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_json(), indent=indent, default=str)

    def to_dot(self) -> str:
        """Graphviz DOT source; one cluster per stream."""
        lines = [f"digraph {json.dumps(self.name)} {{", "  node [shape=box, fontsize=10];"]
        for stream_id in sorted({n.stream_id for n in self.nodes}):
            lines.append(f"  subgraph cluster_{stream_id} {{ label=\"stream {stream_id}\";")
            lines += [f"    n{n.id} [label={json.dumps(node_label(n))}];"
                      for n in self.nodes if n.stream_id == stream_id]
            lines.append("  }")
        lines += [f"  n{a} -> n{b};" for a, b in self.edges()]
        if self.stop is not None:
            lines.append(f"  stop [shape=octagon, label={json.dumps('interpreted: ' + self.stop.reason)}];")
            if self.stop.after_node is not None:
                lines.append(f"  n{self.stop.after_node} -> stop [style=dashed];")
        lines.append("}")
        return "\n".join(lines)


def node_label(node: Node) -> str:
    """A node's short human label (DOT, run-trace timelines)."""
    attrs = node.attrs
    if node.kind == "text":
        text = attrs["text"]
        return f"text {text[:24]!r}" + ("..." if len(text) > 24 else "")
    if node.kind in ("gen", "select", "tool_call"):
        return f"{node.kind} {attrs.get('name')}"
    if node.kind == "fork":
        return f"fork x{attrs['n']}"
    if node.kind == "var":
        return f"text of {attrs['name']}"
    if node.kind == "set":
        return f"set {attrs['name']}"
    if node.kind == "capture":
        return f"capture {attrs['name']} {attrs['event']}"
    return f"join ({attrs['mode']})"
