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

    def describe(self) -> dict[str, Any]:
        """JSON-able view for the request graph."""
        out: dict[str, Any] = {"max_tokens": self.max_tokens, "stop": list(self.stop)}
        for key in ("temperature", "top_p", "top_k", "min_p", "seed"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if self.constraint is not None:
            out["constraint"] = self.constraint.describe()
        if self.return_logprob:
            out["return_logprob"] = True
        return out


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


class Backend(ABC):
    """What a DSL program needs from a model runner."""

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
    async def score(self, input_ids: list[int], start: int) -> list[float]:
        """``log p(input_ids[i] | input_ids[:i])`` for every ``i`` in ``[start, len)``.

        ``start`` must be >= 1 (the first token has no context).
        """

    async def cache_prefix(self, input_ids: list[int]) -> None:  # noqa: B027 - optional hook
        """Make ``input_ids`` resident in the prefix cache (called before a fork's branches
        start, so they all hit it). Backends without a cache do nothing."""

    def metrics(self) -> dict[str, Any]:
        """Backend counters (cache hit rate...); empty when the backend keeps none."""
        return {}
