"""``@program``: a Python function over a state, run, batched, streamed or traced.

Every call builds a fresh ``Session``. ``run`` executes the body in the calling thread
while the nodes it adds run on the DSL loop; the run ends when the body has returned and
every node has finished. A failed node or an exception in the body surfaces as one
``ProgramError`` whose ``state`` holds the partial result.

A ``Program`` is also what ``arbor serve --programs`` hosts: it satisfies the server's
``runtime.server.hosting.HostedProgram`` through ``frontend_dsl.hosting.ProgramHost``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import queue
import threading
from collections.abc import AsyncGenerator, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from frontend_dsl.backend import Backend
from frontend_dsl.default_backend import resolve_backend
from frontend_dsl.errors import ProgramDefinitionError, ProgramError, TraceStop
from frontend_dsl.executor import Executor, TextListener
from frontend_dsl.graph import Graph
from frontend_dsl.limits import DEFAULT_LIMITS, ProgramLimits
from frontend_dsl.state import ProgramState
from frontend_dsl.tracer import Session

if TYPE_CHECKING:
    from frontend_dsl.hosting import ProgramHost
    from runtime.engine import Engine
    from runtime.server.hosting import RunEvent

ProgramFn = Callable[..., Any]


class Program:
    """A function whose first parameter is the program state ``s``."""

    def __init__(self, fn: ProgramFn, limits: ProgramLimits = DEFAULT_LIMITS) -> None:
        params = list(inspect.signature(fn).parameters)
        if not params:
            raise ProgramDefinitionError(f"@program {fn.__name__} must take the state as first parameter")
        self.fn = fn
        self.limits = limits
        self.name = fn.__name__
        self.arg_names = params[1:]
        functools.update_wrapper(self, fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Call the body directly (e.g. one program inlined into another's state)."""
        return self.fn(*args, **kwargs)

    def run(self, backend: Any = None, **kwargs: Any) -> ProgramState:
        """Run once and return the finished state.

        Args:
            backend: a ``Backend`` or ``runtime.Engine``; default: ``set_default_backend``.
            **kwargs: the program's arguments.

        Raises:
            ProgramError: a node failed or the body raised; ``.state`` is the partial state.
        """
        return self._run(resolve_backend(backend), kwargs, on_text=None)

    def _run(self, backend: Backend, kwargs: dict[str, Any], on_text: TextListener | None) -> ProgramState:
        session = Session(self.name, backend, Executor(backend, on_text), self.limits)
        state = ProgramState(session)
        try:
            self.fn(state, **kwargs)
        except Exception as exc:
            session.cancel()
            session.wait_all()
            if isinstance(exc, ProgramError):
                raise
            raise ProgramError(f"program {self.name} raised {type(exc).__name__}: {exc}", state) from exc
        session.wait_all()
        error = session.first_error()
        if error is not None:
            raise ProgramError(f"program {self.name} failed: {error}", state) from error
        return state

    async def arun(self, backend: Any = None, **kwargs: Any) -> ProgramState:
        """``run`` for async callers: the body runs in a worker thread, the caller's loop
        stays free."""
        return await asyncio.to_thread(self.run, backend, **kwargs)

    def run_batch(
        self,
        batch_kwargs: Sequence[dict[str, Any]],
        max_concurrency: int = 32,
        progress: bool = False,
        backend: Any = None,
        return_exceptions: bool = False,
    ) -> list[Any]:
        """Run once per kwargs dict, up to ``max_concurrency`` at a time.

        Args:
            batch_kwargs: one dict of arguments per run.
            max_concurrency: runs in flight at once (their requests batch in the backend).
            progress: show a tqdm bar.
            backend: as in ``run``.
            return_exceptions: put a failed run's ``ProgramError`` in its slot instead of
                raising the first one after all runs finished.

        Returns:
            States (or errors) in the order of ``batch_kwargs``.
        """
        resolved = resolve_backend(backend)

        def one(kwargs: dict[str, Any]) -> Any:
            try:
                return self.run(resolved, **kwargs)
            except ProgramError as exc:
                return exc

        with ThreadPoolExecutor(max(1, max_concurrency), thread_name_prefix=f"arbor-{self.name}") as pool:
            futures = [pool.submit(one, kw) for kw in batch_kwargs]
            bar = tqdm(total=len(futures), desc=self.name, disable=not progress)
            results = []
            for fut in futures:
                results.append(fut.result())
                bar.update(1)
            bar.close()
        if not return_exceptions:
            for result in results:
                if isinstance(result, ProgramError):
                    raise result
        return results

    def stream(self, backend: Any = None, **kwargs: Any) -> Iterator[str]:
        """Run and yield the root state's text as it is produced (constant text and
        generated deltas, in order). Raises ``ProgramError`` at the end if the run failed."""
        resolved = resolve_backend(backend)
        chunks: queue.Queue[str | None] = queue.Queue()
        outcome: list[BaseException] = []

        def listen(stream_id: int, text: str) -> None:
            if stream_id == 0:
                chunks.put(text)

        def body() -> None:
            try:
                self._run(resolved, kwargs, on_text=listen)
            except BaseException as exc:  # noqa: BLE001 - re-raised in the consumer
                outcome.append(exc)
            finally:
                chunks.put(None)

        threading.Thread(target=body, name=f"arbor-stream-{self.name}", daemon=True).start()
        while (chunk := chunks.get()) is not None:
            yield chunk
        if outcome:
            raise outcome[0]

    def trace(self, backend: Any = None, **example_args: Any) -> Graph:
        """The request graph for these arguments, built without running the model.

        Tracing stops at the first read of a generated value: the returned graph has
        ``complete == False`` and ``stop`` naming the read; the operations after it depend
        on the value and run interpreted under ``run``. The backend is only used for its
        chat template.
        """
        session = Session(self.name, resolve_backend(backend), executor=None, limits=self.limits)
        with contextlib.suppress(TraceStop):
            self.fn(ProgramState(session), **example_args)
        return session.graph

    # ---- hosted by a server: runtime.server.hosting.HostedProgram ----

    @property
    def description(self) -> str:
        """The docstring, shown by ``GET /programs``."""
        return inspect.getdoc(self.fn) or ""

    def arguments_schema(self) -> dict[str, Any]:
        """The JSON schema of the arguments (the parameters after the state)."""
        return self._host.arguments_schema()

    def validate_arguments(self, arguments: dict[str, Any]) -> dict[str, Any]:
        """The arguments, checked against the signature; raises ``InvalidArgumentsError``."""
        return self._host.validate_arguments(arguments)

    def run_hosted(self, engine: Engine, arguments: dict[str, Any]) -> AsyncGenerator[RunEvent, None]:
        """Run once on a server's ``engine``: an event per finished generation, then the
        outcome; closing the stream early aborts the run's requests."""
        return self._host.run(engine, arguments)

    @functools.cached_property
    def _host(self) -> ProgramHost:
        # NOTE: deferred (like as_backend's): frontend_dsl.hosting loads the engine side
        # (runtime, torch), which `import frontend_dsl` must not; a server has it loaded.
        from frontend_dsl.hosting import ProgramHost

        return ProgramHost(self.name, self.fn, self.run)


def program(fn: ProgramFn | None = None, *, max_branches: int | None = None,
            max_tool_calls: int | None = None) -> Any:
    """Decorator: make ``fn(s, ...)`` a ``Program``. Bare (``@program``) or with bounds on
    each run (``@program(max_branches=64, max_tool_calls=8)``; defaults: ``ProgramLimits``)."""
    bounds = {k: v for k, v in (("max_branches", max_branches), ("max_tool_calls", max_tool_calls))
              if v is not None}
    limits = ProgramLimits(**bounds) if bounds else DEFAULT_LIMITS

    def wrap(f: ProgramFn) -> Program:
        return Program(f, limits)

    return wrap(fn) if fn is not None else wrap

