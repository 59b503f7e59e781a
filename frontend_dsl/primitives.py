"""The expressions a program appends to its state: ``gen``, ``select`` and sequences.

Expressions are immutable descriptions; appending one to a state (``s += expr``) turns it
into request-graph nodes (``tracer.py``). The same expression may be appended to many
states (``branches += gen(...)`` broadcasts it).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import grammars
from frontend_dsl.backend import GenParams
from frontend_dsl.errors import ProgramDefinitionError
from frontend_dsl.output_constraint import make_constraint

if TYPE_CHECKING:
    from frontend_dsl.tools import Tool

SelectMethod = Literal["normalized", "unnormalized"]


class Expr:
    """Base of everything that can be appended to a state. ``a + b`` makes a sequence."""

    def __add__(self, other: Expr | str) -> Seq:
        return Seq((self, other))

    def __radd__(self, other: Expr | str) -> Seq:
        return Seq((other, self))


@dataclass(frozen=True)
class Seq(Expr):
    """Several expressions appended in order."""

    items: tuple[Expr | str, ...]


@dataclass(frozen=True)
class Gen(Expr):
    """Generate text into variable ``name`` (unnamed: text only).

    With ``tools`` the model emits one call, constrained to the tools' names and argument
    schemas, which is executed and its result appended (see ``tools.py``).
    """

    name: str | None
    params: GenParams
    tools: tuple[Tool, ...] = ()
    tool_result_prefix: str = "\nObservation: "


@dataclass(frozen=True)
class Select(Expr):
    """Append the choice with the best score under the model, store it in ``name``."""

    name: str | None
    choices: tuple[str, ...]
    method: SelectMethod = "normalized"


def gen(
    name: str | None = None,
    max_tokens: int = 128,
    stop: str | Sequence[str] | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    seed: int | None = None,
    *,
    regex: str | None = None,
    json_schema: Any = None,
    choices: Sequence[str] | None = None,
    grammar: str | grammars.GrammarConstraint | None = None,
    strict: bool = False,
    json_bounds: bool = True,
    return_logprob: bool = False,
    tools: Sequence[Tool] | None = None,
    tool_result_prefix: str = "\nObservation: ",
    speculation: bool = True,
) -> Expr:
    """Generate text into variable ``name``.

    Args:
        name: variable that receives the value (``s[name]``); None keeps text only.
        max_tokens, stop, temperature, top_p, top_k, min_p, seed: sampling settings;
            None means the backend's default.
        regex / json_schema / grammar: constrain the output (at most one). With
            ``json_schema`` (a dict or a pydantic model class) the variable holds the
            validated object (a dict or a model instance). ``grammar`` is Lark text or a
            shipped grammar (``grammars.load_grammar("json")``); its output is checked with
            lark. An output cut by ``max_tokens`` before it is complete raises a
            ``GenerationError`` that says so.
        strict: with ``json_schema``, refuse a schema the engine could only enforce
            relaxed (keywords such as ``not`` or ``if``/``then``; the error names them).
            Without it such a schema generates under a relaxed grammar, the output is
            validated against the full schema, and ``s.get_meta(name)["constraint_check"]``
            says so.
        json_bounds: with ``json_schema``, False lifts the bounds on number literals
            (``grammars.JsonBounds``: 20 integer digits, 16 fraction digits, 3 exponent
            digits by default).
        choices: makes this a ``select`` over ``choices``, which scores every choice and
            samples nothing: the sampling arguments above are refused with it.
        return_logprob: also record per-token logprobs in ``s.get_meta(name)``.
        speculation: False turns speculative drafts off for this call (the output is the
            same either way; only speed differs).
        tools: make the model call one of these ``@tool`` functions; the variable then
            holds a ``ToolCall`` and the result is appended after ``tool_result_prefix``
            (which is refused without ``tools``).

    Returns:
        An expression to append to a state.

    Raises:
        ProgramDefinitionError: conflicting or inapplicable arguments.
    """
    if choices is not None:
        if any(v is not None for v in (regex, json_schema, grammar)) or tools:
            raise ProgramDefinitionError("choices= cannot be combined with other constraints")
        unused = _changed_from_defaults(
            max_tokens=max_tokens, stop=stop, temperature=temperature, top_p=top_p, top_k=top_k,
            min_p=min_p, seed=seed, return_logprob=return_logprob, speculation=speculation,
            tool_result_prefix=tool_result_prefix)
        if unused:
            raise ProgramDefinitionError(
                f"choices= makes this a select, which scores the choices and samples nothing: "
                f"{', '.join(unused)} would do nothing")
        return select(name, choices)
    if not tools and _changed_from_defaults(tool_result_prefix=tool_result_prefix):
        raise ProgramDefinitionError("tool_result_prefix= applies only with tools=")
    if max_tokens < 0:
        raise ProgramDefinitionError(f"max_tokens must be >= 0, got {max_tokens}")
    params = GenParams(
        max_tokens=max_tokens,
        stop=_stop_tuple(stop),
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        seed=seed,
        constraint=make_constraint(regex, json_schema, grammar, strict, json_bounds),
        return_logprob=return_logprob,
        speculation=speculation,
    )
    if tools and params.constraint is not None:
        raise ProgramDefinitionError("tools= sets its own constraint; drop regex/json_schema/grammar")
    return Gen(name, params, tuple(tools or ()), tool_result_prefix)


def select(
    name: str | None, choices: Sequence[str], method: SelectMethod = "normalized"
) -> Select:
    """Pick one of ``choices`` by the model's log-probability of its tokens.

    Args:
        name: variable that receives the chosen string.
        choices: non-empty candidate strings.
        method: "normalized" (default) ranks by mean token logprob, "unnormalized" by the
            sum. Ties go to the earliest choice.

    Each choice is scored on the tokens it adds to the state, by the boundary rule of
    ``tokens.py``; when a choice merges with the state's last token, every choice is
    scored from that token on, so all are compared over the same span. On an empty
    state the first token has no context and is not scored.
    """
    if not choices or any(not isinstance(c, str) or not c for c in choices):
        raise ProgramDefinitionError("select needs a non-empty list of non-empty strings")
    if method not in ("normalized", "unnormalized"):
        raise ProgramDefinitionError(f"unknown select method {method!r}")
    return Select(name, tuple(choices), method)


def _changed_from_defaults(**values: Any) -> list[str]:
    """The names among ``values`` (``gen`` arguments) not at ``gen``'s default."""
    defaults = inspect.signature(gen).parameters
    return [name for name, value in values.items() if value != defaults[name].default]


def _stop_tuple(stop: str | Sequence[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)
