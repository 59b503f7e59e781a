"""Native endpoints: the tokenizer endpoints a remote DSL needs (``POST /generate``, a
superset of Arbor's and SGLang's fields, is in ``api/sglang_routes.py``).

    POST /tokenize             text → input_ids (no special tokens unless asked)
    POST /detokenize           token_ids → text (special tokens kept unless asked)
    POST /apply_chat_template  messages → prompt text
    GET  /tokenizer_info       vocab size, EOS/BOS ids, max_model_len, chat template
    GET  /engine_metrics       engine.metrics() as JSON
"""

from __future__ import annotations

from fastapi import APIRouter

from runtime.errors import InvalidRequestError
from runtime.server.protocol import (
    ChatTemplateRequest,
    ChatTemplateResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
    TokenizerInfo,
)
from runtime.server.serving import ServerContext


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

    @router.get("/engine_metrics")
    async def engine_metrics() -> dict[str, float]:
        return engine.metrics()

    return router
