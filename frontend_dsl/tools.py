"""Tools: typed Python functions the model can call.

``@tool`` builds a pydantic model from the function's signature; its JSON schema is the
tool's argument schema. A ``gen(..., tools=[...])`` constrains the model to one call,

    {"name": "<one tool's name>", "arguments": {<that tool's arguments>}}

which is parsed, validated against the tool's argument model and executed. The result
(or the error, when parsing, validation or the tool itself fails) goes into the state and
into a ``ToolCall``; a failing tool never fails the program or the engine.
"""

from __future__ import annotations

import asyncio
import inspect
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, get_type_hints

import pydantic

from frontend_dsl.errors import ProgramDefinitionError


@dataclass(frozen=True, eq=False)
class Tool:
    """A callable tool with a name, a description and a pydantic argument model."""

    name: str
    description: str
    fn: Callable[..., Any]
    args_model: type[pydantic.BaseModel]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def parameters_schema(self) -> dict[str, Any]:
        """JSON schema of the arguments object."""
        return self.args_model.model_json_schema()

    def spec(self) -> dict[str, Any]:
        """OpenAI-style description: name, description, parameters."""
        return {"name": self.name, "description": self.description,
                "parameters": self.parameters_schema()}


def tool(fn: Callable[..., Any] | None = None, *, name: str | None = None) -> Any:
    """Decorator: turn a typed function into a ``Tool``.

    Every parameter needs a type hint; defaults become optional arguments. The docstring
    is the description. Use bare (``@tool``) or with a name (``@tool(name="search")``).
    """
    def wrap(f: Callable[..., Any]) -> Tool:
        return Tool(name or f.__name__, inspect.getdoc(f) or "", f, _args_model(f))

    return wrap(fn) if fn is not None else wrap


def _args_model(fn: Callable[..., Any]) -> type[pydantic.BaseModel]:
    hints = get_type_hints(fn)
    fields: dict[str, Any] = {}
    for param in inspect.signature(fn).parameters.values():
        if param.name not in hints:
            raise ProgramDefinitionError(f"tool {fn.__name__}: parameter {param.name!r} needs a type hint")
        default = ... if param.default is inspect.Parameter.empty else param.default
        fields[param.name] = (hints[param.name], default)
    model = pydantic.create_model(f"{fn.__name__}_args", **fields)
    model.model_config["extra"] = "forbid"
    model.model_rebuild(force=True)
    return model


def call_schema(tools: Sequence[Tool]) -> dict[str, Any]:
    """JSON schema matching exactly one call to one of ``tools`` (``$defs`` hoisted so
    references inside argument schemas stay valid)."""
    defs: dict[str, Any] = {}
    options = []
    for t in tools:
        params = dict(t.parameters_schema())
        defs.update(params.pop("$defs", {}))
        options.append({
            "type": "object",
            "properties": {"name": {"const": t.name}, "arguments": params},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        })
    schema: dict[str, Any] = {"anyOf": options} if len(options) > 1 else options[0]
    if defs:
        schema["$defs"] = defs
    return schema


@dataclass
class ToolCall:
    """One executed (or failed) tool call, the value of a ``gen(..., tools=...)`` variable."""

    text: str  # what the model generated
    name: str | None = None
    arguments: dict[str, Any] | None = None
    result: Any = None
    error: str | None = None  # set when the call could not be parsed/validated or raised

    @property
    def ok(self) -> bool:
        return self.error is None

    def observation(self) -> str:
        """The text appended to the state after the call."""
        if self.error is not None:
            return f"Error: {self.error}"
        return self.result if isinstance(self.result, str) else json.dumps(self.result, default=str)


async def execute_call(text: str, tools: Sequence[Tool]) -> ToolCall:
    """Parse ``text`` as a call to one of ``tools``, validate and run it.

    Sync tools run in a worker thread so a slow tool does not stall the event loop.
    Never raises for a bad call or a failing tool: the ``ToolCall`` carries the error.
    """
    call = ToolCall(text)
    try:
        payload = json.loads(text)
        call.name = payload["name"]
        call.arguments = payload["arguments"]
        chosen = next((t for t in tools if t.name == call.name), None)
        if chosen is None:
            raise ValueError(f"unknown tool {call.name!r}")
        args = chosen.args_model.model_validate(call.arguments)
        call.result = await _invoke(chosen, dict(args))
    except Exception as exc:  # noqa: BLE001 - a tool's failure belongs to the program
        call.error = f"{type(exc).__name__}: {exc}"
    return call


async def _invoke(t: Tool, kwargs: dict[str, Any]) -> Any:
    if inspect.iscoroutinefunction(t.fn):
        return await t.fn(**kwargs)
    return await asyncio.to_thread(t.fn, **kwargs)
