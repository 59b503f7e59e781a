"""``ProgramState`` (the ``s`` a program receives) and ``Branches`` (what ``fork`` returns).

Appending never blocks: ``s += gen("x")`` adds a node and returns. Reading blocks:
``s["x"]`` waits for the node that defines ``x``; ``s.text()`` / ``s.messages()`` wait
for everything appended to this state so far.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

from frontend_dsl.errors import ProgramDefinitionError, ProgramError, TraceStop
from frontend_dsl.graph import Graph
from frontend_dsl.primitives import Expr
from frontend_dsl.run_trace import RunTrace
from frontend_dsl.tracer import Session


class ProgramState:
    """A handle on one stream of a program run: the root state or a fork branch."""

    def __init__(self, session: Session, stream_id: int = 0) -> None:
        self._session = session
        self._stream_id = stream_id

    def __iadd__(self, item: Expr | str) -> ProgramState:
        self._session.append(self._stream_id, item)
        return self

    def __getitem__(self, name: str) -> Any:
        """The value of variable ``name``; blocks until it is generated.

        Raises:
            ProgramError: the node that defines ``name`` failed (``.state`` is this state).
            KeyError: nothing in this state defines ``name``.
        """
        try:
            return self._session.read_variable(self._stream_id, name)
        except (KeyError, ProgramError, TraceStop):
            raise
        except Exception as exc:
            raise ProgramError(f"variable {name!r} failed: {exc}", self) from exc

    def get(self, name: str, default: Any = None) -> Any:
        """Like ``s[name]`` but ``default`` when ``name`` is not defined."""
        try:
            return self[name]
        except KeyError:
            return default

    def get_meta(self, name: str) -> dict[str, Any]:
        """Details of how ``name`` was produced: finish reason, cached prompt tokens,
        logprobs (gen), per-choice scores (select)."""
        self.get(name)
        return dict(self._session.settled_data(self._stream_id, "meta").meta.get(name, {}))

    def text(self) -> str:
        """The whole text of this state (waits for pending nodes; partial after a failure)."""
        return self._session.settled_data(self._stream_id, "text").text

    def token_ids(self) -> list[int]:
        """The token ids of this state; ``decode(token_ids()) == text()``."""
        return list(self._session.settled_data(self._stream_id, "token ids").ids)

    def messages(self) -> list[dict[str, str]]:
        """The chat messages (role, content) appended so far, closed ones only."""
        return [dict(m) for m in self._session.settled_data(self._stream_id, "messages").messages]

    def variables(self) -> dict[str, Any]:
        """Every variable this state holds so far (failed ones are absent)."""
        return dict(self._session.settled_data(self._stream_id, "variables").variables)

    @property
    def graph(self) -> Graph:
        """The request graph of this run, as executed so far."""
        return self._session.graph

    def run_trace(self) -> RunTrace:
        """The run's trace so far: node timings, token counts, tool calls
        (``frontend_dsl.run_trace``); complete once the run has returned."""
        if self._session.executor is None:
            raise ProgramDefinitionError("a traced (never run) graph has no run trace")
        return RunTrace.build(self._session.graph, self._session.executor.recorder)

    @contextmanager
    def role(self, role: str) -> Iterator[ProgramState]:
        """Everything appended inside the block is the content of one ``role`` message."""
        self._session.begin_role(self._stream_id, role)
        yield self
        self._session.end_role(self._stream_id)

    def system(self) -> AbstractContextManager[ProgramState]:
        """``with s.system(): ...`` — a system message."""
        return self.role("system")

    def user(self) -> AbstractContextManager[ProgramState]:
        """``with s.user(): ...`` — a user message."""
        return self.role("user")

    def assistant(self) -> AbstractContextManager[ProgramState]:
        """``with s.assistant(): ...`` — an assistant message."""
        return self.role("assistant")

    def fork(self, n: int) -> Branches:
        """``n`` branches that start from this state's current contents (sharing its
        token ids, hence its prefix-cache entries) and run concurrently."""
        ids = self._session.fork(self._stream_id, n)
        return Branches(self, [ProgramState(self._session, b) for b in ids])

    def __repr__(self) -> str:
        return f"ProgramState(program={self._session.graph.name!r}, stream={self._stream_id})"


class Branches:
    """The states made by one ``fork``. ``branches += expr`` appends to every branch."""

    def __init__(self, parent: ProgramState, states: list[ProgramState]) -> None:
        self.parent = parent
        self.states = states

    def __iadd__(self, item: Expr | str) -> Branches:
        for state in self.states:
            state += item
        return self

    def __getitem__(self, index: int) -> ProgramState:
        return self.states[index]

    def __setitem__(self, index: int, state: ProgramState) -> None:
        # ``branches[i] += x`` appends in place and then stores the same state back.
        if state is not self.states[index]:
            raise ProgramDefinitionError("a fork's branches cannot be replaced")

    def __iter__(self) -> Iterator[ProgramState]:
        return iter(self.states)

    def __len__(self) -> int:
        return len(self.states)

    def join(self, mode: str = "gather") -> None:
        """Make the parent wait for every branch (does not block the program).

        ``mode="gather"``: each variable a branch set after the fork becomes, in the parent,
        the list of the branches' values (``None`` for a branch that did not set it);
        ``s.get_meta(name)["branches"]`` lists each branch's meta (select scores...).
        ``mode="concat"``: the same, and each branch's text after the fork is appended to
        the parent, in branch order.
        """
        branch_ids = [s._stream_id for s in self.states]
        self.parent._session.join(self.parent._stream_id, branch_ids, mode)
