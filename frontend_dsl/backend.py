"""The interface between the DSL and whatever runs the model.

The DSL only ever talks to a ``Backend``: it hands over token ids and ``GenParams`` and
gets text and token ids back. ``EngineBackend`` (in-process ``runtime.Engine``),
``RuntimeEndpoint`` (a remote ``arbor serve``) and ``FakeBackend`` (deterministic, for
tests) implement it; ``default_backend`` picks the one a run uses.

Locking rule: every coroutine here is awaited on the DSL's single event-loop thread
(``frontend_dsl.loop``); the synchronous tokenizer methods may be called from any thread
and must not mutate shared state.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from frontend_dsl.output_constraint import OutputConstraint


@dataclass(frozen=True)
class GenParams:
    """Sampling settings of one ``gen``. ``None`` means "the backend's default"."""

    max_tokens: int = 128
    stop: tuple[str, ...] = ()
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    constraint: OutputConstraint | None = None
    return_logprob: bool = False
    speculation: bool = True  # allow speculative drafts (never changes the output)
    stop_token_ids: tuple[int, ...] = ()  # extra ids that end the generation (besides EOS)
    stop_regex: tuple[str, ...] = ()  # end when the output matches; the match is cut
    ignore_eos: bool = False
    min_tokens: int = 0  # EOS and stop ids are refused before this many tokens
    frequency_penalty: float = 0.0  # OpenAI's: minus this x count of the token in the output
    presence_penalty: float = 0.0  # OpenAI's: minus this once the token is in the output
    repetition_penalty: float = 1.0  # CTRL's multiplicative one over prompt and output
    top_logprobs_num: int = 0  # with return_logprob: the k likeliest tokens at each step
    logprob_start_len: int | None = None  # with return_logprob: prompt logprobs from here
    # The program run this request belongs to (set by the executor): a backend with a
    # prefix cache keeps the run's state for its next request until ``end_run``.
    run_id: str | None = None
    # gen(reasoning=...): the output opens with a thinking span ending with this marker;
    # the constraint applies after it, and it lasts at most reasoning_budget tokens
    reasoning_end: str | None = None
    reasoning_budget: int | None = None

    def describe(self) -> dict[str, Any]:
        """JSON-able view for the request graph (fields at their defaults are left out)."""
        out: dict[str, Any] = {"max_tokens": self.max_tokens, "stop": list(self.stop)}
        for key in ("temperature", "top_p", "top_k", "min_p", "seed", "logprob_start_len"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        for key, default in _EXTRA_DEFAULTS.items():
            if getattr(self, key) != default:
                value = getattr(self, key)
                out[key] = list(value) if isinstance(value, tuple) else value
        if self.constraint is not None:
            out["constraint"] = self.constraint.describe()
        if self.return_logprob:
            out["return_logprob"] = True
        for key in ("reasoning_end", "reasoning_budget"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out

    def engine_extras(self) -> dict[str, Any]:
        """The stop / penalty / logprob settings that differ from their defaults, under
        the names of ``runtime.SamplingParams`` (and the native API), which both
        backends send only when set, so an older server keeps working without them."""
        out: dict[str, Any] = {}
        for key, default in _EXTRA_DEFAULTS.items():
            if getattr(self, key) != default:
                value = getattr(self, key)
                out[_ENGINE_NAMES.get(key, key)] = value
        if self.logprob_start_len is not None:
            out["prompt_logprobs"] = True
            out["logprob_start_len"] = self.logprob_start_len
        return out


# GenParams fields that go to the engine under (nearly) the same name, with their defaults.
_EXTRA_DEFAULTS: dict[str, Any] = {
    "stop_token_ids": (), "stop_regex": (), "ignore_eos": False, "min_tokens": 0,
    "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
    "top_logprobs_num": 0,
}
_ENGINE_NAMES = {"top_logprobs_num": "top_logprobs"}


@dataclass
class GenChunk:
    """One streaming step of a generation.

    ``delta_*`` is what is new since the previous chunk. On the final chunk
    (``finish_reason`` set) ``text`` / ``token_ids`` hold the whole output: ``text``
    never holds a stop string; ``token_ids`` excludes EOS.
    """

    delta_text: str
    delta_token_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[float] | None = None  # per generated token, when asked for
    num_cached_tokens: int = 0  # prompt tokens the backend served from its prefix cache
    # The backend's verdict on a constrained output (final chunk; the fields of
    # ``runtime.ConstraintCheck``: relaxed, valid, checked, error); None if it gives none.
    constraint_check: dict[str, Any] | None = None
    # Speculation of this generation (final chunk; 0 from backends that report none).
    num_draft_tokens: int = 0  # draft tokens verified (grammar-forced included)
    num_accepted_tokens: int = 0  # of those, accepted
    num_forced_tokens: int = 0  # draft tokens the grammar forced
    top_logprobs: list[dict[int, float]] | None = None  # per generated token: id -> logprob
    prompt_logprobs: list[float | None] | None = None  # per prompt token (None before start)
    # Of num_cached_tokens, those reloaded from the backend's host tier rather than found in
    # its KV pool (0 from backends without a tier, or that do not say).
    num_tier_cached_tokens: int = 0


class Backend(ABC):
    """What a DSL program needs from a model runner."""

    # Whether ``generate`` honours ``GenParams.reasoning_end`` (a constraint that starts
    # after the thinking span, a budget); without it only an unconstrained span is allowed.
    supports_reasoning: bool = False

    # ---- tokenizer side (synchronous, thread-safe) ----
    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; no BOS/EOS added, special-token text maps to its id."""

    @abstractmethod
    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of ``token_ids``, special tokens included (inverse of ``encode``)."""

    @abstractmethod
    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = False
    ) -> str:
        """The model's chat template rendered as text."""

    @property
    @abstractmethod
    def eos_token_ids(self) -> list[int]:
        """Ids that end a generation."""

    # ---- model side (coroutines on the DSL loop) ----
    @abstractmethod
    def generate(self, input_ids: list[int], params: GenParams) -> AsyncIterator[GenChunk]:
        """Stream a continuation of ``input_ids``; the last chunk has ``finish_reason``."""

    @abstractmethod
    async def score(self, input_ids: list[int], start: int, run_id: str | None = None) -> list[float]:
        """``log p(input_ids[i] | input_ids[:i])`` for every ``i`` in ``[start, len)``.

        ``start`` must be >= 1 (the first token has no context). ``run_id``: the program
        run asking (a ``select``'s scoring is kept for the run like its ``gen``s).
        """

    async def cache_prefix(self, input_ids: list[int], run_id: str | None = None) -> None:  # noqa: B027
        """Make ``input_ids`` resident in the prefix cache (called before a fork's branches
        start, so they all hit it), kept for ``run_id``'s later requests. Backends without
        a cache do nothing (an optional hook)."""

    def end_run(self, run_id: str) -> None:  # noqa: B027 - optional hook
        """The program run ``run_id`` ended: what the backend kept for it may go at once.
        Thread-safe. Backends that keep nothing per run do nothing."""

    def metrics(self) -> dict[str, Any]:
        """Backend counters (cache hit rate...); empty when the backend keeps none."""
        return {}
