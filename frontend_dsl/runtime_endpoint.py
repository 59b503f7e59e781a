"""``RuntimeEndpoint(url)``: the DSL's ``Backend`` over a remote ``arbor serve``.

Everything goes over the server's native API as token ids (``runtime.server.client``),
so the server's radix cache matches branches exactly as the in-process backend does, and
a program gives the same greedy result in-process and remotely.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Sequence
from functools import cached_property
from typing import Any

import httpx
import pydantic

from frontend_dsl.backend import Backend, GenChunk, GenParams
from frontend_dsl.errors import GenerationError
from runtime.server.api.common.wire import ConstraintSpec, RetentionHint
from runtime.server.api.sglang.schema import NativeSamplingParams
from runtime.server.client import ArborClient, ServerError

log = logging.getLogger("arbor.dsl")
# The engine's own default for in-process runs (EngineConfig.retention_ttl_s).
DEFAULT_RETENTION_TTL_S = 30.0


def wire_params(params: GenParams) -> NativeSamplingParams:
    """The native API's sampling fields for one ``gen``."""
    fields: dict[str, Any] = {"max_new_tokens": params.max_tokens, "stop": list(params.stop),
                              "logprobs": params.return_logprob, "speculation": params.speculation}
    for key in ("temperature", "top_p", "top_k", "min_p", "seed"):
        if getattr(params, key) is not None:
            fields[key] = getattr(params, key)
    fields.update({k: list(v) if isinstance(v, tuple) else v for k, v in params.engine_extras().items()})
    if (c := params.constraint) is not None:
        fields["constraint"] = ConstraintSpec(**{c.kind: c.json_value()}, strict=c.strict,
                                              json_bounds=c.json_bounds)
    try:
        return NativeSamplingParams(**fields)
    except pydantic.ValidationError as exc:
        # NOTE: an older server's protocol lacks some fields (the penalties...); say which.
        raise GenerationError(f"the server's native API refuses these sampling settings: {exc}") from exc


class RuntimeEndpoint(Backend):
    """A remote Arbor server as a DSL backend.

    Args:
        url: the server's base URL, e.g. ``http://127.0.0.1:30000``.
        api_key: the server's API key, if it requires one.
        retention_ttl_s: the server keeps a program run's states for this many seconds
            after the run's latest request, and releases them when the run ends (a
            retention hint, docs/retention.md; at most the server's
            ``--retention-max-ttl-s``). None: no hint (plain LRU).
    """

    def __init__(self, url: str, api_key: str | None = None, timeout: float = 600.0,
                 retention_ttl_s: float | None = DEFAULT_RETENTION_TTL_S) -> None:
        self.client = ArborClient(url, api_key=api_key, timeout=timeout)
        self.retention_ttl_s = retention_ttl_s

    def _hint(self, run_id: str | None) -> RetentionHint | None:
        if run_id is None or self.retention_ttl_s is None:
            return None
        return RetentionHint(session_id=run_id, ttl_s=self.retention_ttl_s)

    def encode(self, text: str) -> list[int]:
        return self.client.encode(text)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.client.decode(list(token_ids))

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
        return self.client.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)

    @cached_property
    def eos_token_ids(self) -> list[int]:  # type: ignore[override]
        return self.client.tokenizer_info().eos_token_ids

    async def generate(self, input_ids: list[int], params: GenParams) -> AsyncIterator[GenChunk]:
        async for c in self.client.generate_stream(input_ids, wire_params(params), retention=self._hint(params.run_id)):
            meta = c.meta
            check = meta.constraint_check.model_dump() if meta and meta.constraint_check else None
            top = [{int(k): v for k, v in step.items()} for step in meta.top_logprobs] \
                if meta and meta.top_logprobs is not None else None
            yield GenChunk(c.delta_text, c.delta_token_ids, c.text or "", c.output_ids or [],
                           c.finish_reason, meta.logprobs if meta else None,
                           meta.cached_tokens if meta else 0, check, top_logprobs=top,
                           prompt_logprobs=meta.prompt_logprobs if meta else None,
                           num_tier_cached_tokens=meta.cached_tokens_details.tier
                           if meta and meta.cached_tokens_details else 0)

    async def score(self, input_ids: list[int], start: int, run_id: str | None = None) -> list[float]:
        return await self.client.score(input_ids, start, retention=self._hint(run_id))

    async def cache_prefix(self, input_ids: list[int], run_id: str | None = None) -> None:
        await self.client.cache_prefix(input_ids, retention=self._hint(run_id))

    def end_run(self, run_id: str) -> None:
        if self.retention_ttl_s is None:
            return
        try:
            self.client.end_session(run_id)  # None: nothing was pinned, or the TTL ran out
        except (ServerError, httpx.HTTPError) as exc:  # NOTE: the run's result stands; its pins expire
            log.warning("could not end run %s's retention session on the server: %s", run_id, exc)
