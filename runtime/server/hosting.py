"""The hosting protocol: what the server needs from a program it runs over ``/programs``.

The server knows no program language. A program it hosts is any object that satisfies
``HostedProgram``; ``frontend_dsl.Program`` (a ``@program``) does, so
``arbor serve --programs file.py`` loads the file (``load_programs``) and hosts every such
object in it. The dependency points one way: the DSL imports this module, never the
reverse. This module imports no web framework, so a host implementation stays light.

One run, as the server drives it (``api/programs/routes.py``):

    program.validate_arguments(arguments)        -> arguments, or InvalidArgumentsError (422)
    async for event in program.run_hosted(engine, arguments):
        GenerationDone ...                       one per finished generation, in order
        ProgramOutcome                           last: the variables and the final text
    a failed run raises ProgramRunFailedError    (500 "program_failed")
        or ProgramLimitExceededError             (422 "program_limit": past its bounds)

Cancellation: the server closes the stream early (``aclose``, or cancelling the task that
awaits it) when the client leaves or the deadline passes. The implementation must then
abort every engine request of the run, so their KV pages go back to the pool at once.
"""

from __future__ import annotations

import importlib.util
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from runtime.errors import InvalidRequestError

if TYPE_CHECKING:
    from runtime.engine import Engine


@dataclass(frozen=True)
class GenerationDone:
    """One generation of the run finished (a ``gen``; scoring requests are not reported)."""

    text: str  # the generated text, stop string excluded
    finish_reason: str | None  # "stop" | "length" | "abort"... as in ``RequestOutput``
    num_completion_tokens: int  # generated tokens, EOS excluded


@dataclass(frozen=True)
class ProgramOutcome:
    """The result of a finished run; always the stream's last event."""

    variables: dict[str, Any]  # by name, as JSON-able values (objects, lists, str, numbers...)
    text: str  # the final text of the program's root state
    trace: dict[str, Any] | None = None  # the run's trace (``arbor.run_trace/1``), if recorded


RunEvent = GenerationDone | ProgramOutcome


@dataclass(frozen=True)
class ArgumentProblem:
    """One reason a program's arguments were refused (pydantic's error fields)."""

    loc: tuple[str | int, ...]  # path inside the arguments object, e.g. ("question",)
    msg: str  # e.g. "Field required"
    type: str  # e.g. "missing"


class InvalidArgumentsError(ValueError):
    """The arguments do not fit the program's signature (HTTP 422, one entry per problem)."""

    def __init__(self, problems: list[ArgumentProblem]) -> None:
        super().__init__("; ".join(f"{'.'.join(map(str, p.loc))}: {p.msg}" for p in problems))
        self.problems = problems


class ProgramRunFailedError(Exception):
    """A program raised, or one of its generations failed (the message says which).
    ``trace``: the failed run's trace (``arbor.run_trace/1``), if recorded."""

    def __init__(self, message: str, trace: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.trace = trace


class ProgramLimitExceededError(Exception):
    """A run went past one of its program's bounds (branches, tool calls): the arguments
    asked for more than the program allows (HTTP 422)."""


@runtime_checkable
class HostedProgram(Protocol):
    """A program the server can list and run by name."""

    @property
    def name(self) -> str:
        """The name clients run it by (``POST /programs/{name}``)."""

    @property
    def description(self) -> str:
        """One paragraph for ``GET /programs`` (may be empty)."""

    def arguments_schema(self) -> dict[str, Any]:
        """The JSON schema of the arguments object."""

    def validate_arguments(self, arguments: dict[str, Any]) -> dict[str, Any]:
        """The arguments as the program takes them (defaults filled in, values coerced).

        Raises:
            InvalidArgumentsError: they do not fit; nothing has run.
        """

    def run_hosted(self, engine: Engine, arguments: dict[str, Any]) -> AsyncGenerator[RunEvent, None]:
        """Run once on ``engine`` with validated ``arguments``, as a stream of events.

        Args:
            engine: the server's engine; the run shares it with every other request.
            arguments: what ``validate_arguments`` returned.

        Returns:
            An async generator, iterated on the server's event loop: a ``GenerationDone``
            per finished generation, then one ``ProgramOutcome``. Closing it early must
            abort the run's engine requests.

        Raises:
            ProgramRunFailedError: (from the iteration) the program failed.
        """


def load_programs(path: str | Path) -> dict[str, HostedProgram]:
    """The hosted programs of the Python file ``path``, by name.

    The file's ``PROGRAMS`` (a dict by name, or a list) if it defines one, else every
    top-level object that satisfies ``HostedProgram`` (``@program`` functions). Loading
    runs the file: it is the operator's own code, never a client's.
    """
    path = Path(path)
    if not path.is_file():
        raise InvalidRequestError(f"programs file {path} does not exist")
    spec = importlib.util.spec_from_file_location(f"arbor_programs_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    declared = getattr(module, "PROGRAMS", None)
    found = declared.values() if isinstance(declared, dict) else declared or vars(module).values()
    programs = {p.name: p for p in found if isinstance(p, HostedProgram) and not isinstance(p, type)}
    if declared is not None and len(programs) != len(declared):
        raise InvalidRequestError(f"{path}: PROGRAMS must hold only @program objects")
    return programs
