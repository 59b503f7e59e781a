"""Turns what a program does to its states into request-graph nodes.

A ``Session`` belongs to one program run (or one trace). The program body calls it from
its own thread; each operation becomes a node whose dependency is the previous node of
the same stream (plus the branches, for a join). With an executor attached (``run``) a
node is submitted the moment it is added, so ``gen`` returns at once and only reads wait.

Without an executor (``trace``) nothing runs: a read of a generated value (``s["x"]``,
``s.text()``) raises ``TraceStop``, and the graph ends there (``Graph.complete`` False,
``Graph.stop`` says where). Control flow that depends on a generated value therefore
never becomes part of a graph: under ``run`` the body simply keeps going after the read
(interpreted), adding nodes as it goes, so the result is always the one the Python code
asks for. Control flow on the program's ARGUMENTS is fine to trace: a graph is traced for
concrete arguments.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
from typing import Any

from frontend_dsl.backend import Backend, GenParams
from frontend_dsl.errors import ProgramDefinitionError, ProgramLimitError, TraceStop
from frontend_dsl.executor import Executor, ForkPayload, JoinPayload, TextPayload
from frontend_dsl.graph import Graph, GraphStop, Node, NodeKind
from frontend_dsl.limits import DEFAULT_LIMITS, ProgramLimits
from frontend_dsl.loop import get_loop
from frontend_dsl.output_constraint import OutputConstraint
from frontend_dsl.primitives import Expr, Gen, Select, Seq
from frontend_dsl.roles import ROLES, Role, role_affixes
from frontend_dsl.stream_data import StreamData
from frontend_dsl.tools import call_schema

VarRef = tuple[Node, str | None]  # the node that defines a variable; key into a join's dict


@dataclasses.dataclass
class _Stream:
    """What the session knows about a stream before anything runs."""

    tail: Node | None = None  # last node; a new node depends on it
    roles: tuple[str, ...] = ()  # roles of its messages so far (for the chat template)
    open_role: str | None = None
    variables: dict[str, VarRef] = dataclasses.field(default_factory=dict)
    own_variables: list[str] = dataclasses.field(default_factory=list)  # since its fork


class Session:
    """Builds (and, with an executor, runs) the graph of one program run."""

    def __init__(self, name: str, backend: Backend, executor: Executor | None,
                 limits: ProgramLimits = DEFAULT_LIMITS) -> None:
        self.graph = Graph(name)
        self.backend = backend
        self.executor = executor
        self.limits = limits
        self.num_branches = 0  # forked over the run, all forks together
        self.num_tool_calls = 0
        self._streams: dict[int, _Stream] = {0: _Stream()}
        self._lock = threading.RLock()

    @property
    def tracing(self) -> bool:
        return self.executor is None

    # ---- building ----

    def append(self, stream_id: int, item: Expr | str) -> None:
        """Lower ``item`` into nodes of ``stream_id``."""
        with self._lock:
            self._lower(stream_id, item)

    def _lower(self, stream_id: int, item: Expr | str) -> None:
        if isinstance(item, str):
            self._add("text", stream_id, {"text": item}, TextPayload())
        elif isinstance(item, Seq):
            for part in item.items:
                self._lower(stream_id, part)
        elif isinstance(item, Role):
            self.begin_role(stream_id, item.role)
            for part in item.content:
                self._lower(stream_id, part)
            self.end_role(stream_id)
        elif isinstance(item, Gen):
            self._add_gen(stream_id, item)
        elif isinstance(item, Select):
            node = self._add("select", stream_id, {"name": item.name, "choices": list(item.choices),
                                                   "method": item.method}, item)
            self._define(stream_id, item.name, node)
        else:
            raise ProgramDefinitionError(f"cannot append {type(item).__name__} to a state")

    def _add_gen(self, stream_id: int, item: Gen) -> None:
        if not item.tools:
            node = self._add("gen", stream_id, {"name": item.name, **item.params.describe()}, item)
        else:
            self.num_tool_calls += 1
            if self.num_tool_calls > self.limits.max_tool_calls:
                raise ProgramLimitError(f"program {self.graph.name} made more than "
                                        f"{self.limits.max_tool_calls} tool calls (max_tool_calls)")
            constraint = OutputConstraint("json_schema", call_schema(item.tools))
            params: GenParams = dataclasses.replace(item.params, constraint=constraint)
            item = dataclasses.replace(item, params=params)
            attrs = {"name": item.name, "tools": [t.name for t in item.tools], **params.describe()}
            node = self._add("tool_call", stream_id, attrs, item)
        self._define(stream_id, item.name, node)

    def begin_role(self, stream_id: int, role: str) -> None:
        """Open a chat message of ``role`` (its template prefix becomes a text node)."""
        with self._lock:
            stream = self._streams[stream_id]
            if role not in ROLES:
                raise ProgramDefinitionError(f"unknown role {role!r}; expected one of {ROLES}")
            if stream.open_role is not None:
                raise ProgramDefinitionError(f"cannot open {role!r} inside {stream.open_role!r}")
            prefix, _ = role_affixes(self.backend, stream.roles, role)
            self._add("text", stream_id, {"text": prefix, "role": role, "event": "begin"},
                      TextPayload("begin", role))
            stream.open_role = role

    def end_role(self, stream_id: int) -> None:
        """Close the open chat message (its template suffix becomes a text node)."""
        with self._lock:
            stream = self._streams[stream_id]
            role = stream.open_role
            if role is None:
                raise ProgramDefinitionError("no open role to close")
            _, suffix = role_affixes(self.backend, stream.roles, role)
            self._add("text", stream_id, {"text": suffix, "role": role, "event": "end"},
                      TextPayload("end", role))
            stream.roles += (role,)
            stream.open_role = None

    def fork(self, stream_id: int, n: int) -> list[int]:
        """Add a fork node; return the ids of ``n`` new branch streams."""
        with self._lock:
            parent = self._streams[stream_id]
            if n < 1:
                raise ProgramDefinitionError(f"fork needs n >= 1, got {n}")
            if parent.open_role is not None:
                raise ProgramDefinitionError("close the open role before forking")
            if self.num_branches + n > self.limits.max_branches:
                raise ProgramLimitError(
                    f"program {self.graph.name} would fork {self.num_branches + n} branches; the "
                    f"limit is {self.limits.max_branches} (max_branches)")
            self.num_branches += n
            branch_ids = tuple(range(len(self._streams), len(self._streams) + n))
            node = self._add("fork", stream_id, {"n": n, "branches": list(branch_ids)},
                             ForkPayload(branch_ids))
            for b in branch_ids:
                self._streams[b] = _Stream(node, parent.roles, None, dict(parent.variables))
            return list(branch_ids)

    def join(self, stream_id: int, branch_ids: list[int], mode: str) -> None:
        """Add a join node: the parent waits for the branches and gathers their variables."""
        with self._lock:
            if mode not in ("gather", "concat"):
                raise ProgramDefinitionError(f"join mode must be 'gather' or 'concat', got {mode!r}")
            branches = [self._streams[b] for b in branch_ids]
            extra = tuple(b.tail.id for b in branches if b.tail is not None)
            node = self._add("join", stream_id, {"mode": mode, "branches": list(branch_ids)},
                             JoinPayload(tuple(branch_ids), mode), extra)
            for name in dict.fromkeys(n for b in branches for n in b.own_variables):
                self._define(stream_id, name, node, key=name)

    def _define(self, stream_id: int, name: str | None, node: Node, key: str | None = None) -> None:
        if name is not None:
            stream = self._streams[stream_id]
            stream.variables[name] = (node, key)
            stream.own_variables.append(name)

    def _add(self, kind: NodeKind, stream_id: int, attrs: dict[str, Any], payload: Any,
             extra_deps: tuple[int, ...] = ()) -> Node:
        stream = self._streams[stream_id]
        deps = ((stream.tail.id,) if stream.tail is not None else ()) + extra_deps
        node = self.graph.add(kind, stream_id, tuple(dict.fromkeys(deps)), attrs, payload)
        stream.tail = node
        if self.executor is not None:
            dep_nodes = [self.graph.nodes[d] for d in node.deps]
            get_loop().call_soon_threadsafe(self.executor.submit, node, dep_nodes)
        return node

    # ---- reading (blocks; under tracing, ends the graph) ----

    def read_variable(self, stream_id: int, name: str) -> Any:
        """The value of ``name`` in ``stream_id``, waiting for the node that defines it.

        Raises:
            KeyError: no operation of this stream defines ``name``.
            TraceStop: while tracing.
            Exception: whatever made the defining node fail.
        """
        ref = self._streams[stream_id].variables.get(name)
        if ref is None:
            raise KeyError(name)
        self._stop_if_tracing(stream_id, name, f"control flow reads generated variable {name!r}")
        node, key = ref
        value = node.done.result()
        return value if key is None else value[key]

    def settled_data(self, stream_id: int, what: str) -> StreamData:
        """The stream's data once every node added to it so far has finished (ok or not)."""
        self._stop_if_tracing(stream_id, None, f"control flow reads the generated {what}")
        assert self.executor is not None
        tail = self._streams[stream_id].tail
        if tail is not None:
            concurrent.futures.wait([tail.done])
        return self.executor.streams.get(stream_id) or StreamData()

    def _stop_if_tracing(self, stream_id: int, variable: str | None, reason: str) -> None:
        """Under tracing, end the graph here: record where and raise ``TraceStop``."""
        if not self.tracing:
            return
        tail = self._streams[stream_id].tail
        self.graph.complete = False
        self.graph.stop = GraphStop(None if tail is None else tail.id, stream_id, variable, reason)
        raise TraceStop(reason, variable)

    # ---- whole-run control ----

    def wait_all(self) -> None:
        """Block until every node added so far has finished."""
        concurrent.futures.wait([n.done for n in self.graph.nodes])

    def cancel(self) -> None:
        """Cancel all pending nodes (used when the program body raised)."""
        if self.executor is not None:
            get_loop().call_soon_threadsafe(self.executor.cancel_all)

    def first_error(self) -> BaseException | None:
        """The exception of the earliest failed node, if any."""
        for node in self.graph.nodes:
            if node.done.done() and node.done.exception() is not None:
                return node.done.exception()
        return None
