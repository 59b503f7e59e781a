"""``POST /v1/responses``: OpenAI's Responses API on the same engine.

A request becomes one engine request: the model's chat template over ``instructions``
(a system message), the stored turns of ``previous_response_id`` and the ``input`` items
(function calls and their outputs shown as the chat layer shows tool calls), with the
function ``tools`` described as the chat layer does. ``text.format`` (json_schema,
json_object) and a forced ``tool_choice`` become the one constraint; with
``parallel_tool_calls`` a forced answer is a list of calls. Responses are kept for
``previous_response_id`` in a bounded store (``store: false`` keeps none).

NOTE: the turns are the shared chat ones (``api/common/messages.py``), rendered and parsed
by the neutral chat layer (``api/common/chat.py``, ``formats/``): one prompt format and one
call syntax for every API.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from runtime.errors import InvalidRequestError
from runtime.output.request_output import RequestOutput
from runtime.sampling.params import SamplingParams
from runtime.server import engine_constraints
from runtime.server.api.common.chat import render_chat
from runtime.server.api.common.fields import check_fields
from runtime.server.api.common.messages import (
    ChatMessageIn,
    ChatTool,
    FunctionDef,
    ToolCallFunction,
    ToolCallOut,
)
from runtime.server.api.responses import schema
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
from runtime.server.sse import SSE_DONE, EventStreamResponse, sse
from runtime.server.tenants import caller_of

Status = Literal["in_progress", "completed", "incomplete"]
STORE_CAPACITY = 1024  # responses kept for previous_response_id; the oldest go first


class ResponseStore:
    """The conversations of the last ``capacity`` stored responses (input turns and the
    answer, instructions excluded: the spec does not carry them over)."""

    def __init__(self, capacity: int = STORE_CAPACITY) -> None:
        self.capacity = capacity
        self._turns: OrderedDict[str, list[ChatMessageIn]] = OrderedDict()

    def get(self, response_id: str) -> list[ChatMessageIn]:
        if response_id not in self._turns:
            raise InvalidRequestError(f"previous_response_id {response_id!r} is not (or no longer) "
                                      "stored on this server")
        self._turns.move_to_end(response_id)
        return list(self._turns[response_id])

    def put(self, response_id: str, turns: list[ChatMessageIn]) -> None:
        self._turns[response_id] = turns
        while len(self._turns) > self.capacity:
            self._turns.popitem(last=False)


class ResponsesCall:
    """One ``/v1/responses`` request translated into one engine request."""

    def __init__(self, ctx: ServerContext, body: schema.ResponsesRequest, store: ResponseStore) -> None:
        self.ctx, self.body, self.store = ctx, body, store
        self.headers = check_fields(body, ctx.limits.unknown_fields, schema.IGNORED, schema.REFUSED)
        ctx.check_model(body.model)
        self.id = new_id("resp")
        self.model = body.model or ctx.model_name
        history = store.get(body.previous_response_id) if body.previous_response_id else []
        self.turns = history + [_turn(item) for item in _items(body.input)]
        choice = body.tool_choice
        self.tools = [] if choice == "none" else [_chat_tool(t) for t in body.tools]
        self.forced = self._forced(choice)
        self.parallel = body.parallel_tool_calls and not isinstance(choice, schema.FunctionChoice)
        system = [ChatMessageIn(role="system", content=body.instructions)] if body.instructions else []
        self.format = model_tool_format(ctx.engine)  # the family's tool-call syntax
        text = render_chat(ctx.engine, system + self.turns, self.tools, True, self.parallel, self.format)
        self.prefix = self.format.forced_prefix if self.forced else ""  # written after the prompt
        self.prompt_ids = encode_prompt(ctx.engine, text + self.prefix)
        self.params = self._params()

    def _forced(self, choice: Any) -> list[ChatTool] | None:
        if not self.tools or choice == "auto":
            return None
        if choice == "required":
            return self.tools
        named = [t for t in self.tools if t.function.name == choice.name]
        if not named:
            raise InvalidRequestError(f"tool_choice names {choice.name!r}, which is not in tools")
        return named

    def _params(self) -> SamplingParams:
        b, engine, limits = self.body, self.ctx.engine, self.ctx.limits
        max_tokens = b.max_output_tokens
        if max_tokens is None:
            max_tokens = max(1, min(limits.default_max_tokens, engine.max_model_len - len(self.prompt_ids)))
        check_budget(engine, limits, len(self.prompt_ids), max_tokens)
        return SamplingParams(max_new_tokens=max_tokens, temperature=b.temperature, top_p=b.top_p,
                              constraint=self._constraint())

    def _constraint(self) -> Any:
        fmt = self.body.text.format
        if self.forced is not None:
            if fmt.type != "text":
                raise InvalidRequestError("text.format cannot be combined with a forced tool call")
            call = self.format.call_schema(self.forced)
            return engine_constraints.json_schema(calls_list_schema(call) if self.parallel else call,
                                                  strict=any(t.function.strict for t in self.forced))
        if fmt.type == "json_object":
            return engine_constraints.json_schema({"type": "object"})
        if fmt.type == "json_schema":
            if fmt.schema_ is None:
                raise InvalidRequestError("text.format of type json_schema needs a schema")
            return engine_constraints.json_schema(fmt.schema_, strict=bool(fmt.strict))
        return None

    # ---- answers ------------------------------------------------------------------------------

    def output_items(self, out: RequestOutput) -> list[schema.MessageItem | schema.FunctionCallOut]:
        calls = self.format.parse(self.prefix + out.text, self.forced or self.tools, self.parallel)[1] \
            if self.tools else []
        if calls:
            return [schema.FunctionCallOut(id=new_id("fc"), call_id=c.id, name=c.function.name,
                                           arguments=c.function.arguments) for c in calls]
        cut = out.finish_reason == "length"
        return [schema.MessageItem(id=new_id("msg"), status="incomplete" if cut else "completed",
                                   content=[schema.OutputText(text=out.text)])]

    def response(self, status: Status, out: RequestOutput | None = None,
                 items: list[schema.MessageItem | schema.FunctionCallOut] | None = None) -> schema.ResponseObject:
        b = self.body
        incomplete = out is not None and out.finish_reason == "length" and not any(
            isinstance(i, schema.FunctionCallOut) for i in items or [])
        return schema.ResponseObject(
            id=self.id, status="incomplete" if incomplete else status, model=self.model, output=items or [],
            usage=_usage(out) if out is not None else None,
            incomplete_details={"reason": "max_output_tokens"} if incomplete else None,
            instructions=b.instructions, max_output_tokens=b.max_output_tokens, temperature=b.temperature,
            top_p=b.top_p, tools=[t.model_dump(exclude_none=True) for t in b.tools],
            tool_choice=b.tool_choice if isinstance(b.tool_choice, str) else b.tool_choice.model_dump(),
            parallel_tool_calls=b.parallel_tool_calls, previous_response_id=b.previous_response_id,
            text=b.text.model_dump(by_alias=True, exclude_none=True), store=b.store, metadata=b.metadata)

    def remember(self, items: list[schema.MessageItem | schema.FunctionCallOut]) -> None:
        if not self.body.store:
            return
        answer = [_turn(_as_input(item)) for item in items]
        self.store.put(self.id, self.turns + answer)


def build_router(ctx: ServerContext) -> APIRouter:
    router = APIRouter(prefix="/v1")
    store = ResponseStore()

    @router.post("/responses", response_model=None)
    async def responses(body: schema.ResponsesRequest, request: Request) -> JSONResponse | EventStreamResponse:
        call = ResponsesCall(ctx, body, store)
        group = StreamGroup(ctx, "responses", [(call.prompt_ids, call.params)],
                            ctx.limits.deadline(body.timeout), caller_of(request.headers, body.user, body.cache_salt))
        if body.stream:
            [stream] = await group.open()
            response = EventStreamResponse(_events(ctx, call, stream), group.close)
            response.headers.update(call.headers)
            return response
        async with group as [stream]:
            out = await until_disconnect(request, collect(stream))
        raise_if_failed(ctx, out)
        ctx.metrics.requests.labels("responses", "200").inc()
        items = call.output_items(out)
        call.remember(items)
        return JSONResponse(call.response("completed", out, items).model_dump(), headers=call.headers)

    return router


class _Events:
    """The spec's event sequence, numbered."""

    def __init__(self) -> None:
        self.sequence_number = 0

    def __call__(self, kind: str, **payload: Any) -> str:
        event = {"type": kind, "sequence_number": self.sequence_number, **payload}
        self.sequence_number += 1
        return f"event: {kind}\n{sse(event)}"


async def _events(ctx: ServerContext, call: ResponsesCall, stream: EngineStream) -> AsyncIterator[str]:
    """``response.created`` ... ``response.completed``; text streams as it comes, except
    with tools, where the answer is held to the end (it may turn out to be calls)."""
    emit = _Events()
    yield emit("response.created", response=call.response("in_progress").model_dump())
    yield emit("response.in_progress", response=call.response("in_progress").model_dump())
    message_id = new_id("msg")
    opened = False
    try:
        out = None
        async for out in stream:
            raise_if_failed(ctx, out)
            if call.tools or not (out.delta_text or out.finished):
                continue
            if not opened:
                for event in _open_message(emit, message_id):
                    yield event
                opened = True
            if out.delta_text:
                yield emit("response.output_text.delta", item_id=message_id, output_index=0, content_index=0,
                           delta=out.delta_text, logprobs=[])
        assert out is not None
        items = call.output_items(out)
        if isinstance(items[0], schema.MessageItem):
            items[0].id = message_id
            if not opened:
                for event in _open_message(emit, message_id):
                    yield event
                if out.text:
                    yield emit("response.output_text.delta", item_id=message_id, output_index=0,
                               content_index=0, delta=out.text, logprobs=[])
            for event in _close_message(emit, items[0]):
                yield event
        else:
            for index, item in enumerate(items):
                assert isinstance(item, schema.FunctionCallOut)
                for event in _function_call(emit, index, item):
                    yield event
        call.remember(items)
        final = call.response("completed", out, items)
        yield emit("response.incomplete" if final.status == "incomplete" else "response.completed",
                   response=final.model_dump())
        ctx.metrics.requests.labels("responses_stream", "200").inc()
    except Exception as exc:  # the status line is gone: report in-band
        body = stream_error_event(exc, ctx)
        yield emit("error", code=str(body["error"]["type"]), message=body["error"]["message"], param=None,
                   error=body["error"])
    yield SSE_DONE


def _open_message(emit: _Events, message_id: str) -> list[str]:
    item = schema.MessageItem(id=message_id, status="in_progress")
    part = schema.OutputText(text="")
    return [emit("response.output_item.added", output_index=0, item=item.model_dump()),
            emit("response.content_part.added", item_id=message_id, output_index=0, content_index=0,
                 part=part.model_dump())]


def _close_message(emit: _Events, item: schema.MessageItem) -> list[str]:
    part = item.content[0]
    return [emit("response.output_text.done", item_id=item.id, output_index=0, content_index=0, text=part.text,
                 logprobs=[]),
            emit("response.content_part.done", item_id=item.id, output_index=0, content_index=0,
                 part=part.model_dump()),
            emit("response.output_item.done", output_index=0, item=item.model_dump())]


def _function_call(emit: _Events, index: int, item: schema.FunctionCallOut) -> list[str]:
    opening = item.model_copy(update={"arguments": "", "status": "in_progress"})
    return [emit("response.output_item.added", output_index=index, item=opening.model_dump()),
            emit("response.function_call_arguments.delta", item_id=item.id, output_index=index,
                 delta=item.arguments),
            emit("response.function_call_arguments.done", item_id=item.id, output_index=index,
                 name=item.name, arguments=item.arguments),
            emit("response.output_item.done", output_index=index, item=item.model_dump())]


def _items(given: str | list[schema.InputItem]) -> list[schema.InputItem]:
    if isinstance(given, str):
        return [schema.InputMessage(role="user", content=given)]
    if not given:
        raise InvalidRequestError("input is empty")
    return given


def _turn(item: schema.InputItem) -> ChatMessageIn:
    """An input item as the chat layer's message."""
    if isinstance(item, schema.FunctionCallItem):
        call = ToolCallOut(id=item.call_id, function=ToolCallFunction(name=item.name, arguments=item.arguments))
        return ChatMessageIn(role="assistant", content=None, tool_calls=[call])
    if isinstance(item, schema.FunctionCallOutputItem):
        return ChatMessageIn(role="tool", content=item.output, tool_call_id=item.call_id)
    return ChatMessageIn(role=item.role, content=_text(item))


def _text(item: schema.InputMessage) -> str:
    if isinstance(item.content, str):
        return item.content
    for part in item.content:
        if part.type not in ("input_text", "output_text") or part.text is None:
            raise InvalidRequestError(f"content part of type {part.type!r} is not supported (text only)")
    return "".join(part.text or "" for part in item.content)


def _as_input(item: schema.MessageItem | schema.FunctionCallOut) -> schema.InputItem:
    if isinstance(item, schema.FunctionCallOut):
        return schema.FunctionCallItem(type="function_call", call_id=item.call_id, name=item.name,
                                       arguments=item.arguments)
    return schema.InputMessage(role="assistant", content=item.content[0].text if item.content else "")


def _chat_tool(tool: schema.FunctionTool) -> ChatTool:
    return ChatTool(function=FunctionDef(name=tool.name, description=tool.description,
                                         parameters=tool.parameters, strict=tool.strict))


def _usage(out: RequestOutput) -> schema.ResponseUsage:
    prompt, completion = len(out.prompt_token_ids), len(out.token_ids)
    return schema.ResponseUsage(input_tokens=prompt, input_tokens_details={"cached_tokens": out.num_cached_tokens},
                                output_tokens=completion, output_tokens_details={"reasoning_tokens": 0},
                                total_tokens=prompt + completion)
