"""Native endpoints: ``POST /generate`` and the tokenizer endpoints a remote DSL needs.

    POST /generate             text or input_ids + sampling_params (+ constraint); SSE if stream
    POST /tokenize             text → input_ids (no special tokens unless asked)
    POST /detokenize           token_ids → text (special tokens kept unless asked)
    POST /apply_chat_template  messages → prompt text
    GET  /tokenizer_info       vocab size, EOS/BOS ids, max_model_len, chat template
    GET  /engine_metrics       engine.metrics() as JSON
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request

from runtime.errors import InvalidRequestError
from runtime.outputs import RequestOutput
from runtime.sampling_params import SamplingParams
from runtime.server import engine_constraints
from runtime.server.errors import raise_if_failed, stream_error_event
from runtime.server.protocol import (
    ChatTemplateRequest,
    ChatTemplateResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    GenerateChunk,
    GenerateMeta,
    GenerateRequest,
    GenerateResponse,
    NativeSamplingParams,
    TokenizeRequest,
    TokenizeResponse,
    TokenizerInfo,
)
from runtime.server.serving import (
    EngineStream,
    ServerContext,
    StreamGroup,
    check_budget,
    collect,
    encode_prompt,
    until_disconnect,
)
from runtime.server.sse import SSE_DONE, EventStreamResponse, sse
from runtime.server.tenants import caller_of


def to_sampling_params(p: NativeSamplingParams) -> SamplingParams:
    fields = p.model_dump(exclude={"constraint"})
    constraint = engine_constraints.from_spec(p.constraint) if p.constraint is not None else None
    return SamplingParams(**fields, constraint=constraint)


def build_router(ctx: ServerContext) -> APIRouter:
    router = APIRouter()
    engine = ctx.engine

    @router.post("/generate", response_model=None)
    async def generate(body: GenerateRequest, request: Request) -> GenerateResponse | EventStreamResponse:
        ids = encode_prompt(engine, body.text) if body.text is not None else list(body.input_ids or [])
        params = to_sampling_params(body.sampling_params)
        check_budget(engine, ctx.limits, len(ids), params.max_new_tokens)
        group = StreamGroup(ctx, "generate", [(ids, params)], ctx.limits.deadline(body.timeout),
                            caller_of(request.headers))
        if body.stream:
            [stream] = await group.open()  # 4xx/429/503 before the first byte
            return EventStreamResponse(_stream_events(ctx, stream), group.close)
        async with group as [stream]:
            out = await until_disconnect(request, collect(stream))
        raise_if_failed(ctx, out)
        ctx.metrics.requests.labels("generate", "200").inc()
        return GenerateResponse(text=out.text, output_ids=out.token_ids,
                                finish_reason=str(out.finish_reason), meta=_meta(out, stream))

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


async def _stream_events(ctx: ServerContext, stream: EngineStream) -> AsyncIterator[str]:
    """SSE body of a streamed ``/generate``; the response's ``on_close`` aborts leftovers."""
    try:
        async for out in stream:
            raise_if_failed(ctx, out)
            chunk = GenerateChunk(delta_text=out.delta_text, delta_token_ids=out.delta_token_ids,
                                  finish_reason=out.finish_reason)
            if out.finished:
                chunk.text, chunk.output_ids, chunk.meta = out.text, out.token_ids, _meta(out, stream)
            yield sse(chunk.model_dump(exclude_none=True))
        ctx.metrics.requests.labels("generate_stream", "200").inc()
    except Exception as exc:  # the status line is gone: report in-band
        yield sse(stream_error_event(exc, ctx))
    yield SSE_DONE



def _meta(out: RequestOutput, stream: EngineStream) -> GenerateMeta:
    top = None
    if out.top_logprobs is not None:
        top = [{str(k): v for k, v in step.items()} for step in out.top_logprobs]
    return GenerateMeta(request_id=out.request_id, prompt_tokens=len(out.prompt_token_ids),
                        completion_tokens=len(out.token_ids), cached_tokens=out.num_cached_tokens,
                        e2e_latency=time.monotonic() - stream.started, logprobs=out.logprobs,
                        top_logprobs=top, prompt_logprobs=out.prompt_logprobs,
                        constraint_check=engine_constraints.check_info(out.constraint_check))
