"""Turns what a program does to its states into request-graph nodes.

A ``Session`` belongs to one program run (or one trace). The program body calls it from
its own thread; each operation becomes a node whose dependency is the previous node of
the same stream (plus the branches, for a join). With an executor attached (``run``) a
node is submitted the moment it is added, so ``gen`` returns at once and only reads wait.

Without an executor (``trace``) nothing runs. A read of a generated variable (``s["x"]``)
returns a ``Ref`` (``ref.py``): where the value only flows into later prompts
(``s += "Refine: " + s["x"]``) it becomes a ``var`` node with an edge from the node that
defines ``x``, and tracing goes on. A use that needs the value itself (a comparison,
``s.text()``, an f-string) raises ``TraceStop``, and the graph ends there
(``Graph.complete`` False, ``Graph.stop`` says where). Control flow that depends on a
generated value therefore never becomes part of a graph: under ``run`` the body simply
keeps going after the read (interpreted), adding nodes as it goes, so the result is
always the one the Python code asks for. Control flow on the program's ARGUMENTS is fine
to trace: a graph is traced for concrete arguments. Under ``run``, ``s.ref("x")`` gives
the same lazy reference, so a body that only feeds values into prompts never blocks.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
from typing import Any

from frontend_dsl.backend import Backend, GenParams
from frontend_dsl.errors import ProgramDefinitionError, ProgramLimitError, TraceStop
from frontend_dsl.executor import (
    CapturePayload,
    Executor,
    ForkPayload,
    JoinPayload,
    SetPayload,
    TextPayload,
)
from frontend_dsl.graph import Graph, GraphStop, Node, NodeKind
from frontend_dsl.loop import get_loop
from frontend_dsl.output_constraint import OutputConstraint
from frontend_dsl.primitives import Expr, Gen, RoleBegin, RoleEnd, Select, Seq, with_defaults
from frontend_dsl.program_limits import DEFAULT_LIMITS, ProgramLimits
from frontend_dsl.reasoning import REASONING_KEY
from frontend_dsl.ref import Ref
from frontend_dsl.roles import ROLES, Role, role_affixes
from frontend_dsl.stream_data import StreamData
from frontend_dsl.text_stream import TextLog
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
                 defaults: dict[str, Any] | None = None, limits: ProgramLimits = DEFAULT_LIMITS) -> None:
        self.graph = Graph(name)
        self.backend = backend
        self.executor = executor
        self.limits = limits
        self.num_branches = 0  # forked over the run, all forks together
        self.num_tool_calls = 0
        self.defaults = dict(defaults or {})  # the run's sampling settings for every gen
        self.text_log: TextLog | None = None  # set for a streamed run (``text_iter``)
        self.return_value: Any = None  # what the program's body returned
        self.body_thread: int | None = None  # ident of the thread running the body
        self._finished = threading.Event()
        self._run_error: BaseException | None = None
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
        elif isinstance(item, RoleBegin):
            self.begin_role(stream_id, item.role)
        elif isinstance(item, RoleEnd):
            if self._streams[stream_id].open_role != item.role:
                raise ProgramDefinitionError(
                    f"{item.role}_end() closes no open {item.role!r} message "
                    f"(open: {self._streams[stream_id].open_role!r})")
            self.end_role(stream_id)
        elif isinstance(item, Gen):
            self._add_gen(stream_id, with_defaults(item, self.defaults))
        elif isinstance(item, Select):
            node = self._add("select", stream_id, {"name": item.name, "choices": list(item.choices),
                                                   "method": item.method_name,
                                                   "temperature": item.temperature}, item)
            self._define(stream_id, item.name, node)
        elif isinstance(item, Ref):
            self._add("var", stream_id, {"name": item.name, "from_node": item.source.id},
                      item, (item.source.id,))
        else:
            raise ProgramDefinitionError(f"cannot append {type(item).__name__} to a state")

    def _add_gen(self, stream_id: int, item: Gen) -> None:
        if item.n > 1:
            self._add_gen_n(stream_id, item)
            return
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
        if item.reasoning_var is not None:
            self._define(stream_id, item.reasoning_var, node, key=REASONING_KEY)

    def _add_gen_n(self, stream_id: int, item: Gen) -> None:
        """``gen(n=k)``: fork k branches (allowed inside an open message: they only
        generate), one gen each (seed + i when a seed is set), gathered into a list."""
        branch_ids = self.fork(stream_id, item.n, inside_role=True)
        for i, branch in enumerate(branch_ids):
            seed = item.params.seed
            params = item.params if seed is None else dataclasses.replace(item.params, seed=seed + i)
            self._add_gen(branch, dataclasses.replace(item, params=params, n=1))
        self.join(stream_id, branch_ids, "gather")

    def set_variable(self, stream_id: int, name: str, value: Any) -> None:
        """``s[name] = value``: a node that sets a variable (appends nothing)."""
        with self._lock:
            if not isinstance(name, str) or not name:
                raise ProgramDefinitionError(f"variable names are non-empty strings, got {name!r}")
            node = self._add("set", stream_id, {"name": name, "value": repr(value)[:80]},
                             SetPayload(name, value))
            self._define(stream_id, name, node)

    def capture(self, stream_id: int, name: str, event: str) -> None:
        """``var_scope(name)``: ``begin`` / ``end`` of the text captured into ``name``."""
        with self._lock:
            node = self._add("capture", stream_id, {"name": name, "event": event},
                             CapturePayload(name, event))
            if event == "end":
                self._define(stream_id, name, node)

    def has_variable(self, stream_id: int, name: str) -> bool:
        """Whether an operation of this stream (so far) defines ``name``."""
        return name in self._streams[stream_id].variables

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

    def fork(self, stream_id: int, n: int, inside_role: bool = False) -> list[int]:
        """Add a fork node; return the ids of ``n`` new branch streams.

        ``inside_role``: allow an open message (its branches continue it; used by
        ``gen(n=...)``, whose branches only generate and are gathered)."""
        with self._lock:
            parent = self._streams[stream_id]
            if not isinstance(n, int) or n < 1:
                raise ProgramDefinitionError(f"fork needs n >= 1, got {n!r}")
            if parent.open_role is not None and not inside_role:
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
                self._streams[b] = _Stream(node, parent.roles, parent.open_role, dict(parent.variables))
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
        """The value of ``name`` in ``stream_id``, waiting for the node that defines it;
        while tracing, a ``Ref`` to it (its uses that need the value end the graph).

        Raises:
            KeyError: no operation of this stream defines ``name``.
            Exception: whatever made the defining node fail.
        """
        if name not in self._streams[stream_id].variables and self._outside_running_body():
            self._finished.wait()  # a streamed run's reader: the body may define it later
        ref = self.ref(stream_id, name)
        return ref if self.tracing else ref.value()

    def ref(self, stream_id: int, name: str) -> Ref:
        """A lazy reference to ``name`` as defined now in ``stream_id`` (see ``ref.py``).

        Raises:
            KeyError: no operation of this stream defines ``name``.
        """
        found = self._streams[stream_id].variables.get(name)
        if found is None:
            raise KeyError(name)
        node, key = found

        def resolve() -> Any:
            self._stop_if_tracing(stream_id, name, f"control flow reads generated variable {name!r}")
            value = node.done.result()
            if key == REASONING_KEY:
                assert self.executor is not None
                return self.executor.thinking[node.id]
            return value if key is None else value[key]

        return Ref(node, key, name, resolve)

    def settled_data(self, stream_id: int, what: str) -> StreamData:
        """The stream's data once every node added to it so far has finished (ok or not)."""
        self._stop_if_tracing(stream_id, None, f"control flow reads the generated {what}")
        assert self.executor is not None
        if self._outside_running_body():
            self._finished.wait()  # as SGLang's: a streamed run's whole text, once it is done
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

    def finish(self, error: BaseException | None) -> None:
        """The run has ended (its body returned and every node finished)."""
        self._run_error = error
        if self.executor is not None:
            self.executor.end_run()
        if self.text_log is not None:
            self.text_log.close(error)
        self._finished.set()

    def wait_run(self) -> None:
        """Block until the run has ended; raise its error."""
        self._finished.wait()
        if self._run_error is not None:
            raise self._run_error

    def _outside_running_body(self) -> bool:
        """Whether a streamed run is still going and the caller is not its body (a
        reader of the state ``run(stream=True)`` returned)."""
        return (self.text_log is not None and not self._finished.is_set()
                and threading.get_ident() != self.body_thread)

    def first_error(self) -> BaseException | None:
        """The exception of the earliest failed node, if any."""
        for node in self.graph.nodes:
            if node.done.done() and node.done.exception() is not None:
                return node.done.exception()
        return None
