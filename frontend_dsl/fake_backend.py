"""A deterministic in-memory backend for testing DSL logic without a model.

It uses a real tokenizer (so token boundaries and chat templates are the real ones) but
"generates" with a ``responder`` function and "scores" with a ``logprob_fn``. It records
every request, the most requests in flight at once, and simulates a prefix cache so
tests can check that forks reuse their parent's ids.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from frontend_dsl.backend import Backend, GenChunk, GenParams
from frontend_dsl.hf_codec import HFCodec


@dataclass(frozen=True)
class FakeRequest:
    """One generate call as the fake backend saw it."""

    input_ids: tuple[int, ...]
    prompt: str
    params: GenParams


Responder = Callable[[FakeRequest], str]
LogprobFn = Callable[[Sequence[int], int], float]


def default_responder(request: FakeRequest) -> str:
    """" ok" repeated: always the same, whatever the prompt."""
    return " ok" * request.params.max_tokens


def default_logprob(context: Sequence[int], token: int) -> float:
    """A fixed pseudo-random log-probability in (-10, 0] for ``token`` after ``context``."""
    mixed = (token * 2654435761) ^ (len(context) * 40503) ^ (context[-1] if context else 0)
    return -((mixed % 1000) / 100.0)


class FakeBackend(Backend):
    """A ``Backend`` whose outputs are given by functions instead of a model."""

    def __init__(self, tokenizer: Any, responder: Responder = default_responder,
                 logprob_fn: LogprobFn = default_logprob, token_delay_s: float = 0.0) -> None:
        self.codec = HFCodec(tokenizer)
        self.responder = responder
        self.logprob_fn = logprob_fn
        self.token_delay_s = token_delay_s
        self.requests: list[FakeRequest] = []
        self.num_in_flight = 0
        self.max_in_flight = 0
        self.num_prompt_tokens = 0
        self.num_cached_tokens = 0
        self._cached: list[tuple[int, ...]] = []
        self.ended_runs: list[str] = []  # end_run calls, in order
        self.scored_runs: list[str | None] = []  # the run_id of each score call, in order

    def encode(self, text: str) -> list[int]:
        return self.codec.encode(text)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.codec.decode(token_ids)

    def apply_chat_template(self, messages: list[dict[str, str]],
                            add_generation_prompt: bool = False) -> str:
        return self.codec.render_chat(messages, add_generation_prompt)

    @property
    def eos_token_ids(self) -> list[int]:
        return [int(self.codec.tokenizer.eos_token_id)]

    async def generate(self, input_ids: list[int], params: GenParams) -> AsyncIterator[GenChunk]:
        request = FakeRequest(tuple(input_ids), self.decode(input_ids), params)
        self.requests.append(request)
        num_cached = self._hit(input_ids)
        out_ids = self._output_ids(self.responder(request), params)
        self.num_in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.num_in_flight)
        try:
            for token in out_ids:
                await asyncio.sleep(self.token_delay_s)
                yield GenChunk(self.decode([token]), [token])
            await asyncio.sleep(self.token_delay_s)
        finally:
            self.num_in_flight -= 1
        self._cached.append(tuple(input_ids) + tuple(out_ids))
        logprobs = [0.0] * len(out_ids) if params.return_logprob else None
        yield GenChunk("", [], self.decode(out_ids), out_ids,
                       "length" if len(out_ids) == params.max_tokens else "stop",
                       logprobs, num_cached)

    def _output_ids(self, text: str, params: GenParams) -> list[int]:
        cut = min((text.index(s) for s in params.stop if s in text), default=len(text))
        return self.encode(text[:cut])[: params.max_tokens]

    async def score(self, input_ids: list[int], start: int, run_id: str | None = None) -> list[float]:
        self.scored_runs.append(run_id)
        self._hit(input_ids)
        self._cached.append(tuple(input_ids))
        return [self.logprob_fn(input_ids[:i], input_ids[i]) for i in range(start, len(input_ids))]

    async def cache_prefix(self, input_ids: list[int], run_id: str | None = None) -> None:
        self._hit(input_ids)
        self._cached.append(tuple(input_ids))

    def end_run(self, run_id: str) -> None:
        self.ended_runs.append(run_id)

    def _hit(self, input_ids: Sequence[int]) -> int:
        """Longest cached prefix of ``input_ids``, counted into the metrics."""
        best = max((_common_len(c, input_ids) for c in self._cached), default=0)
        best = min(best, max(0, len(input_ids) - 1))  # the last prompt token is always computed
        self.num_prompt_tokens += len(input_ids)
        self.num_cached_tokens += best
        return best

    def metrics(self) -> dict[str, Any]:
        rate = self.num_cached_tokens / self.num_prompt_tokens if self.num_prompt_tokens else 0.0
        return {"cache_hit_rate": rate, "prompt_tokens": self.num_prompt_tokens,
                "cached_prompt_tokens": self.num_cached_tokens,
                "num_requests": len(self.requests), "max_in_flight": self.max_in_flight}


def _common_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
