"""Per-request sampling settings, validated at construction."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from runtime.cache.retention import MAX_SESSION_ID_LEN, Retention
from runtime.errors import InvalidRequestError
from runtime.sampling.reasoning import ReasoningSpan


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
    stop_regex: tuple[str, ...] = ()  # stop when the output text matches; the match is cut
    ignore_eos: bool = False
    min_tokens: int = 0  # EOS and stop ids are masked until this many tokens were generated
    # OpenAI's penalties (subtracted from the logits of tokens already in the output:
    # frequency x count, presence once) and the CTRL-style multiplicative one over prompt
    # and output (logit / p if > 0 else logit * p). 0, 0 and 1 switch them off.
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: bool = False  # logprob of each chosen token
    top_logprobs: int = 0  # also the k most likely tokens at each step
    prompt_logprobs: bool = False  # logprob of each prompt token given what precedes it
    logprob_start_len: int = 0  # first prompt position whose logprob is wanted
    skip_special_tokens: bool = True
    constraint: Any = None
    speculation: bool = True  # allow speculative drafts for this request
    # Latency targets in seconds for this request, over the engine's (EngineConfig.ttft_slo,
    # itl_slo); None: the engine's. They size prefill budgets (docs/serving-slo.md).
    ttft_slo: float | None = None
    itl_slo: float | None = None
    # Keep what this request computes for its session's next request (a DSL run, an HTTP
    # session): runtime/cache/retention.py. Never changes the output; the engine caps the TTL.
    retention: Retention | None = None
    # The output opens with a thinking span (a reasoning model): ``constraint`` applies
    # after it, its length is bounded (runtime/sampling/reasoning.py). None: no span.
    reasoning: ReasoningSpan | None = None

    def __post_init__(self) -> None:
        # Accept lists for convenience but store tuples (frozen, hashable).
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if isinstance(self.stop_regex, str):
            object.__setattr__(self, "stop_regex", (self.stop_regex,))
        else:
            object.__setattr__(self, "stop_regex", tuple(self.stop_regex))
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
        if any(not isinstance(s, str) or not s for s in self.stop_regex):
            raise bad("stop_regex patterns must be non-empty strings")
        for pattern in self.stop_regex:
            try:
                re.compile(pattern)
            except re.error as e:
                raise bad(f"stop_regex {pattern!r} is not a valid regular expression: {e}") from None
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.min_tokens > self.max_new_tokens:
            raise bad(f"min_tokens ({self.min_tokens}) must not exceed max_new_tokens ({self.max_new_tokens})")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise bad(f"{name} must be in [-2, 2], got {getattr(self, name)!r}")
        for name in ("ttft_slo", "itl_slo"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float)) and value > 0):
                raise bad(f"{name} must be a number of seconds > 0, got {value!r}")
        if not self.repetition_penalty > 0.0:
            raise bad(f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty!r}")
        if self.retention is not None:
            _check_retention(self.retention)
        if self.reasoning is not None and not isinstance(self.reasoning, ReasoningSpan):
            raise bad(f"reasoning must be a ReasoningSpan or None, got {type(self.reasoning).__name__}")

    @property
    def penalized(self) -> bool:
        """Whether any of the three penalties is on."""
        return bool(self.frequency_penalty or self.presence_penalty or self.repetition_penalty != 1.0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _check_retention(retention: Any) -> None:
    if not isinstance(retention, Retention):
        raise InvalidRequestError(f"retention must be a Retention, got {type(retention).__name__}")
    sid = retention.session_id
    if not isinstance(sid, str) or not 0 < len(sid) <= MAX_SESSION_ID_LEN:
        raise InvalidRequestError(f"retention session_id must be a string of 1 to {MAX_SESSION_ID_LEN} "
                                  f"characters, got {sid!r:.80}")
    ttl = retention.ttl_s
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not 0 < ttl < float("inf"):
        raise InvalidRequestError(f"retention ttl_s must be a number of seconds > 0, got {ttl!r}")
