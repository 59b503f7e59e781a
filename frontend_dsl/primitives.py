"""The expressions a program appends to its state: ``gen``, ``select`` and sequences.

Expressions are immutable descriptions; appending one to a state (``s += expr``) turns it
into request-graph nodes (``tracer.py``). The same expression may be appended to many
states (``branches += gen(...)`` broadcasts it).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import grammars
from frontend_dsl.backend import GenParams
from frontend_dsl.errors import ProgramDefinitionError
from frontend_dsl.gen_options import (
    DEFAULT_TOOL_RESULT_PREFIX,
    ChoiceOptions,
    ConstraintOptions,
    GenOptions,
    LogprobOptions,
    SamplingOptions,
    StopOptions,
    ToolOptions,
    str_tuple,
)
from frontend_dsl.output_constraint import make_constraint
from frontend_dsl.reasoning import THINK_END

if TYPE_CHECKING:
    from frontend_dsl.tools import Tool

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


# The settings a ``gen`` may leave unset to inherit the run's (``Program.run(temperature=...)``).
SAMPLING_SETTINGS = (
    "max_tokens", "stop", "temperature", "top_p", "top_k", "min_p", "seed", "stop_token_ids",
    "stop_regex", "ignore_eos", "min_tokens", "frequency_penalty", "presence_penalty",
    "repetition_penalty", "return_logprob", "top_logprobs_num", "logprob_start_len",
)

# ``dtype=``: the regex a typed ``gen`` is constrained to and how its text becomes the value.
DTYPES: dict[str, tuple[str, Callable[[str], Any]]] = {
    "int": (r"-?[0-9]{1,19}", int),
    "float": (r"-?[0-9]{1,19}(\.[0-9]{1,16})?", float),
    "bool": (r"(True|False)", lambda text: text == "True"),
    "str": (r'"([^"\\\n]|\\["\\nt])*"', json.loads),
}


@dataclass(frozen=True)
class Gen(Expr):
    """Generate text into variable ``name`` (unnamed: text only).

    With ``tools`` the model emits one call, constrained to the tools' names and argument
    schemas, which is executed and its result appended (see ``tools.py``). ``inherit``
    names the sampling settings the call left unset: a run's defaults fill them in when
    the expression is appended (``tracer.py``). ``n > 1`` is a fork of ``n`` branches,
    each generating, joined into a list.
    """

    name: str | None
    params: GenParams
    tools: tuple[Tool, ...] = ()
    tool_result_prefix: str = "\nObservation: "
    inherit: frozenset[str] = frozenset()
    dtype: str | None = None  # a key of DTYPES: the value is converted
    n: int = 1
    as_text: bool = False  # json_schema: keep the (validated) text, not the parsed object
    token_healing: bool = False
    reasoning_var: str | None = None  # gen(reasoning=...): the variable of the thinking span


# A user-supplied select method: called with the choices and, per choice, the logprobs of
# its tokens (and, when the callable has ``requires_unconditional_logprobs = True``, of the
# same tokens without the state as context); returns the chosen index or string.
ChoiceMethodFn = Callable[..., "int | str"]
SELECT_METHODS = ("token_length_normalized", "unnormalized", "greedy_token_selection",
                  "unconditional_likelihood_normalized")
_METHOD_ALIASES = {"normalized": "token_length_normalized", "greedy": "greedy_token_selection",
                   "unconditional": "unconditional_likelihood_normalized"}


@dataclass(frozen=True)
class Select(Expr):
    """Append the choice with the best score under the model, store it in ``name``."""

    name: str | None
    choices: tuple[str, ...]
    method: str | ChoiceMethodFn = "token_length_normalized"
    temperature: float = 0.0  # > 0: sample a choice from softmax(score / temperature)
    seed: int | None = None  # of that sampling

    @property
    def method_name(self) -> str:
        return self.method if isinstance(self.method, str) else getattr(
            self.method, "__name__", type(self.method).__name__)

    @property
    def needs_unconditional(self) -> bool:
        if isinstance(self.method, str):
            return self.method == "unconditional_likelihood_normalized"
        return bool(getattr(self.method, "requires_unconditional_logprobs", False))


@dataclass(frozen=True)
class RoleBegin(Expr):
    """``user_begin()``: open a message; everything appended until ``RoleEnd`` is its content."""

    role: str


@dataclass(frozen=True)
class RoleEnd(Expr):
    """``user_end()``: close the open message (which must be of ``role``)."""

    role: str


def gen(
    name: str | None = None,
    max_tokens: int | None = None,
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
    choices_method: str | ChoiceMethodFn | None = None,
    grammar: str | grammars.GrammarConstraint | None = None,
    dtype: type | str | None = None,
    strict: bool = False,
    json_bounds: bool = True,
    n: int | None = None,
    stop_token_ids: Sequence[int] | None = None,
    stop_regex: str | Sequence[str] | None = None,
    ignore_eos: bool | None = None,
    min_tokens: int | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    repetition_penalty: float | None = None,
    return_logprob: bool | None = None,
    top_logprobs_num: int | None = None,
    logprob_start_len: int | None = None,
    tools: Sequence[Tool] | None = None,
    tool_result_prefix: str = DEFAULT_TOOL_RESULT_PREFIX,
    speculation: bool = True,
    token_healing: bool = False,
    reasoning: bool | str = False,
    reasoning_budget: int | None = None,
) -> Expr:
    """Generate text into variable ``name``.

    Args:
        name: variable that receives the value (``s[name]``); None keeps text only.
        max_tokens (default 128), stop, temperature, top_p, top_k, min_p, seed: sampling
            settings. Every sampling setting left unset (None) takes the run's default
            (``p.run(temperature=0)``), else the backend's.
        stop_token_ids: ids that end the generation besides EOS; ``ignore_eos``: keep
            going past EOS; ``min_tokens``: EOS and stop ids are refused before this many
            tokens; ``stop_regex``: end when the output matches (the match is cut).
        frequency_penalty, presence_penalty ([-2, 2], OpenAI's), repetition_penalty
            (> 0, 1 = off): penalties applied by the engine's sampler.
        regex / json_schema / grammar / dtype: constrain the output (at most one). With
            ``json_schema`` (a dict or a pydantic model class) the variable holds the
            validated object (a dict or a model instance). ``grammar`` is Lark text or a
            shipped grammar (``grammars.load_grammar("json")``); its output is checked with
            lark. ``dtype`` (``int``, ``float``, ``bool``, ``str`` or their names)
            constrains the output to a literal of that type (a quoted string for ``str``)
            and the variable holds the converted value. An output cut by ``max_tokens``
            before it is complete raises a ``GenerationError`` that says so.
        strict: with ``json_schema``, refuse a schema the engine could only enforce
            relaxed (keywords such as ``not`` or ``if``/``then``; the error names them).
            Without it such a schema generates under a relaxed grammar, the output is
            validated against the full schema, and ``s.get_meta(name)["constraint_check"]``
            says so.
        json_bounds: with ``json_schema``, False lifts the bounds on number literals
            (``grammars.JsonBounds``: 20 integer digits, 16 fraction digits, 3 exponent
            digits by default).
        choices: makes this a ``select`` over ``choices`` (scored with ``choices_method``
            and ``temperature``); the other sampling arguments are refused with it.
        n: sugar for a fork: ``n`` branches generate (``seed + i`` each when ``seed`` is
            set) and the variable holds the list of their values; the state itself gets
            no generated text.
        return_logprob: record per-token logprobs in ``s.get_meta(name)["logprobs"]``;
            ``top_logprobs_num`` adds the k likeliest tokens per step (``top_logprobs``),
            ``logprob_start_len`` the prompt's logprobs from that position
            (``prompt_logprobs``). Either of the two turns ``return_logprob`` on.
        speculation: False turns speculative drafts off for this call (the output is the
            same either way; only speed differs).
        token_healing: when the state ends with appended text, generate from one token
            earlier, constrained to re-produce that token's text, so the model may pick a
            token that spans the boundary (``"http:" + gen()`` can continue with ``"//"``).
        tools: make the model call one of these ``@tool`` functions; the variable then
            holds a ``ToolCall`` and the result is appended after ``tool_result_prefix``
            (which is refused without ``tools``).
        reasoning: a reasoning model's output opens with a thinking span (``<think> ...
            </think>``): ``name`` gets the answer after it (the constraint applies to the
            answer only) and the thinking goes to its own variable, ``name + "_reasoning"``
            (True) or the one named here. ``reasoning_budget``: at most this many thinking
            tokens before the span is closed. The state holds the whole output. A
            constraint or budget needs a backend that starts it after the span (the
            in-process engine's).

    Returns:
        An expression to append to a state.

    Raises:
        ProgramDefinitionError: conflicting or inapplicable arguments.
    """
    options = GenOptions(
        sampling=SamplingOptions(max_tokens, temperature, top_p, top_k, min_p, seed, frequency_penalty,
                                 presence_penalty, repetition_penalty),
        stopping=StopOptions(str_tuple(stop), None if stop_token_ids is None else tuple(stop_token_ids),
                             str_tuple(stop_regex), ignore_eos, min_tokens),
        logprobs=LogprobOptions(return_logprob, top_logprobs_num, logprob_start_len),
        constraint=ConstraintOptions(regex, json_schema, grammar, dtype, strict, json_bounds),
        choice=ChoiceOptions(None if choices is None else tuple(choices), choices_method),
        tool=ToolOptions(tuple(tools or ()), tool_result_prefix),
        n=n, speculation=speculation, token_healing=token_healing,
        reasoning_var=_reasoning_var(name, reasoning, reasoning_budget), reasoning_budget=reasoning_budget)
    return gen_from_options(name, options)


def _reasoning_var(name: str | None, reasoning: bool | str, budget: int | None) -> str | None:
    if reasoning is False:
        if budget is not None:
            raise ProgramDefinitionError("reasoning_budget= applies only with reasoning=")
        return None
    if reasoning is True:
        if name is None:
            raise ProgramDefinitionError("reasoning=True names its variable after the gen's: give a name "
                                         "(or reasoning='variable')")
        return f"{name}_reasoning"
    if not isinstance(reasoning, str) or not reasoning:
        raise ProgramDefinitionError(f"reasoning= must be True or a variable name, got {reasoning!r}")
    return reasoning


def gen_from_options(name: str | None, options: GenOptions) -> Expr:
    """The expression of a ``gen`` call whose settings are grouped in ``options``: a
    ``Select`` when it has choices, else a ``Gen`` (see ``gen`` for the rules)."""
    if options.choice.choices is not None:
        if options.reasoning_var is not None:
            raise ProgramDefinitionError("choices= scores its choices and generates no thinking: drop reasoning=")
        return _select_instead(name, options)
    if options.choice.method is not None:
        raise ProgramDefinitionError("choices_method= applies only with choices=")
    if not options.tool.tools and options.tool.given():
        raise ProgramDefinitionError("tool_result_prefix= applies only with tools=")
    dtype_name = _dtype_name(options.constraint.dtype)
    params = _gen_params(options, dtype_name)
    _check_combinations(name, options, params)
    inherit = frozenset(k for k, v in options.inheritable().items() if v is None)
    return Gen(name, params, options.tool.tools, options.tool.result_prefix, inherit, dtype_name,
               1 if options.n is None else options.n, token_healing=options.token_healing,
               reasoning_var=options.reasoning_var)


def _select_instead(name: str | None, options: GenOptions) -> Expr:
    """``choices=``: a select, which scores the choices and samples nothing, so every
    setting but ``temperature`` and ``seed`` would do nothing and is refused."""
    if options.constraint.kinds() or options.tool.tools:
        raise ProgramDefinitionError("choices= cannot be combined with other constraints")
    sampling = options.sampling
    unused = [*(k for k in sampling.given() if k not in ("temperature", "seed")),
              *options.stopping.given(), *options.logprobs.given(), *options.tool.given(),
              *(["n"] if options.n is not None else []), *(["speculation"] if not options.speculation else []),
              *(["token_healing"] if options.token_healing else [])]
    if unused:
        names = [_KEYWORD.get(k, k) for k in unused]
        raise ProgramDefinitionError(
            f"choices= makes this a select, which scores the choices and samples nothing: "
            f"{', '.join(names)} would do nothing")
    assert options.choice.choices is not None
    return select(name, options.choice.choices, options.choice.method or "token_length_normalized",
                  temperature=sampling.temperature or 0.0, seed=sampling.seed)


# NOTE: option fields whose gen() keyword differs (for error messages)
_KEYWORD = {"result_prefix": "tool_result_prefix"}


def _gen_params(options: GenOptions, dtype_name: str | None) -> GenParams:
    constraint = options.constraint
    regex = constraint.regex
    if dtype_name is not None:
        if len(constraint.kinds()) > 1:
            raise ProgramDefinitionError("dtype= sets its own constraint; drop regex/json_schema/grammar")
        regex = DTYPES[dtype_name][0]
    settings = {**options.inheritable(), **vars(options.logprobs.resolved())}
    params = GenParams(
        constraint=make_constraint(regex, constraint.json_schema, constraint.grammar, constraint.strict,
                                   constraint.json_bounds),
        speculation=options.speculation, **{k: v for k, v in settings.items() if v is not None},
        reasoning_end=None if options.reasoning_var is None else THINK_END, reasoning_budget=options.reasoning_budget)
    check_params(params)
    return params


def _check_combinations(name: str | None, options: GenOptions, params: GenParams) -> None:
    if options.reasoning_var is not None and (options.tool.tools or options.token_healing or options.n):
        raise ProgramDefinitionError("reasoning= works with a free or constrained gen, not with tools=, "
                                     "token_healing= or n=")
    budget = options.reasoning_budget
    if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool) or budget < 0):
        raise ProgramDefinitionError(f"reasoning_budget must be an integer >= 0, got {budget!r}")
    if options.tool.tools and params.constraint is not None:
        raise ProgramDefinitionError("tools= sets its own constraint; drop regex/json_schema/grammar")
    if options.token_healing and (options.tool.tools or options.constraint.json_schema is not None
                                  or options.constraint.grammar is not None):
        raise ProgramDefinitionError("token_healing= works with a free or regex/dtype gen, "
                                     "not with json_schema=, grammar= or tools=")
    num = 1 if options.n is None else options.n
    if not isinstance(num, int) or num < 1:
        raise ProgramDefinitionError(f"n must be an integer >= 1, got {options.n!r}")
    if num > 1 and (name is None or options.tool.tools):
        raise ProgramDefinitionError("n > 1 needs a variable name and no tools= (its value is the list)")


def gen_int(name: str | None = None, **kwargs: Any) -> Expr:
    """``gen(name, dtype=int, ...)``: an integer literal; the variable holds an ``int``."""
    return gen(name, dtype=int, **kwargs)


def gen_string(name: str | None = None, **kwargs: Any) -> Expr:
    """``gen(name, dtype=str, ...)``: a double-quoted string literal; the variable holds
    its content (unquoted, escapes resolved)."""
    return gen(name, dtype=str, **kwargs)


def with_defaults(item: Gen, defaults: dict[str, Any]) -> Gen:
    """``item`` with the run's sampling ``defaults`` filling the settings it left unset.

    Raises:
        ProgramDefinitionError: the combined settings are invalid (e.g. a run's
            ``min_tokens`` above a gen's ``max_tokens``).
    """
    fill = {k: defaults[k] for k in item.inherit if k in defaults}
    if not fill:
        return item
    params = replace(item.params, **fill)
    check_params(params)
    return replace(item, params=params, inherit=item.inherit - fill.keys())


def check_params(params: GenParams) -> None:
    """Refuse sampling settings the engine would refuse, at the line that set them."""
    def bad(msg: str) -> ProgramDefinitionError:
        return ProgramDefinitionError(f"invalid sampling setting: {msg}")

    if not isinstance(params.max_tokens, int) or params.max_tokens < 0:
        raise bad(f"max_tokens must be >= 0, got {params.max_tokens!r}")
    if not isinstance(params.min_tokens, int) or not 0 <= params.min_tokens <= params.max_tokens:
        raise bad(f"min_tokens must be in [0, max_tokens={params.max_tokens}], got {params.min_tokens!r}")
    for key in ("frequency_penalty", "presence_penalty"):
        if not -2.0 <= getattr(params, key) <= 2.0:
            raise bad(f"{key} must be in [-2, 2], got {getattr(params, key)!r}")
    if not params.repetition_penalty > 0.0:
        raise bad(f"repetition_penalty must be > 0 (1 = off), got {params.repetition_penalty!r}")
    if not isinstance(params.top_logprobs_num, int) or not 0 <= params.top_logprobs_num <= 20:
        raise bad(f"top_logprobs_num must be an integer in [0, 20], got {params.top_logprobs_num!r}")
    if params.logprob_start_len is not None and (
            not isinstance(params.logprob_start_len, int) or params.logprob_start_len < 0):
        raise bad(f"logprob_start_len must be an integer >= 0, got {params.logprob_start_len!r}")
    if params.temperature is not None and not params.temperature >= 0:
        raise bad(f"temperature must be >= 0, got {params.temperature!r}")
    if any(not isinstance(i, int) or i < 0 for i in params.stop_token_ids):
        raise bad(f"stop_token_ids must be token ids, got {list(params.stop_token_ids)!r}")
    for pattern in params.stop_regex:
        try:
            re.compile(pattern)
        except (re.error, TypeError) as exc:
            raise bad(f"stop_regex {pattern!r} is not a valid regular expression: {exc}") from None


def _dtype_name(dtype: type | str | None) -> str | None:
    if dtype is None:
        return None
    name = dtype if isinstance(dtype, str) else getattr(dtype, "__name__", None)
    if name not in DTYPES:
        raise ProgramDefinitionError(f"dtype must be one of int, float, bool, str; got {dtype!r}")
    return name


def select(
    name: str | None, choices: Sequence[str],
    method: str | ChoiceMethodFn = "token_length_normalized",
    *, temperature: float = 0.0, seed: int | None = None,
    choices_method: str | ChoiceMethodFn | None = None,
) -> Select:
    """Pick one of ``choices`` by the model's log-probability of its tokens.

    Args:
        name: variable that receives the chosen string.
        choices: non-empty candidate strings.
        method (or ``choices_method``): how the choices' token logprobs become a decision:
            "token_length_normalized" ("normalized", the default) ranks by the mean token
            logprob; "unnormalized" by the sum; "greedy_token_selection" ("greedy") by
            the first token's logprob, later tokens breaking ties (a shorter choice is
            padded with its mean); "unconditional_likelihood_normalized"
            ("unconditional") by the mean of ``logprob(token | state) -
            logprob(token | choice alone)``, which removes the bias towards choices that
            are likely anywhere. Or a callable ``(choices, token_logprobs,
            unconditional_token_logprobs) -> index or choice`` (keyword arguments; the
            last is None unless it has ``requires_unconditional_logprobs = True``).
            Ties go to the earliest choice.
        temperature: 0 (default) takes the best; > 0 samples from
            ``softmax(score / temperature)`` (``seed`` makes it repeatable).

    Each choice is scored on the tokens it adds to the state, by the boundary rule of
    ``tokens.py``; when a choice merges with the state's last token, every choice is
    scored from that token on, so all are compared over the same span. On an empty
    state the first token has no context and is not scored.
    """
    if not choices or any(not isinstance(c, str) or not c for c in choices):
        raise ProgramDefinitionError("select needs a non-empty list of non-empty strings")
    method = choices_method if choices_method is not None else method
    if isinstance(method, str):
        method = _METHOD_ALIASES.get(method, method)
        if method not in SELECT_METHODS:
            raise ProgramDefinitionError(f"unknown select method {method!r}; expected one of "
                                         f"{SELECT_METHODS} or a callable")
    elif not callable(method):
        raise ProgramDefinitionError(f"select method must be a name or a callable, got {method!r}")
    if not isinstance(temperature, int | float) or temperature < 0:
        raise ProgramDefinitionError(f"select temperature must be >= 0, got {temperature!r}")
    if temperature > 0 and not isinstance(method, str):
        raise ProgramDefinitionError("temperature= samples by the score of a named method; "
                                     "a callable method decides by itself")
    return Select(name, tuple(choices), method, float(temperature), seed)


def user_begin() -> RoleBegin:
    """Open a user message: ``s += user_begin()`` ... ``s += user_end()``."""
    return RoleBegin("user")


def user_end() -> RoleEnd:
    return RoleEnd("user")


def system_begin() -> RoleBegin:
    return RoleBegin("system")


def system_end() -> RoleEnd:
    return RoleEnd("system")


def assistant_begin() -> RoleBegin:
    return RoleBegin("assistant")


def assistant_end() -> RoleEnd:
    return RoleEnd("assistant")
