"""OpenAI's embeddings wire shapes (``POST /v1/embeddings``), as the spec and the official
``openai`` SDK (``openai.types.embedding``) spell them."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel

from runtime.server.api.common.fields import IgnoredFields, WireModel

MAX_INPUTS = 2048  # the spec's limit on the items of one request


class EmbeddingRequest(WireModel):
    # a string, a list of strings, a list of token ids, or a list of such lists; checked by
    # the route (``parse_input``) so that every wrong shape is a 400 naming what is wrong
    input: Any
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None  # the first this many of each vector, renormalized (Matryoshka)
    # extension: how hidden states are pooled ("last", "mean", "cls"); None: the model's
    # own (its sentence-transformers Pooling config), else the last token's
    pooling: Literal["last", "mean", "cls"] | None = None
    user: str | None = None  # the caller's name for the tenant's labels


class EmbeddingOut(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # base64: the little-endian float32 bytes


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingOut]
    model: str
    usage: EmbeddingUsage


IGNORED: IgnoredFields = {}
