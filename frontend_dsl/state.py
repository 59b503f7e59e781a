"""``ProgramState`` (the ``s`` a program receives) and ``Branches`` (what ``fork`` returns).

Appending never blocks: ``s += gen("x")`` adds a node and returns. Reading blocks:
``s["x"]`` waits for the node that defines ``x``; ``s.text()`` / ``s.messages()`` wait
for everything appended to this state so far.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

from frontend_dsl.errors import ProgramDefinitionError, ProgramError, TraceStop
from frontend_dsl.graph import Graph
from frontend_dsl.primitives import Expr
from frontend_dsl.ref import Ref, value_text
from frontend_dsl.roles import Role
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
        """The value of variable ``name``; blocks until it is generated. While tracing,
        a ``Ref`` to it (see ``ref.py``); on a state returned by ``run(stream=True)``,
        a variable the body has not appended yet is waited for until the run ends.

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

    def __setitem__(self, name: str, value: Any) -> None:
        """``s[name] = value``: set a variable (in order with the state's other nodes)."""
        self._session.set_variable(self._stream_id, name, value)

    def __contains__(self, name: object) -> bool:
        """Whether something appended to this state so far defines ``name`` (no wait)."""
        return isinstance(name, str) and self._session.has_variable(self._stream_id, name)

    def ref(self, name: str) -> Ref:
        """A lazy reference to ``name``: ``s += "Refine: " + s.ref("x")`` appends its text
        when it is ready without blocking the program (see ``ref.py``).

        Raises:
            KeyError: nothing in this state defines ``name``.
        """
        return self._session.ref(self._stream_id, name)

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

    def text_iter(self, var_name: str | None = None) -> Iterator[str]:
        """The state's text piece by piece as it is produced (``var_name``: only that
        variable's generation, ending when it is done). For a run started with
        ``stream=True`` the pieces come while the program runs; otherwise the whole text
        (or value's text) comes at once. Raises ``ProgramError`` if the run failed."""
        log = self._session.text_log
        if log is None:
            yield self.text() if var_name is None else value_text(self[var_name])
            return
        yield from log.iter_text(self._stream_id, var_name)

    async def text_async_iter(self, var_name: str | None = None) -> AsyncIterator[str]:
        """``text_iter`` for ``async for``: each wait runs in a worker thread."""
        pieces = self.text_iter(var_name)
        done = object()
        while (piece := await asyncio.to_thread(next, pieces, done)) is not done:
            yield str(piece)

    def wait(self) -> ProgramState:
        """Block until the run has finished (for ``run(stream=True)``); raise its error."""
        self._session.wait_run()
        return self
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

    def system(self, *content: Expr | str) -> AbstractContextManager[ProgramState]:
        """``s.system("...")`` appends a system message; ``with s.system(): ...`` makes
        everything appended in the block one."""
        return self._role_call("system", content)

    def user(self, *content: Expr | str) -> AbstractContextManager[ProgramState]:
        """``s.user("...")`` or ``with s.user(): ...`` — a user message."""
        return self._role_call("user", content)

    def assistant(self, *content: Expr | str) -> AbstractContextManager[ProgramState]:
        """``s.assistant(gen("x"))`` or ``with s.assistant(): ...`` — an assistant message."""
        return self._role_call("assistant", content)

    def _role_call(self, role: str, content: tuple[Expr | str, ...]) -> AbstractContextManager[ProgramState]:
        if not content:
            return self.role(role)
        self += Role(role, content)
        return nullcontext(self)  # the message is appended already; usable in `with` too

    @contextmanager
    def var_scope(self, name: str) -> Iterator[ProgramState]:
        """Everything appended inside the block is also captured as variable ``name``."""
        self._session.capture(self._stream_id, name, "begin")
        yield self
        self._session.capture(self._stream_id, name, "end")

    def fork(self, n: int) -> Branches:
        """``n`` branches that start from this state's current contents (sharing its
        token ids, hence its prefix-cache entries) and run concurrently."""
        ids = self._session.fork(self._stream_id, n)
        return Branches(self, [type(self)(self._session, b) for b in ids])

    def copy(self) -> ProgramState:
        """An independent state that starts from this one's contents (a fork of one)."""
        return self.fork(1)[0]

    def __repr__(self) -> str:
        return f"ProgramState(program={self._session.graph.name!r}, stream={self._stream_id})"


BranchItems = Expr | str | Sequence[Expr | str] | Callable[[int], Expr | str]


class Branches:
    """The states made by one ``fork``.

    ``branches += expr`` appends ``expr`` to every branch; ``branches += [e0, e1, ...]``
    appends one item per branch; ``branches += lambda i: ...`` appends what the function
    returns for each branch index.
    """

    def __init__(self, parent: ProgramState, states: list[ProgramState]) -> None:
        self.parent = parent
        self.states = states

    def __iadd__(self, item: BranchItems) -> Branches:
        for i, state in enumerate(self.states):
            state += self._item_for(item, i)
        return self

    def _item_for(self, item: BranchItems, index: int) -> Expr | str:
        if isinstance(item, str | Expr):
            return item
        if callable(item):
            return item(index)
        items = list(item)
        if len(items) != len(self.states):
            raise ProgramDefinitionError(
                f"a list appended to a fork needs one item per branch: {len(items)} for {len(self.states)}")
        return items[index]

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

        ``mode="gather"`` (SGLang: ``"gather_variable"``): each variable a branch set after
        the fork becomes, in the parent, the list of the branches' values (``None`` for a
        branch that did not set it); ``s.get_meta(name)["branches"]`` lists each branch's
        meta (select scores...). ``mode="concat"`` (``"concate_and_append"``): the same,
        and each branch's text after the fork is appended to the parent, in branch order.
        """
        mode = _JOIN_ALIASES.get(mode, mode)
        branch_ids = [s._stream_id for s in self.states]
        self.parent._session.join(self.parent._stream_id, branch_ids, mode)


_JOIN_ALIASES = {"gather_variable": "gather", "concate_and_append": "concat"}
