"""``POST /v1/embeddings``: OpenAI's embeddings on the same engine, nothing generated.

An embedding is the input's final-norm hidden states pooled as the model's files state
(sentence-transformers' Pooling config), else the last token's (decoder embedding models
pool so, since only the last token has seen the whole input), or as the request's
``pooling`` asks; cut to ``dimensions`` and L2-normalized (``Engine.embed``). Every input of a request runs in one prefill pass (or a few, of at most
``max_model_len`` tokens each) on a KV pool of its own, between two engine steps.
"""

from __future__ import annotations

import asyncio
import base64
import struct
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from runtime.errors import InvalidRequestError
from runtime.server.api.common.fields import check_fields
from runtime.server.api.embeddings import schema
from runtime.server.serving import Admission, ServerContext, check_budget, encode_prompt
from runtime.server.tenants import caller_of


def parse_input(ctx: ServerContext, value: Any) -> list[list[int]]:
    """The token ids of each input item (strings tokenized as prompts are).

    Raises:
        InvalidRequestError: an empty input or item, too many items, or a shape other
            than a string, a list of strings, a list of token ids or a list of such lists.
    """
    if isinstance(value, str):
        return [encode_prompt(ctx.engine, value)]
    if not isinstance(value, list) or not value:
        raise InvalidRequestError("input must be a non-empty string, list of strings, list of token ids "
                                  "or list of token-id lists")
    if len(value) > schema.MAX_INPUTS:
        raise InvalidRequestError(f"input has {len(value)} items; at most {schema.MAX_INPUTS} are allowed")
    if all(_is_token(t) for t in value):
        return [list(value)]
    items = []
    for i, item in enumerate(value):
        if isinstance(item, str):
            items.append(encode_prompt(ctx.engine, item))
        elif isinstance(item, list) and item and all(_is_token(t) for t in item):
            items.append(list(item))
        else:
            raise InvalidRequestError(f"input.{i} must be a non-empty string or a non-empty list of token ids")
    return items


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _encode(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


def build_router(ctx: ServerContext) -> APIRouter:
    router = APIRouter(prefix="/v1")

    @router.post("/embeddings")
    async def embeddings(body: schema.EmbeddingRequest, request: Request) -> JSONResponse:
        headers = check_fields(body, ctx.limits.unknown_fields, schema.IGNORED)
        ctx.check_model(body.model)
        hidden = ctx.engine.model.args.hidden_size
        if body.dimensions is not None and not 1 <= body.dimensions <= hidden:
            raise InvalidRequestError(f"dimensions is {body.dimensions}; this model's embeddings have "
                                      f"{hidden}: give 1 to {hidden}")
        inputs = parse_input(ctx, body.input)
        for ids in inputs:
            check_budget(ctx.engine, ctx.limits, len(ids), 0)
        tokens = sum(map(len, inputs))
        admission = Admission(ctx, caller_of(request.headers, body.user))
        async with admission:
            vectors = (await asyncio.to_thread(ctx.engine.embed, inputs, body.pooling, body.dimensions)).tolist()
            admission.charge(tokens)
        ctx.metrics.requests.labels("embeddings", "200").inc()
        answer = schema.EmbeddingResponse(
            data=[schema.EmbeddingOut(index=i, embedding=_encode(v, body.encoding_format))
                  for i, v in enumerate(vectors)],
            model=body.model or ctx.model_name,
            usage=schema.EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens))
        return JSONResponse(answer.model_dump(), headers=headers)

    return router
