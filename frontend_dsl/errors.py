"""Typed errors raised by the DSL. Every failure a program can meet maps to one of these."""

from __future__ import annotations

from typing import Any, Protocol


class PartialState(Protocol):
    """What ``ProgramError.state`` offers: the reads of a ``ProgramState``.

    A protocol rather than ``ProgramState`` itself, so this module imports nothing of the
    DSL (``state`` imports the errors).
    """

    def __getitem__(self, name: str) -> Any: ...

    def text(self) -> str: ...

    def token_ids(self) -> list[int]: ...

    def messages(self) -> list[dict[str, str]]: ...

    def variables(self) -> dict[str, Any]: ...


class DSLError(Exception):
    """Base class of every error the DSL raises on purpose."""


class ProgramDefinitionError(DSLError, ValueError):
    """The program is malformed: bad arguments to a primitive, a role opened twice..."""


class UnsupportedFeatureError(DSLError, NotImplementedError):
    """A feature of another front (SGLang's images, video...) that Arbor does not have;
    the message names it."""


class ProgramLimitError(ProgramDefinitionError):
    """A run went past one of its program's bounds (``ProgramLimits``: branches forked,
    tool calls); nothing past the bound was started."""


class GenerationError(DSLError):
    """One node (gen, select, tool call) failed: backend error or output failing its schema."""


class ProgramCancelledError(DSLError):
    """A node was cancelled because the program ended early (its body raised)."""


class ProgramError(DSLError):
    """A program run failed. ``state`` holds everything computed before the failure.

    ``__cause__`` is the original exception (a ``GenerationError`` or whatever the
    program's body raised). ``state.text()`` and ``state.variables()`` show the partial
    result; reading a variable whose node failed raises this error again.
    """

    def __init__(self, message: str, state: PartialState) -> None:
        super().__init__(message)
        self.state = state


class TraceStop(DSLError):
    """Raised inside a traced program when it reads a generated value.

    The tracer catches it: the graph ends at that read (see ``tracer.py``).
    """

    def __init__(self, reason: str, variable: str | None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.variable = variable
