"""Per-request sampling settings, validated at construction."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from runtime.errors import InvalidRequestError


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops.

    ``temperature == 0`` means greedy. ``top_k == 0`` and ``top_p == 1`` and
    ``min_p == 0`` switch those filters off. ``constraint`` takes anything that
    ``grammars.to_constraint`` accepts (a JSON schema dict, a pydantic model class, a
    ``grammars`` constraint object, an outlines output type); None means unconstrained.
    """

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()  # stop strings; the matched string is not in the output
    stop_token_ids: tuple[int, ...] = ()  # extra stop ids besides the model's EOS
    ignore_eos: bool = False
    logprobs: bool = False  # logprob of each chosen token
    top_logprobs: int = 0  # also the k most likely tokens at each step
    prompt_logprobs: bool = False  # logprob of each prompt token given what precedes it
    logprob_start_len: int = 0  # first prompt position whose logprob is wanted
    skip_special_tokens: bool = True
    constraint: Any = None
    speculation: bool = True  # allow speculative drafts for this request

    def __post_init__(self) -> None:
        # Accept lists for convenience but store tuples (frozen, hashable).
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        self._validate()

    def _validate(self) -> None:
        def bad(msg: str) -> InvalidRequestError:
            return InvalidRequestError(f"invalid sampling parameter: {msg}")

        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 0:
            raise bad(f"max_new_tokens must be an integer >= 0, got {self.max_new_tokens!r}")
        if not self.temperature >= 0.0:
            raise bad(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise bad(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not isinstance(self.top_logprobs, int) or not 0 <= self.top_logprobs <= 20:
            raise bad(f"top_logprobs must be an integer in [0, 20], got {self.top_logprobs!r}")
        if not isinstance(self.logprob_start_len, int) or self.logprob_start_len < 0:
            raise bad(f"logprob_start_len must be an integer >= 0, got {self.logprob_start_len!r}")
        if self.logprob_start_len and not self.prompt_logprobs:
            raise bad("logprob_start_len applies only with prompt_logprobs=True")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad(f"seed must be an integer or None, got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop strings must be non-empty strings")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
