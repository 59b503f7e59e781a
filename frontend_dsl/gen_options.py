"""The settings of one ``gen`` call, grouped by what they govern.

``gen()`` keeps the flat keyword API users write (``gen("x", temperature=0, regex=...)``);
it packs its arguments into these typed groups, and ``primitives.gen_from_options`` checks
and builds the expression from them. Each group knows which of its settings were given
(``given()``), which is what the rules between groups are written in ("``choices=`` makes
this a select: sampling settings would do nothing").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from frontend_dsl.primitives import ChoiceMethodFn
    from frontend_dsl.tools import Tool

DEFAULT_TOOL_RESULT_PREFIX = "\nObservation: "


class _Group:
    def given(self) -> list[str]:
        """The names of the settings not at their default (in declaration order)."""
        return [f.name for f in fields(self)  # type: ignore[arg-type]
                if getattr(self, f.name) != f.default]


@dataclass(frozen=True)
class SamplingOptions(_Group):
    """How each token is drawn. ``None``: the run's default, else the backend's."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    frequency_penalty: float | None = None  # OpenAI's, in [-2, 2]
    presence_penalty: float | None = None  # OpenAI's, in [-2, 2]
    repetition_penalty: float | None = None  # > 0; 1 is off


@dataclass(frozen=True)
class StopOptions(_Group):
    """When the generation ends (besides ``max_tokens``). ``None``: inherited."""

    stop: tuple[str, ...] | None = None  # strings that end it (cut from the value)
    stop_token_ids: tuple[int, ...] | None = None  # ids that end it besides EOS
    stop_regex: tuple[str, ...] | None = None  # end when the output matches (the match is cut)
    ignore_eos: bool | None = None  # keep going past EOS
    min_tokens: int | None = None  # EOS and stop ids are refused before this many tokens


@dataclass(frozen=True)
class LogprobOptions(_Group):
    """Which log-probabilities are recorded in the variable's meta. ``None``: inherited."""

    return_logprob: bool | None = None
    top_logprobs_num: int | None = None  # the k likeliest tokens per step
    logprob_start_len: int | None = None  # the prompt's logprobs from this position

    def resolved(self) -> LogprobOptions:
        """Asking for top logprobs or prompt logprobs turns ``return_logprob`` on."""
        wants = bool(self.top_logprobs_num) or self.logprob_start_len is not None
        if wants and self.return_logprob is None:
            return LogprobOptions(True, self.top_logprobs_num, self.logprob_start_len)
        return self


@dataclass(frozen=True)
class ConstraintOptions(_Group):
    """What the output must match: at most one of ``regex``, ``json_schema``, ``grammar``
    and ``dtype``."""

    regex: str | None = None
    json_schema: Any = None  # a JSON-schema dict or a pydantic model class
    grammar: Any = None  # Lark text or a grammars.GrammarConstraint
    dtype: type | str | None = None  # int, float, bool or str (or their names)
    strict: bool = False  # refuse a schema that could only be enforced relaxed
    json_bounds: bool = True  # bound number literals (grammars.JsonBounds)

    def kinds(self) -> list[str]:
        return [k for k in ("regex", "json_schema", "grammar", "dtype") if getattr(self, k) is not None]


@dataclass(frozen=True)
class ChoiceOptions(_Group):
    """``choices=``: the call is a ``select`` over these strings instead."""

    choices: tuple[str, ...] | None = None
    method: str | ChoiceMethodFn | None = None


@dataclass(frozen=True)
class ToolOptions(_Group):
    """``tools=``: the model calls one of these ``@tool`` functions."""

    tools: tuple[Tool, ...] = ()
    result_prefix: str = DEFAULT_TOOL_RESULT_PREFIX  # text before the appended result


@dataclass(frozen=True)
class GenOptions:
    """Every setting of one ``gen`` call, grouped."""

    sampling: SamplingOptions = field(default_factory=SamplingOptions)
    stopping: StopOptions = field(default_factory=StopOptions)
    logprobs: LogprobOptions = field(default_factory=LogprobOptions)
    constraint: ConstraintOptions = field(default_factory=ConstraintOptions)
    choice: ChoiceOptions = field(default_factory=ChoiceOptions)
    tool: ToolOptions = field(default_factory=ToolOptions)
    n: int | None = None  # sugar for a fork of n branches whose values form a list
    speculation: bool = True  # False: no speculative drafts (same output, other speed)
    token_healing: bool = False
    # reasoning=: the variable that gets the thinking span (None: no span), its budget
    reasoning_var: str | None = None
    reasoning_budget: int | None = None

    def inheritable(self) -> dict[str, Any]:
        """The settings a run's defaults may fill in, by name: the given ones with their
        values, the rest None (``primitives.SAMPLING_SETTINGS`` lists the same names)."""
        return {f.name: getattr(group, f.name) for group in (self.sampling, self.stopping, self.logprobs)
                for f in fields(group)}


def str_tuple(value: str | Sequence[str] | None) -> tuple[str, ...] | None:
    if value is None:
        return None
    return (value,) if isinstance(value, str) else tuple(value)
