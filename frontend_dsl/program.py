"""``@program``: a Python function over a state, run, batched, streamed or traced.

Every call builds a fresh ``Session``. ``run`` executes the body in the calling thread
(``stream=True``: in a thread of its own, the state returned at once for ``text_iter``)
while the nodes it adds run on the DSL loop; the run ends when the body has returned and
every node has finished (``_execute``, the one place a run ends). A failed node or an
exception in the body surfaces as one ``ProgramError`` whose ``state`` holds the partial
result. Sampling settings passed to ``run`` / ``run_batch`` are the run's defaults, which
every ``gen`` that leaves them unset inherits (``primitives.with_defaults``).

A ``Program`` is also what ``arbor serve --programs`` hosts: it satisfies the server's
``runtime.server.hosting.HostedProgram`` through ``frontend_dsl.program_host.ProgramHost``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import sys
import threading
from collections.abc import AsyncGenerator, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from frontend_dsl.backend import Backend, GenParams
from frontend_dsl.default_backend import resolve_backend
from frontend_dsl.errors import ProgramDefinitionError, ProgramError, TraceStop
from frontend_dsl.executor import Executor, TextListener
from frontend_dsl.graph import Graph
from frontend_dsl.primitives import SAMPLING_SETTINGS, check_params
from frontend_dsl.program_limits import DEFAULT_LIMITS, ProgramLimits
from frontend_dsl.state import ProgramState
from frontend_dsl.text_stream import TextLog
from frontend_dsl.tracer import Session

if TYPE_CHECKING:
    from frontend_dsl.program_host import ProgramHost
    from runtime.engine import Engine
    from runtime.server.hosting import RunEvent

ProgramFn = Callable[..., Any]


class Program:
    """A function whose first parameter is the program state ``s``."""

    state_class: type[ProgramState] = ProgramState  # what ``s`` is (``sgl`` uses its own)

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

    def run(self, *args: Any, backend: Any = None, stream: bool = False, **kwargs: Any) -> ProgramState:
        """Run once and return the finished state.

        Args:
            *args, **kwargs: the program's arguments (positional ones in the order of its
                parameters). A leading ``Backend`` or ``runtime.Engine`` is taken as
                ``backend``.
            backend: a ``Backend`` or ``runtime.Engine``; default: ``set_default_backend``.
            stream: return at once while the program runs; read its text as it comes
                with ``state.text_iter()`` / ``text_async_iter()``, and ``state.wait()``
                for the end (which raises the run's error).
            Sampling settings among ``kwargs`` that are not parameters of the program
            (``temperature``, ``max_new_tokens`` / ``max_tokens``, ``top_p``, ``top_k``,
            ``min_p``, ``seed``, ``stop``, ``stop_token_ids``, ``stop_regex``,
            ``ignore_eos``, ``min_tokens``, the three penalties, ``return_logprob``,
            ``top_logprobs_num``, ``logprob_start_len``) are the run's defaults: every
            ``gen`` that leaves one unset takes it.

        Raises:
            ProgramError: a node failed or the body raised; ``.state`` is the partial state.
            ProgramDefinitionError: bad arguments or sampling settings.
        """
        backend, kwargs, defaults = self._bind(args, backend, kwargs)
        session = self._session(resolve_backend(backend), defaults, streamed=stream)
        if not stream:
            return self._execute(session, kwargs)
        state = self.state_class(session)
        threading.Thread(target=self._execute_streamed, args=(session, kwargs),
                         name=f"arbor-run-{self.name}", daemon=True).start()
        return state

    def _bind(self, args: tuple[Any, ...], backend: Any,
              kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any], dict[str, Any]]:
        """Split a call into (backend, the program's keyword arguments, run defaults)."""
        if args and backend is None and _is_backend(args[0]):
            backend, args = args[0], args[1:]
        params = list(inspect.signature(self.fn).parameters.values())[1:]
        positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if len(args) > len(positional):
            raise ProgramDefinitionError(f"{self.name} takes {len(positional)} arguments, "
                                         f"got {len(args)} positional")
        bound = dict(zip(positional, args, strict=False))
        if twice := bound.keys() & kwargs.keys():
            raise ProgramDefinitionError(f"{self.name} got {sorted(twice)} twice")
        defaults = {k: kwargs.pop(k) for k in list(kwargs)
                    if k in RUN_SETTINGS and k not in self.arg_names}
        return backend, {**bound, **kwargs}, run_defaults(defaults)

    def _session(self, backend: Backend, defaults: dict[str, Any], streamed: bool = False,
                 on_text: TextListener | None = None) -> Session:
        log = TextLog() if streamed else None
        listener = log.append if log is not None else on_text
        session = Session(self.name, backend, Executor(backend, listener), defaults, self.limits)
        session.text_log = log
        return session

    def _execute(self, session: Session, kwargs: dict[str, Any]) -> ProgramState:
        """Run the body on ``session`` and wait for every node; the one place a run ends."""
        state = self.state_class(session)
        session.body_thread = threading.get_ident()
        try:
            try:
                session.return_value = self.fn(state, **kwargs)
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
        except ProgramError as exc:
            session.finish(exc)
            raise
        session.finish(None)
        return state

    def _execute_streamed(self, session: Session, kwargs: dict[str, Any]) -> None:
        with contextlib.suppress(ProgramError):  # recorded by finish(); raised to readers
            self._execute(session, kwargs)

    async def arun(self, *args: Any, backend: Any = None, **kwargs: Any) -> ProgramState:
        """``run`` for async callers: the body runs in a worker thread, the caller's loop
        stays free."""
        return await asyncio.to_thread(functools.partial(self.run, *args, backend=backend, **kwargs))

    def run_batch(
        self,
        batch_kwargs: Sequence[dict[str, Any] | Sequence[Any]],
        max_concurrency: int = 32,
        progress: bool = False,
        backend: Any = None,
        return_exceptions: bool = False,
        *,
        num_threads: int | str | None = None,
        progress_bar: bool | None = None,
        **defaults: Any,
    ) -> list[Any]:
        """Run once per entry, up to ``max_concurrency`` at a time.

        Args:
            batch_kwargs: one entry per run: a dict of arguments, or a tuple / list of
                positional arguments.
            max_concurrency (or ``num_threads``; ``"auto"`` keeps the default): runs in
                flight at once (their requests batch in the backend).
            progress (or ``progress_bar``): show a tqdm bar.
            backend: as in ``run``.
            return_exceptions: put a failed run's ``ProgramError`` in its slot instead of
                raising the first one after all runs finished.
            **defaults: sampling settings every run takes as its defaults (see ``run``).

        Returns:
            States (or errors) in the order of ``batch_kwargs``.
        """
        if num_threads is not None and num_threads != "auto":
            if not isinstance(num_threads, int) or num_threads < 1:
                raise ProgramDefinitionError(f"num_threads must be an integer >= 1 or 'auto', got {num_threads!r}")
            max_concurrency = num_threads
        progress = progress if progress_bar is None else progress_bar
        if unknown := defaults.keys() - RUN_SETTINGS:
            raise ProgramDefinitionError(f"run_batch got unknown settings {sorted(unknown)}")
        resolved = resolve_backend(backend)

        def one(entry: dict[str, Any] | Sequence[Any]) -> Any:
            args, kwargs = ((), entry) if isinstance(entry, dict) else (tuple(entry), {})
            try:
                return self.run(*args, backend=resolved, **kwargs, **defaults)
            except ProgramError as exc:
                return exc

        with ThreadPoolExecutor(max(1, max_concurrency), thread_name_prefix=f"arbor-{self.name}") as pool:
            futures = [pool.submit(one, entry) for entry in batch_kwargs]
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

    def stream(self, *args: Any, backend: Any = None, **kwargs: Any) -> Iterator[str]:
        """Run and yield the root state's text as it is produced (constant text and
        generated deltas, in order). Raises ``ProgramError`` at the end if the run failed."""
        yield from self.run(*args, backend=backend, stream=True, **kwargs).text_iter()

    def trace(self, *args: Any, backend: Any = None, **example_args: Any) -> Graph:
        """The request graph for these arguments, built without running the model.

        A generated value that flows only into later prompts becomes an edge (a ``var``
        node) and tracing goes on; tracing stops at the first use of a generated value in
        control flow: the returned graph then has ``complete == False`` and ``stop``
        naming it; the operations after it depend on the value and run interpreted under
        ``run``. The backend is only used for its chat template.
        """
        backend, example_args, defaults = self._bind(args, backend, example_args)
        session = Session(self.name, resolve_backend(backend), executor=None, defaults=defaults,
                          limits=self.limits)
        with contextlib.suppress(TraceStop):
            self.fn(self.state_class(session), **example_args)
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
        # NOTE: deferred (like as_backend's): frontend_dsl.program_host loads the engine side
        # (runtime, torch), which `import frontend_dsl` must not; a server has it loaded.
        from frontend_dsl.program_host import ProgramHost

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


# What ``run`` takes as the run's sampling defaults (``max_new_tokens`` is SGLang's name).
RUN_SETTINGS = frozenset(SAMPLING_SETTINGS) | {"max_new_tokens"}


def run_defaults(settings: dict[str, Any]) -> dict[str, Any]:
    """A run's sampling settings under ``GenParams`` names, checked.

    Raises:
        ProgramDefinitionError: an invalid setting, or both max_tokens and max_new_tokens.
    """
    out = {k: v for k, v in settings.items() if v is not None}
    if "max_new_tokens" in out:
        if "max_tokens" in out:
            raise ProgramDefinitionError("give max_tokens or max_new_tokens, not both")
        out["max_tokens"] = out.pop("max_new_tokens")
    for key in ("stop", "stop_regex"):
        if isinstance(out.get(key), str):
            out[key] = (out[key],)
    for key in ("stop", "stop_regex", "stop_token_ids"):
        if key in out:
            out[key] = tuple(out[key])
    try:
        check_params(GenParams(**out))
    except TypeError as exc:
        raise ProgramDefinitionError(f"bad run settings: {exc}") from None
    return out


def _is_backend(value: Any) -> bool:
    """Whether ``value`` is a backend or an engine (a leading positional ``backend``)."""
    if isinstance(value, Backend):
        return True
    engine_module = sys.modules.get("runtime.engine")  # loaded whenever an Engine exists
    return engine_module is not None and isinstance(value, engine_module.Engine)

