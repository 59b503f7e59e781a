"""OpenAI-compatible endpoints: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``.

Each request becomes ``n`` engine requests per prompt (choice ``i`` gets seed ``seed + i``
so seeded choices differ yet reproduce). Penalties, ``logit_bias``, ``echo``, ``best_of``
and ``suffix`` are refused with 400. See ``completions.py`` and ``chat.py``.
"""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from runtime.server.api.openai.chat import ChatEndpoint
from runtime.server.api.openai.completions import CompletionEndpoint
from runtime.server.api.openai.schema import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
)
from runtime.server.serving import ServerContext
from runtime.server.sse import EventStreamResponse
from runtime.server.tenants import caller_of


def build_router(ctx: ServerContext) -> APIRouter:
    router = APIRouter(prefix="/v1")

    @router.get("/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=name, max_model_len=ctx.engine.max_model_len)
                               for name in ctx.served_model_names or (ctx.model_name,)])

    @router.post("/completions", response_model=None)
    async def completions(body: CompletionRequest, request: Request,
                          response: Response) -> CompletionResponse | EventStreamResponse:
        endpoint = CompletionEndpoint(ctx, body, caller_of(request.headers, body.user, body.cache_salt))
        response.headers.update(endpoint.headers)
        return await endpoint.serve(request)

    @router.post("/chat/completions", response_model=None)
    async def chat(body: ChatCompletionRequest, request: Request,
                   response: Response) -> ChatCompletionResponse | EventStreamResponse:
        endpoint = ChatEndpoint(ctx, body, caller_of(request.headers, body.user, body.cache_salt))
        response.headers.update(endpoint.headers)
        return await endpoint.serve(request)

    return router
