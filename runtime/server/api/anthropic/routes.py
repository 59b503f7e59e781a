"""``POST /v1/messages`` and ``/v1/messages/count_tokens``: Anthropic's Messages API on
the same engine.

A request becomes one engine request: the model's chat template over ``system`` and the
``messages`` (``tool_use`` blocks shown as the chat layer shows tool calls, each
``tool_result`` as a tool message), the ``tools`` described as the chat layer does.
``tool_choice`` ``any`` / ``tool`` force a call (constrained; several with parallel use
allowed, as a list, unless ``disable_parallel_tool_use``). ``stop_sequence`` names the
stop sequence that ended the answer.

NOTE: the turns are the shared chat ones (``api/common/messages.py``), rendered and parsed
by the neutral chat layer (``api/common/chat.py``, ``formats/``): one prompt format and one
call syntax for every API.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from runtime.errors import InvalidRequestError
from runtime.output.request_output import RequestOutput
from runtime.sampling.params import SamplingParams
from runtime.server import engine_constraints
from runtime.server.api.anthropic import schema
from runtime.server.api.common.chat import render_chat
from runtime.server.api.common.fields import check_fields
from runtime.server.api.common.messages import (
    ChatMessageIn,
    ChatTool,
    FunctionDef,
    ToolCallFunction,
    ToolCallOut,
)
from runtime.server.errors import raise_if_failed, stream_error_event
from runtime.server.formats.tool_calls import calls_list_schema, model_tool_format
from runtime.server.serving import (
    EngineStream,
    ServerContext,
    StreamGroup,
    check_budget,
    collect,
    encode_prompt,
    new_id,
    until_disconnect,
)
from runtime.server.sse import EventStreamResponse, sse
from runtime.server.tenants import caller_of


class MessagesCall:
    """One ``/v1/messages`` (or ``count_tokens``) request as one engine request."""

    def __init__(self, ctx: ServerContext, body: schema.CountTokensRequest) -> None:
        self.ctx, self.body = ctx, body
        self.headers = check_fields(body, ctx.limits.unknown_fields, schema.IGNORED, schema.REFUSED)
        ctx.check_model(body.model)
        self.id = new_id("msg")
        self.model = body.model or ctx.model_name
        choice = body.tool_choice or schema.ToolChoice(type="auto")
        self.tools = [] if choice.type == "none" else [_chat_tool(t) for t in body.tools]
        self.forced = self._forced(choice)
        self.parallel = not choice.disable_parallel_tool_use and choice.type != "tool"
        turns = [m for message in body.messages for m in _turns(message)]
        system = [ChatMessageIn(role="system", content=_system(body.system))] if body.system else []
        self.format = model_tool_format(ctx.engine)  # the family's tool-call syntax
        text = render_chat(ctx.engine, system + turns, self.tools, True, self.parallel, self.format)
        self.prefix = self.format.forced_prefix if self.forced else ""  # written after the prompt
        self.prompt_ids = encode_prompt(ctx.engine, text + self.prefix)

    def _forced(self, choice: schema.ToolChoice) -> list[ChatTool] | None:
        if not self.tools or choice.type == "auto":
            return None
        if choice.type == "any":
            return self.tools
        named = [t for t in self.tools if t.function.name == choice.name]
        if not named:
            raise InvalidRequestError(f"tool_choice names {choice.name!r}, which is not in tools")
        return named

    def params(self) -> SamplingParams:
        b = self.body
        assert isinstance(b, schema.MessagesRequest)
        check_budget(self.ctx.engine, self.ctx.limits, len(self.prompt_ids), b.max_tokens)
        constraint = None
        fmt = b.output_config.format
        if self.forced is not None:
            if fmt is not None:
                raise InvalidRequestError("output_config.format cannot be combined with a forced tool call")
            call = self.format.call_schema(self.forced)
            constraint = engine_constraints.json_schema(calls_list_schema(call) if self.parallel else call)
        elif fmt is not None:
            constraint = engine_constraints.json_schema(fmt.schema_, strict=True)
        return SamplingParams(max_new_tokens=b.max_tokens, temperature=b.temperature, top_p=b.top_p,
                              top_k=b.top_k, stop=tuple(b.stop_sequences), constraint=constraint)

    def blocks(self, out: RequestOutput) -> list[schema.TextOut | schema.ToolUseOut]:
        content, calls = (self.format.parse(self.prefix + out.text, self.forced or self.tools, self.parallel)
                          if self.tools else (out.text, []))
        if calls:
            uses: list[schema.TextOut | schema.ToolUseOut] = [
                schema.ToolUseOut(id=new_id("toolu"), name=c.function.name, input=json.loads(c.function.arguments))
                for c in calls]
            return [schema.TextOut(text=content), *uses] if content else uses
        return [schema.TextOut(text=out.text)]

    def message(self, out: RequestOutput, blocks: list[schema.TextOut | schema.ToolUseOut]) -> schema.MessageOut:
        stop_reason, stop_sequence = self.stop(out, blocks)
        return schema.MessageOut(id=self.id, model=self.model, content=blocks, stop_reason=stop_reason,
                                 stop_sequence=stop_sequence, usage=_usage(out))

    def stop(self, out: RequestOutput, blocks: list[Any]) -> tuple[Any, str | None]:
        """``stop_reason`` and the stop sequence that ended the answer, if one did.

        NOTE: the engine cuts a stop string from ``text`` but keeps the tokens that
        completed it, so the decoded tokens past ``text`` start with the sequence."""
        if any(isinstance(b, schema.ToolUseOut) for b in blocks):
            return "tool_use", None
        if out.finish_reason == "length":
            return "max_tokens", None
        b = self.body
        assert isinstance(b, schema.MessagesRequest)
        decoded = str(self.ctx.engine.tokenizer.decode(out.token_ids, skip_special_tokens=False))
        rest = decoded[len(out.text):] if decoded.startswith(out.text) else ""
        matched = [s for s in b.stop_sequences if s and s in rest]
        if matched:
            return "stop_sequence", min(matched, key=rest.index)
        return "end_turn", None


def build_router(ctx: ServerContext) -> APIRouter:
    router = APIRouter(prefix="/v1")

    @router.post("/messages", response_model=None)
    async def messages(body: schema.MessagesRequest, request: Request) -> JSONResponse | EventStreamResponse:
        call = MessagesCall(ctx, body)
        user = body.metadata.get("user_id")
        group = StreamGroup(ctx, "messages", [(call.prompt_ids, call.params())],
                            ctx.limits.deadline(body.timeout),
                            caller_of(request.headers, user if isinstance(user, str) else None))
        if body.stream:
            [stream] = await group.open()
            response = EventStreamResponse(_events(ctx, call, stream), group.close)
            response.headers.update(call.headers)
            return response
        async with group as [stream]:
            out = await until_disconnect(request, collect(stream))
        raise_if_failed(ctx, out)
        ctx.metrics.requests.labels("messages", "200").inc()
        return JSONResponse(call.message(out, call.blocks(out)).model_dump(), headers=call.headers)

    @router.post("/messages/count_tokens")
    async def count_tokens(body: schema.CountTokensRequest) -> JSONResponse:
        call = MessagesCall(ctx, body)
        return JSONResponse({"input_tokens": len(call.prompt_ids)}, headers=call.headers)

    return router


def _event(kind: str, **payload: Any) -> str:
    return f"event: {kind}\n{sse({'type': kind, **payload})}"


async def _events(ctx: ServerContext, call: MessagesCall, stream: EngineStream) -> AsyncIterator[str]:
    """message_start, content blocks (text streams as it comes; with tools the answer is
    held to the end: it may turn out to be calls), message_delta, message_stop."""
    start = schema.MessageOut(id=call.id, model=call.model, content=[], stop_reason=None,
                              usage=schema.UsageOut(input_tokens=len(call.prompt_ids), output_tokens=0))
    yield _event("message_start", message=start.model_dump())
    opened = False
    try:
        out = None
        async for out in stream:
            raise_if_failed(ctx, out)
            if call.tools or not out.delta_text:
                continue
            if not opened:
                yield _event("content_block_start", index=0, content_block={"type": "text", "text": ""})
                opened = True
            yield _event("content_block_delta", index=0, delta={"type": "text_delta", "text": out.delta_text})
        assert out is not None
        blocks = call.blocks(out)
        if opened:
            yield _event("content_block_stop", index=0)
        else:
            for index, block in enumerate(blocks):
                for event in _whole_block(index, block):
                    yield event
        stop_reason, stop_sequence = call.stop(out, blocks)
        yield _event("message_delta", delta={"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                     usage={"output_tokens": len(out.token_ids)})
        yield _event("message_stop")
        ctx.metrics.requests.labels("messages_stream", "200").inc()
    except Exception as exc:  # the status line is gone: report in-band
        body = stream_error_event(exc, ctx)
        yield _event("error", error={"type": body["error"]["type"], "message": body["error"]["message"],
                                     "code": body["error"]["code"]})


def _whole_block(index: int, block: schema.TextOut | schema.ToolUseOut) -> list[str]:
    start: dict[str, Any]
    delta: dict[str, Any]
    if isinstance(block, schema.TextOut):
        start, delta = {"type": "text", "text": ""}, {"type": "text_delta", "text": block.text}
    else:
        start = {**block.model_dump(), "input": {}}
        delta = {"type": "input_json_delta", "partial_json": json.dumps(block.input)}
    return [_event("content_block_start", index=index, content_block=start),
            _event("content_block_delta", index=index, delta=delta),
            _event("content_block_stop", index=index)]


def _system(system: str | list[schema.Block] | None) -> str:
    if isinstance(system, list):
        return "".join(_block_text(b) for b in system)
    return system or ""


def _block_text(block: schema.Block) -> str:
    if block.type != "text" or block.text is None:
        raise InvalidRequestError(f"content block of type {block.type!r} is not supported here (text only)")
    return block.text


def _turns(message: schema.Message) -> list[ChatMessageIn]:
    """One Anthropic message as chat messages: its text (and tool calls), each tool result
    a tool message of its own."""
    if isinstance(message.content, str):
        return [ChatMessageIn(role=message.role, content=message.content)]
    texts: list[str] = []
    calls: list[ToolCallOut] = []
    results: list[ChatMessageIn] = []
    for block in message.content:
        if block.type == "tool_use" and message.role == "assistant":
            if block.id is None or block.name is None:
                raise InvalidRequestError("a tool_use block needs an id and a name")
            calls.append(ToolCallOut(id=block.id, function=ToolCallFunction(
                name=block.name, arguments=json.dumps(block.input or {}))))
        elif block.type == "tool_result" and message.role == "user":
            content = block.content if isinstance(block.content, str) else \
                "".join(_block_text(b) for b in block.content or [])
            results.append(ChatMessageIn(role="tool", content=content, tool_call_id=block.tool_use_id))
        else:
            texts.append(_block_text(block))
    turns = results
    if texts or calls:
        turns = turns + [ChatMessageIn(role=message.role, content="".join(texts) or None,
                                       tool_calls=calls or None)]
    return turns


def _chat_tool(tool: schema.Tool) -> ChatTool:
    return ChatTool(function=FunctionDef(name=tool.name, description=tool.description,
                                         parameters=tool.input_schema))


def _usage(out: RequestOutput) -> schema.UsageOut:
    return schema.UsageOut(input_tokens=len(out.prompt_token_ids), output_tokens=len(out.token_ids),
                           cache_read_input_tokens=out.num_cached_tokens)
