"""A DSL ``Backend`` over ``runtime.server.client.ArborClient`` (test reference).

This is what ``RuntimeEndpoint(url)`` needs to do; it lives with the tests because the
server may not edit ``frontend_dsl/``. It shows the client covers the whole interface.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

from frontend_dsl.backend import Backend, GenChunk, GenParams
from runtime.server.client import ArborClient
from runtime.server.protocol import ConstraintSpec, NativeSamplingParams


def wire_params(params: GenParams) -> NativeSamplingParams:
    fields: dict[str, Any] = {"max_new_tokens": params.max_tokens, "stop": list(params.stop),
                              "logprobs": params.return_logprob}
    for key in ("temperature", "top_p", "top_k", "min_p", "seed"):
        if getattr(params, key) is not None:
            fields[key] = getattr(params, key)
    if params.constraint is not None:
        fields["constraint"] = ConstraintSpec(**{params.constraint.kind: params.constraint.json_value()})
    return NativeSamplingParams(**fields)


class RemoteBackend(Backend):
    def __init__(self, client: ArborClient) -> None:
        self.client = client

    def encode(self, text: str) -> list[int]:
        return self.client.encode(text)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.client.decode(list(token_ids))

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
        return self.client.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)

    @property
    def eos_token_ids(self) -> list[int]:
        return self.client.tokenizer_info().eos_token_ids

    async def generate(self, input_ids: list[int], params: GenParams) -> AsyncIterator[GenChunk]:
        async for c in self.client.generate_stream(input_ids, wire_params(params)):
            meta = c.meta
            yield GenChunk(c.delta_text, c.delta_token_ids, c.text or "", c.output_ids or [],
                           c.finish_reason, meta.logprobs if meta else None,
                           meta.cached_tokens if meta else 0)

    async def score(self, input_ids: list[int], start: int) -> list[float]:
        return await self.client.score(input_ids, start)

    async def cache_prefix(self, input_ids: list[int]) -> None:
        await self.client.cache_prefix(input_ids)
