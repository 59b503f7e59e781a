"""Native endpoints: the tokenizer endpoints a remote DSL needs (``POST /generate``, a
superset of Arbor's and SGLang's fields, is in ``api/sglang/routes.py``).

    POST /tokenize             text → input_ids (no special tokens unless asked)
    POST /detokenize           token_ids → text (special tokens kept unless asked)
    POST /apply_chat_template  messages → prompt text
    GET  /tokenizer_info       vocab size, EOS/BOS ids, max_model_len, chat template
    GET  /engine_metrics       engine.metrics() as JSON
    DELETE /sessions/{id}      end the caller's retention session now (docs/retention.md)
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request

from runtime.errors import InvalidRequestError
from runtime.server.api.native.schema import (
    ChatTemplateRequest,
    ChatTemplateResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    EndSessionResponse,
    TokenizeRequest,
    TokenizeResponse,
    TokenizerInfo,
)
from runtime.server.errors import SessionNotFoundError
from runtime.server.retention import session_key
from runtime.server.serving import ServerContext
from runtime.server.tenants import caller_of


def build_router(ctx: ServerContext) -> APIRouter:
    router = APIRouter()
    engine = ctx.engine

    @router.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        ids = engine.tokenizer.encode(body.text, add_special_tokens=body.add_special_tokens)
        return TokenizeResponse(input_ids=list(ids))

    @router.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        if any(not 0 <= t < engine.vocab_size for t in body.token_ids):
            raise InvalidRequestError(f"token ids must be in [0, {engine.vocab_size})")
        text = engine.tokenizer.decode(body.token_ids, skip_special_tokens=body.skip_special_tokens,
                                       clean_up_tokenization_spaces=False)
        return DetokenizeResponse(text=str(text))

    @router.post("/apply_chat_template")
    async def apply_chat_template(body: ChatTemplateRequest) -> ChatTemplateResponse:
        text = engine.apply_chat_template(body.messages, add_generation_prompt=body.add_generation_prompt)
        return ChatTemplateResponse(text=text)

    @router.get("/tokenizer_info")
    async def tokenizer_info() -> TokenizerInfo:
        tok = engine.tokenizer
        template = getattr(tok, "chat_template", None)
        return TokenizerInfo(model=ctx.model_name, vocab_size=engine.vocab_size,
                             max_model_len=engine.max_model_len, eos_token_ids=engine.eos_token_ids,
                             bos_token_id=tok.bos_token_id,
                             chat_template=template if isinstance(template, str) else None)

    @router.delete("/sessions/{session_id}")
    async def end_session(session_id: str, request: Request) -> EndSessionResponse:
        # NOTE: the tenant's own namespace: a tenant can neither end nor probe another's sessions
        key = session_key(session_id, caller_of(request.headers).tenant)
        pages = await asyncio.to_thread(engine.end_session_now, key)
        if pages is None:
            raise SessionNotFoundError(f"no live retention session {session_id!r}")
        return EndSessionResponse(session_id=session_id, pages_released=pages)

    @router.get("/engine_metrics")
    async def engine_metrics() -> dict[str, float]:
        return engine.metrics()

    return router
