"""``EngineBackend``: the DSL's ``Backend`` over an in-process ``runtime.Engine``.

It imports ``runtime`` (as ``hosting`` and ``runtime_endpoint`` do); ``import
frontend_dsl`` loads none of the three. Every request is sent as token ids, so the
engine's radix cache matches branches on the exact ids they share with their parent.
"""

from __future__ import annotations

import dataclasses
import uuid
import weakref
from collections.abc import AsyncIterator, Sequence
from typing import Any

from frontend_dsl.backend import Backend, GenChunk, GenParams
from frontend_dsl.errors import GenerationError
from frontend_dsl.hf_codec import HFCodec
from frontend_dsl.output_constraint import to_engine_constraint
from runtime import SamplingParams
from runtime.cache.retention import Retention
from runtime.sampling.reasoning import ReasoningSpan


def to_sampling_params(params: GenParams, retention: Retention | None = None,
                       reasoning: ReasoningSpan | None = None) -> SamplingParams:
    """The engine's ``SamplingParams`` for one ``gen``; unset fields keep engine defaults."""
    kwargs: dict[str, Any] = {"retention": retention, "max_new_tokens": params.max_tokens, "stop": params.stop,
                              "reasoning": reasoning,
                              "logprobs": params.return_logprob,
                              "speculation": params.speculation,
                              "constraint": to_engine_constraint(params.constraint)}
    for key in ("temperature", "top_p", "top_k", "min_p", "seed"):
        if getattr(params, key) is not None:
            kwargs[key] = getattr(params, key)
    kwargs.update(params.engine_extras())
    return SamplingParams(**kwargs)


def scoring_params(start: int, retention: Retention | None = None) -> SamplingParams:
    """Prefill-only request returning prompt logprobs from position ``start`` on."""
    return SamplingParams(max_new_tokens=0, prompt_logprobs=True, logprob_start_len=start, retention=retention)


class EngineBackend(Backend):
    """Adapter from the DSL's ``Backend`` to ``runtime.Engine``.

    Args:
        retain_runs: keep each program run's states in the engine's prefix cache until the
            run ends (``runtime/cache/retention.py``); off: plain LRU (the baseline).
    """

    supports_reasoning = True

    def __init__(self, engine: Any, retain_runs: bool = True) -> None:
        self.engine = engine
        self.codec = HFCodec(engine.tokenizer)
        self.retain_runs = retain_runs

    def _retention(self, run_id: str | None) -> Retention | None:
        """A run's hint: its own session, and its own owner (one page budget per run)."""
        if run_id is None or not self.retain_runs:
            return None
        return Retention(run_id, self.engine.config.retention_ttl_s, owner=run_id)

    def encode(self, text: str) -> list[int]:
        return self.codec.encode(text)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.codec.decode(token_ids)

    def apply_chat_template(self, messages: list[dict[str, str]],
                            add_generation_prompt: bool = False) -> str:
        return str(self.engine.apply_chat_template(messages, add_generation_prompt=add_generation_prompt))

    @property
    def eos_token_ids(self) -> list[int]:
        return list(self.engine.eos_token_ids)

    async def generate(self, input_ids: list[int], params: GenParams) -> AsyncIterator[GenChunk]:
        # NOTE: leaving this iteration early (the node was cancelled) makes the engine's
        # generate_stream abort the request, which frees its KV pages at once.
        async for out in self.engine.generate_stream(
            input_ids=input_ids,
            sampling_params=to_sampling_params(params, self._retention(params.run_id), self._span(params)),
            request_id=f"dsl-{uuid.uuid4().hex}",
        ):
            if out.error is not None:
                raise GenerationError(f"engine request failed: {out.error}")
            check = dataclasses.asdict(out.constraint_check) if out.constraint_check is not None else None
            yield GenChunk(out.delta_text, list(out.delta_token_ids), out.text, list(out.token_ids),
                           out.finish_reason, out.logprobs, out.num_cached_tokens, check,
                           num_draft_tokens=out.num_draft_tokens,
                           num_accepted_tokens=out.num_accepted_tokens,
                           num_forced_tokens=out.num_forced_tokens,
                           top_logprobs=out.top_logprobs, prompt_logprobs=out.prompt_logprobs,
                           num_tier_cached_tokens=out.num_tier_cached_tokens)

    def _span(self, params: GenParams) -> ReasoningSpan | None:
        if params.reasoning_end is None:
            return None
        end_ids = self.codec.encode(params.reasoning_end)
        return ReasoningSpan(tuple(end_ids), params.reasoning_budget)

    async def score(self, input_ids: list[int], start: int, run_id: str | None = None) -> list[float]:
        params = scoring_params(start, self._retention(run_id))
        out = await self.engine.agenerate(input_ids=input_ids, sampling_params=params)
        if out.error is not None or out.prompt_logprobs is None:
            raise GenerationError(f"engine returned no prompt logprobs: {out.error}")
        logprobs = out.prompt_logprobs[start:]
        if any(lp is None for lp in logprobs):
            raise GenerationError(f"engine prompt logprobs missing from position {start}")
        return [float(lp) for lp in logprobs if lp is not None]

    async def cache_prefix(self, input_ids: list[int], run_id: str | None = None) -> None:
        params = SamplingParams(max_new_tokens=0, retention=self._retention(run_id))
        await self.engine.agenerate(input_ids=input_ids, sampling_params=params)

    def end_run(self, run_id: str) -> None:
        if self.retain_runs:
            self.engine.end_session(run_id)

    def metrics(self) -> dict[str, Any]:
        return dict(self.engine.metrics())


_engine_backends: weakref.WeakKeyDictionary[Any, EngineBackend] = weakref.WeakKeyDictionary()


def backend_for(engine: Any) -> EngineBackend:
    """The ``EngineBackend`` of ``engine``: one per engine, so per-backend caches (role
    affixes...) are shared by every run on it."""
    backend = _engine_backends.get(engine)
    if backend is None:
        backend = _engine_backends[engine] = EngineBackend(engine)
    return backend
