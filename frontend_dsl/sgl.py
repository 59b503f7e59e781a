"""SGLang's frontend names over Arbor's DSL: ``import frontend_dsl.sgl as sgl``.

A program written for SGLang's ``python/sglang/lang`` runs unchanged on Arbor's engine or
on ``arbor serve`` (``sgl.RuntimeEndpoint``)::

    @sgl.function
    def qa(s, question):
        s += sgl.user(question)
        s += sgl.assistant(sgl.gen("answer", max_tokens=64))

    sgl.set_default_backend(sgl.RuntimeEndpoint("http://127.0.0.1:30000"))
    state = qa.run(question="...", temperature=0)
    state["answer"], state.text(), state.messages(), state.get_meta_info("answer")

What differs from Arbor's own names: ``gen(json_schema=...)`` takes the schema as JSON
text (or a dict / pydantic class) and the variable holds the generated TEXT, as SGLang's
does; ``select``'s ``choices_method`` takes SGLang's method objects (or a subclass of
``ChoicesSamplingMethod`` of the user's own); ``get_meta_info`` gives SGLang's keys.
Things Arbor has no counterpart for (images, video, separate_reasoning, the
``Runtime`` launcher, API speculative execution) raise ``UnsupportedFeatureError``
naming them.
"""

from __future__ import annotations

import functools
import json
import statistics
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from frontend_dsl.default_backend import set_default_backend
from frontend_dsl.errors import ProgramDefinitionError, ProgramError, UnsupportedFeatureError
from frontend_dsl.primitives import (
    Expr,
    Gen,
    Select,
    assistant_begin,
    assistant_end,
    system_begin,
    system_end,
    user_begin,
    user_end,
)
from frontend_dsl.primitives import gen as _gen
from frontend_dsl.primitives import select as _select
from frontend_dsl.program import Program
from frontend_dsl.roles import Role
from frontend_dsl.state import ProgramState

__all__ = [
    "ChoicesDecision", "ChoicesSamplingMethod", "Engine", "OpenAI", "ProgramDefinitionError", "ProgramError",
    "UnsupportedFeatureError", "Runtime", "RuntimeEndpoint",
    "assistant", "assistant_begin", "assistant_end", "function", "gen", "gen_int", "gen_string",
    "greedy_token_selection", "image", "select", "separate_reasoning", "set_default_backend",
    "system", "system_begin", "system_end", "token_length_normalized",
    "unconditional_likelihood_normalized", "user", "user_begin", "user_end", "video",
]


# ---- choices methods (SGLang's ``sglang.lang.choices``) ----

@dataclass
class ChoicesDecision:
    decision: str
    meta_info: dict[str, Any] | None = None


class ChoicesSamplingMethod(ABC):
    """SGLang's interface for a select method; subclass it for a method of your own.

    ``input_token_logprobs[i]`` lists ``(logprob, token_id, None)`` per token of choice
    ``i``; ``unconditional_token_logprobs`` (asked for by
    ``requires_unconditional_logprobs``) the same without the state as context, the first
    logprob None. ``output_token_logprobs`` is empty per choice (Arbor scores no token
    after a choice)."""

    @property
    def requires_unconditional_logprobs(self) -> bool:
        return False

    @abstractmethod
    def __call__(self, *, choices: list[str], normalized_prompt_logprobs: list[float],
                 input_token_logprobs: list[list[Any]], output_token_logprobs: list[list[Any]],
                 unconditional_token_logprobs: list[list[Any]] | None = None) -> ChoicesDecision: ...


class _Named(ChoicesSamplingMethod):
    """One of SGLang's built-in methods: Arbor runs its own method of the same meaning."""

    def __init__(self, arbor_name: str) -> None:
        self.arbor_name = arbor_name

    def __call__(self, **kwargs: Any) -> ChoicesDecision:  # pragma: no cover - never called
        raise AssertionError("built-in methods are run by name")


token_length_normalized = _Named("token_length_normalized")
greedy_token_selection = _Named("greedy_token_selection")
unconditional_likelihood_normalized = _Named("unconditional_likelihood_normalized")


class _Adapter:
    """A user's ``ChoicesSamplingMethod`` as an Arbor select method (see ``select``)."""

    def __init__(self, method: ChoicesSamplingMethod) -> None:
        self.method = method
        self.__name__ = type(method).__name__
        self.requires_unconditional_logprobs = method.requires_unconditional_logprobs

    def __call__(self, *, choices: list[str], token_logprobs: list[list[float]],
                 unconditional_token_logprobs: list[list[float]] | None) -> str:
        uncond = None if unconditional_token_logprobs is None else [
            [(None if i == 0 else lp, None, None) for i, lp in enumerate(row)]
            for row in unconditional_token_logprobs]
        decision = self.method(
            choices=choices,
            normalized_prompt_logprobs=[statistics.fmean(lp) if lp else 0.0 for lp in token_logprobs],
            input_token_logprobs=[[(lp, None, None) for lp in row] for row in token_logprobs],
            output_token_logprobs=[[] for _ in choices], unconditional_token_logprobs=uncond)
        return decision.decision if isinstance(decision, ChoicesDecision) else decision


def _method(choices_method: Any) -> str | Callable[..., Any]:
    if choices_method is None:
        return "token_length_normalized"
    if isinstance(choices_method, _Named):
        return choices_method.arbor_name
    if isinstance(choices_method, ChoicesSamplingMethod):
        return _Adapter(choices_method)
    return choices_method  # a name or a plain callable: Arbor's own forms


# ---- expressions ----

def gen(
    name: str | None = None, max_tokens: int | None = None, min_tokens: int | None = None,
    n: int | None = None, stop: str | list[str] | None = None, stop_token_ids: list[int] | None = None,
    stop_regex: str | list[str] | None = None, temperature: float | None = None,
    top_p: float | None = None, top_k: int | None = None, min_p: float | None = None,
    frequency_penalty: float | None = None, presence_penalty: float | None = None,
    ignore_eos: bool | None = None, return_logprob: bool | None = None,
    logprob_start_len: int | None = None, top_logprobs_num: int | None = None,
    return_text_in_logprobs: bool | None = None, dtype: type | str | None = None,
    choices: list[str] | None = None, choices_method: Any = None, regex: str | None = None,
    json_schema: Any = None, **arbor: Any,
) -> Expr:
    """SGLang's ``gen`` (same parameters, same order). ``json_schema`` may be JSON text;
    the variable then holds the generated JSON text. Arbor's own keyword arguments
    (``seed``, ``repetition_penalty``, ``grammar``, ``tools``...) pass through."""
    del return_text_in_logprobs  # token texts are always given by get_meta_info
    if choices is not None:
        return select(name, choices, temperature or 0.0, choices_method)
    schema = json.loads(json_schema) if isinstance(json_schema, str) else json_schema
    expr = _gen(name, max_tokens, stop, temperature, top_p, top_k, min_p, regex=regex,
                json_schema=schema, dtype=dtype, n=n, stop_token_ids=stop_token_ids,
                stop_regex=stop_regex, ignore_eos=ignore_eos, min_tokens=min_tokens,
                frequency_penalty=frequency_penalty, presence_penalty=presence_penalty,
                return_logprob=return_logprob, top_logprobs_num=top_logprobs_num,
                logprob_start_len=logprob_start_len, **arbor)
    return replace(expr, as_text=True) if schema is not None and isinstance(expr, Gen) else expr


def gen_int(name: str | None = None, **kwargs: Any) -> Expr:
    return gen(name, dtype=int, **kwargs)


def gen_string(name: str | None = None, **kwargs: Any) -> Expr:
    return gen(name, dtype=str, **kwargs)


def select(name: str | None = None, choices: Sequence[str] | None = None, temperature: float = 0.0,
           choices_method: Any = token_length_normalized) -> Select:
    """SGLang's ``select``: ``choices_method`` is one of ``token_length_normalized``
    (default), ``greedy_token_selection``, ``unconditional_likelihood_normalized`` or a
    ``ChoicesSamplingMethod`` of your own."""
    if choices is None:
        raise ProgramDefinitionError("select needs choices=")
    return _select(name, choices, _method(choices_method), temperature=temperature)


def _role(role: str, expr: Expr | str | None) -> Role:
    return Role(role, () if expr is None else (expr,))


def system(expr: Expr | str | None = None) -> Role:
    return _role("system", expr)


def user(expr: Expr | str | None = None) -> Role:
    return _role("user", expr)


def assistant(expr: Expr | str | None = None) -> Role:
    return _role("assistant", expr)


def image(expr: Any) -> Expr:
    raise UnsupportedFeatureError("sgl.image: Arbor's models are text-only; images are not supported")


def video(path: str, num_frames: int) -> Expr:
    raise UnsupportedFeatureError("sgl.video: Arbor's models are text-only; video is not supported")


def separate_reasoning(expr: Any = None, model_type: str | None = None) -> Expr:
    raise UnsupportedFeatureError("sgl.separate_reasoning: Arbor has no reasoning parser; "
                                  "split the text after the run")


# ---- backends ----

def RuntimeEndpoint(base_url: str, api_key: str | None = None, verify: Any = None,  # noqa: N802
                    chat_template_name: str | None = None) -> Any:
    """A running ``arbor serve`` (SGLang's ``RuntimeEndpoint``)."""
    if chat_template_name is not None:
        raise UnsupportedFeatureError("RuntimeEndpoint(chat_template_name=...): Arbor renders roles "
                                      "with the served model's own chat template")
    if verify is not None:
        raise UnsupportedFeatureError("RuntimeEndpoint(verify=...): TLS settings are not supported")
    from frontend_dsl.runtime_endpoint import RuntimeEndpoint as Endpoint

    return Endpoint(base_url, api_key=api_key)


def Engine(model_path: str = "default", **config: Any) -> Any:  # noqa: N802
    """An in-process engine (SGLang's ``sgl.Engine``): Arbor's ``runtime.Engine``."""
    from runtime import Engine as ArborEngine

    return ArborEngine(model=model_path, **config)


def OpenAI(model_name: str, base_url: str = "https://api.openai.com/v1", api_key: str | None = None,  # noqa: N802
           **kwargs: Any) -> Any:
    """An OpenAI(-compatible) server (SGLang's ``sgl.OpenAI``): Arbor's ``OpenAIBackend``
    with the plain OpenAI dialect (``base_url`` / ``dialect=`` for other servers)."""
    try:
        from frontend_dsl.openai_backend import OpenAIBackend  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        raise UnsupportedFeatureError("sgl.OpenAI needs frontend_dsl.openai_backend (OpenAIBackend)") from None
    kwargs.setdefault("dialect", "openai")
    return OpenAIBackend(base_url, model_name, api_key=api_key, **kwargs)


def Runtime(*args: Any, **kwargs: Any) -> Any:  # noqa: N802
    raise UnsupportedFeatureError("sgl.Runtime (a server launched by the program): start "
                                  "`arbor serve` and use sgl.RuntimeEndpoint(url), or sgl.Engine(model_path)")


# ---- functions and their state ----

class SglState(ProgramState):
    """SGLang's ``ProgramState`` reads on top of Arbor's."""

    def get_meta_info(self, name: str) -> dict[str, Any]:
        """SGLang's meta info of ``name``: finish reason, token counts and, when asked
        for, ``output_token_logprobs`` / ``output_top_logprobs`` /
        ``input_token_logprobs`` as ``(logprob, token_id, text)`` tuples."""
        meta = self.get_meta(name)
        out: dict[str, Any] = {k: meta[k] for k in ("finish_reason",) if k in meta}
        if "output_ids" in meta:
            out.update(prompt_tokens=meta["prompt_len"], completion_tokens=meta["num_output_tokens"],
                       cached_tokens=meta["num_cached_tokens"])
        decode = self._session.backend.decode
        if meta.get("logprobs") is not None:
            out["output_token_logprobs"] = [(lp, t, decode([t])) for lp, t in
                                            zip(meta["logprobs"], meta["output_ids"], strict=False)]
        if "top_logprobs" in meta:
            out["output_top_logprobs"] = [[(lp, t, decode([t])) for t, lp in step.items()]
                                          for step in meta["top_logprobs"]]
        if "prompt_logprobs" in meta:
            out["input_token_logprobs"] = [(lp, None, None) for lp in meta["prompt_logprobs"] if lp is not None]
        for key in ("scores", "token_logprobs", "unconditional_token_logprobs", "branches"):
            if key in meta:
                out[key] = meta[key]
        return out

    def get_var(self, name: str) -> Any:
        return self[name]

    def set_var(self, name: str, value: Any) -> None:
        self[name] = value

    def sync(self) -> SglState:
        """Wait for the run to finish (SGLang's ``state.sync()``)."""
        self.wait()
        return self

    @property
    def ret_value(self) -> Any:
        """What the function returned."""
        self.wait()
        return self._session.return_value

    def error(self) -> BaseException | None:
        """The run's error, None if it succeeded (waits for it)."""
        try:
            self.wait()
        except Exception as exc:  # noqa: BLE001 - returned, as SGLang's error() does
            return exc
        return None


class SglFunction(Program):
    """SGLang's ``SglFunction``: ``run``, ``run_batch`` and ``trace`` with its argument names."""

    state_class = SglState

    def run(self, *args: Any, backend: Any = None, stream: bool = False, use_thread: bool = True,
            return_text_in_logprobs: bool | None = None, **kwargs: Any) -> SglState:
        del use_thread, return_text_in_logprobs  # always threaded; token texts always given
        state = super().run(*args, backend=backend, stream=stream, **kwargs)
        assert isinstance(state, SglState)
        return state

    def bind(self, **kwargs: Any) -> SglFunction:
        """The function with some arguments fixed (SGLang's ``bind``)."""
        if unknown := kwargs.keys() - set(self.arg_names):
            raise ProgramDefinitionError(f"{self.name} has no parameters {sorted(unknown)}")
        fn = functools.partial(self.fn, **kwargs)
        fn.__name__ = self.name  # type: ignore[attr-defined]
        return SglFunction(fn)

    def run_batch(self, batch_kwargs: Sequence[Any], *args: Any, **kwargs: Any) -> list[Any]:
        kwargs.pop("use_thread", None)
        kwargs.pop("return_text_in_logprobs", None)
        return super().run_batch(batch_kwargs, *args, **kwargs)


# SGLang names with no Arbor counterpart: using one raises an error that names it.
_UNMAPPED = {
    "Anthropic": "the Anthropic backend", "VertexAI": "the VertexAI backend",
    "LiteLLM": "the LiteLLM backend", "flush_cache": "flush_cache (the radix cache evicts by itself)",
    "get_server_info": "get_server_info (use the server's GET /health and /metrics)",
}


def __getattr__(name: str) -> Any:
    if name in _UNMAPPED:
        raise UnsupportedFeatureError(f"sgl.{name}: {_UNMAPPED[name]} is not supported by Arbor")
    raise AttributeError(f"module 'frontend_dsl.sgl' has no attribute {name!r}")


def function(func: Callable[..., Any] | None = None, num_api_spec_tokens: int | None = None) -> Any:
    """``@sgl.function`` (or ``@sgl.function()``): an Arbor program with SGLang's state."""
    if num_api_spec_tokens is not None:
        raise UnsupportedFeatureError("sgl.function(num_api_spec_tokens=...): API speculative "
                                      "execution is not supported")
    if func is not None:
        return SglFunction(func)
    return SglFunction
