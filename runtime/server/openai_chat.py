"""``/v1/chat/completions``: the chat template, response_format, tools and tool_choice.

Forced tool calls (``tool_choice`` "required" or a named function) and ``response_format``
become a JSON-schema constraint (strict when the format or a forced function says so); each
final choice says how its output fared against that schema (``constraint_check``).
``tool_choice="auto"`` describes the tools in the system message and returns tool calls
when the model's whole answer is calls (``{"name": ..., "arguments": {...}}``, a JSON
list of them, or ``<tool_call>`` blocks).

Parallel tool calls: with ``parallel_tool_calls`` (OpenAI's default: true) an answer may
hold several calls. ``tool_choice="required"`` is then constrained as a non-empty JSON list
of calls, each against its tool's schema; a named ``tool_choice`` stays one call of that
function. With ``parallel_tool_calls: false`` the answer is at most one call (an "auto"
answer of several calls is returned as content, not cut to its first). Streamed, each call
is one delta with its ``index``.
"""

from __future__ import annotations

import json
import re
from typing import Any

from fastapi import Request

from runtime.errors import InvalidRequestError
from runtime.output.request_output import RequestOutput
from runtime.server import engine_constraints
from runtime.server.openai_common import Endpoint, Job, output_constraint, token_text, usage
from runtime.server.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatMessageIn,
    ChatMessageOut,
    ChatTool,
    ChoiceLogprobs,
    DeltaToolCall,
    NamedToolChoice,
    TokenLogprob,
    ToolCallFunction,
    ToolCallOut,
    TopLogprob,
)
from runtime.server.serving import ServerContext, encode_prompt, new_id
from runtime.server.sse import EventStreamResponse
from runtime.server.tenants import Caller

TOOLS_PROMPT = (
    "You can call the following functions. To call one, answer with a single JSON object "
    '{{"name": <function name>, "arguments": <arguments object>}} and nothing else.{parallel}\n'
    "Functions:\n{specs}"
)
PARALLEL_PROMPT = " To call several at once, answer with a JSON list of such objects."


class ChatEndpoint(Endpoint):
    name = "chat"

    def __init__(self, ctx: ServerContext, body: ChatCompletionRequest, caller: Caller) -> None:
        super().__init__(ctx, body, caller)
        self.id = new_id("chatcmpl")
        self.req = body
        tools = body.tools or []
        choice = body.tool_choice or ("auto" if tools else "none")
        self.tools = tools if choice != "none" else []
        self.forced = self._forced_tools(choice)  # tools the output must call, or None
        constraint = output_constraint(body, body.response_format)
        if self.forced is not None and constraint is not None:
            raise InvalidRequestError("an output constraint (response_format, regex, guided_*) "
                                      "cannot be combined with a forced tool call")
        if body.top_logprobs and not body.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs=true")
        self.parallel = body.parallel_tool_calls and not isinstance(choice, NamedToolChoice)
        if self.forced:
            schema = tool_call_schema(self.forced)
            constraint = engine_constraints.json_schema(
                calls_list_schema(schema) if self.parallel else schema,
                strict=any(t.function.strict for t in self.forced), json_bounds=body.json_bounds)
        text = render_chat(ctx.engine, body.messages, self.tools, body.add_generation_prompt,
                           self.parallel)
        self.prompt_ids = encode_prompt(ctx.engine, text)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        self.jobs: list[Job] = [
            (self.prompt_ids, self.params(len(self.prompt_ids), j, max_tokens, constraint,
                                          body.logprobs, body.top_logprobs or 0))
            for j in range(body.n)]

    def _forced_tools(self, choice: Any) -> list[ChatTool] | None:
        if not self.tools or choice == "auto":
            return None
        if choice == "required":
            return self.tools
        named = [t for t in self.tools if t.function.name == choice.function.name]
        if not named:
            raise InvalidRequestError(f"tool_choice names {choice.function.name!r}, which is not in tools")
        return named

    async def serve(self, request: Request) -> ChatCompletionResponse | EventStreamResponse:
        if self.req.stream:
            return await self.stream(self.jobs)
        finals = await self.finals(request, self.jobs)
        choices = [self._choice(i, o) for i, o in enumerate(finals)]
        return ChatCompletionResponse(id=self.id, model=self.model, choices=choices,
                                      usage=usage([len(self.prompt_ids)], finals))

    def _choice(self, index: int, out: RequestOutput) -> ChatChoice:
        calls = self._tool_calls(out.text)
        message = (ChatMessageOut(content=None, tool_calls=calls) if calls
                   else ChatMessageOut(content=out.text))
        return ChatChoice(index=index, message=message, finish_reason=self._finish(out, calls),
                          logprobs=self._logprobs(out.token_ids, out),
                          constraint_check=engine_constraints.check_info(out.constraint_check))

    def _tool_calls(self, text: str) -> list[ToolCallOut]:
        if not self.tools:
            return []
        return parse_tool_calls(text, self.forced or self.tools, self.parallel)

    @staticmethod
    def _finish(out: RequestOutput, calls: list[ToolCallOut]) -> str | None:
        return "tool_calls" if calls and out.finish_reason == "stop" else out.finish_reason

    def chunks(self, index: int, out: RequestOutput) -> list[dict[str, Any]]:
        """Content deltas as they come; with tools, the answer is held back to the end
        (it may turn out to be a tool call), then sent as one delta."""
        payloads = []
        first = len(out.token_ids) == len(out.delta_token_ids)
        if first:
            payloads.append(self._chunk(index, ChatDelta(role="assistant", content="")))
        if self.tools and not out.finished:
            return payloads
        calls = self._tool_calls(out.text) if out.finished else []
        token_ids = out.token_ids if self.tools else out.delta_token_ids
        finish = self._finish(out, calls) if out.finished else None
        if calls:  # one delta per call, by its index; the last carries the finish
            for i, call in enumerate(calls[:-1]):
                payloads.append(self._chunk(index, ChatDelta(tool_calls=[
                    DeltaToolCall(index=i, id=call.id, function=call.function)])))
            delta = ChatDelta(tool_calls=[DeltaToolCall(index=len(calls) - 1, id=calls[-1].id,
                                                        function=calls[-1].function)])
        else:
            delta = ChatDelta(content=out.text if self.tools else out.delta_text)
        payloads.append(self._chunk(index, delta, finish, self._logprobs(token_ids, out), out))
        return payloads

    def _chunk(self, index: int, delta: ChatDelta, finish: str | None = None,
               logprobs: ChoiceLogprobs | None = None, out: RequestOutput | None = None) -> dict[str, Any]:
        check = engine_constraints.check_info(out.constraint_check) if out is not None else None
        choice = ChatChunkChoice(index=index, delta=delta, finish_reason=finish, logprobs=logprobs,
                                 constraint_check=check)
        chunk = ChatCompletionChunk(id=self.id, model=self.model, choices=[choice])
        data = chunk.model_dump(exclude_none=True)
        data["choices"][0]["finish_reason"] = finish  # present (null) on every chunk, as OpenAI does
        return data

    def prompt_lens(self) -> list[int]:
        return [len(self.prompt_ids)]

    def usage_chunk(self, finals: list[RequestOutput]) -> dict[str, Any]:
        chunk = ChatCompletionChunk(id=self.id, model=self.model, choices=[],
                                    usage=usage(self.prompt_lens(), finals))
        return chunk.model_dump(exclude_none=True)

    def _logprobs(self, token_ids: list[int], out: RequestOutput) -> ChoiceLogprobs | None:
        if not self.req.logprobs or out.logprobs is None:
            return None
        tok = self.ctx.engine.tokenizer
        n = len(token_ids)
        lps = out.logprobs[len(out.token_ids) - n:] if n else []
        tops = (out.top_logprobs or [])[len(out.token_ids) - n:] if n else []
        content = []
        for pos, (t, lp) in enumerate(zip(token_ids, lps, strict=False)):
            top = tops[pos] if pos < len(tops) else {}
            content.append(TokenLogprob(**_token_entry(tok, t, lp), top_logprobs=[
                TopLogprob(**_token_entry(tok, i, v)) for i, v in top.items()]))
        return ChoiceLogprobs(content=content)


def _token_entry(tokenizer: Any, token_id: int, logprob: float) -> dict[str, Any]:
    text = token_text(tokenizer, token_id)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def render_chat(engine: Any, messages: list[ChatMessageIn], tools: list[ChatTool],
                add_generation_prompt: bool, parallel: bool = False) -> str:
    """The prompt text: the model's chat template over ``messages``; tools (if any) are
    described in the system message."""
    dicts = [_message_dict(m) for m in messages]
    if tools:
        specs = "\n".join(json.dumps(t.function.model_dump(exclude_none=True)) for t in tools)
        note = TOOLS_PROMPT.format(specs=specs, parallel=PARALLEL_PROMPT if parallel else "")
        if dicts[0]["role"] == "system":
            dicts[0] = {**dicts[0], "content": dicts[0]["content"] + "\n\n" + note}
        else:
            dicts.insert(0, {"role": "system", "content": note})
    return str(engine.apply_chat_template(dicts, add_generation_prompt=add_generation_prompt))


def _message_dict(m: ChatMessageIn) -> dict[str, Any]:
    if isinstance(m.content, list):
        if any(p.type != "text" for p in m.content):
            raise InvalidRequestError("only text content parts are supported")
        content = "".join(p.text or "" for p in m.content)
    else:
        content = m.content or ""
    if m.tool_calls and not content:  # an earlier call, shown as the JSON the model wrote
        content = "\n".join(json.dumps({"name": c.function.name, "arguments": _arguments(c)})
                            for c in m.tool_calls)
    role = "system" if m.role == "developer" else m.role
    extra = {k: v for k, v in (("name", m.name), ("tool_call_id", m.tool_call_id)) if v is not None}
    return {"role": role, "content": content, **extra}  # NOTE: templates that know them use them


def _arguments(call: ToolCallOut) -> Any:
    try:
        return json.loads(call.function.arguments or "{}")
    except json.JSONDecodeError as exc:
        raise InvalidRequestError(f"tool call {call.id!r}: function.arguments is not JSON ({exc})") from None


def tool_call_schema(tools: list[ChatTool]) -> dict[str, Any]:
    """JSON schema of exactly one call ``{"name", "arguments"}`` to one of ``tools``
    (``$defs`` hoisted to the top so references stay valid)."""
    defs: dict[str, Any] = {}
    options = []
    for t in tools:
        params = dict(t.function.parameters)
        defs.update(params.pop("$defs", {}))
        options.append({"type": "object",
                        "properties": {"name": {"const": t.function.name}, "arguments": params},
                        "required": ["name", "arguments"], "additionalProperties": False})
    schema: dict[str, Any] = {"anyOf": options} if len(options) > 1 else options[0]
    if defs:
        schema["$defs"] = defs
    return schema


def calls_list_schema(call_schema: dict[str, Any]) -> dict[str, Any]:
    """JSON schema of a non-empty list of calls, each matching ``call_schema``
    (``tool_call_schema``; its ``$defs`` stay at the top so references stay valid)."""
    items = dict(call_schema)
    defs = items.pop("$defs", None)
    schema: dict[str, Any] = {"type": "array", "items": items, "minItems": 1}
    if defs:
        schema["$defs"] = defs
    return schema


def parse_tool_call(text: str, tools: list[ChatTool]) -> ToolCallOut | None:
    """A tool call if ``text`` is exactly one JSON call to one of ``tools``, else None."""
    calls = parse_tool_calls(text, tools, parallel=False)
    return calls[0] if calls else None


_TOOL_CALL_BLOCK = re.compile(r"\s*<tool_call>(.*?)</tool_call>\s*", re.S)


def parse_tool_calls(text: str, tools: list[ChatTool], parallel: bool = True) -> list[ToolCallOut]:
    """The calls ``text`` is made of: one JSON call, a JSON list of calls, or
    ``<tool_call>`` blocks, each to one of ``tools``; empty unless the whole text is calls
    (or, without ``parallel``, unless it is exactly one call)."""
    body = text.strip()
    blocks = _TOOL_CALL_BLOCK.findall(body)
    sources = blocks if blocks and _TOOL_CALL_BLOCK.sub("", body) == "" else [body]
    payloads: list[Any] = []
    for source in sources:
        try:
            payload = json.loads(source)
        except json.JSONDecodeError:
            return []
        payloads += payload if isinstance(payload, list) and len(sources) == 1 else [payload]
    calls = [_one_call(p, tools) for p in payloads]
    if not calls or any(c is None for c in calls) or (not parallel and len(calls) > 1):
        return []
    return [c for c in calls if c is not None]


def _one_call(payload: Any, tools: list[ChatTool]) -> ToolCallOut | None:
    if not isinstance(payload, dict) or payload.get("name") not in {t.function.name for t in tools}:
        return None
    arguments = payload.get("arguments", payload.get("parameters", {}))
    if not isinstance(arguments, dict):
        return None
    return ToolCallOut(id=new_id("call"), function=ToolCallFunction(
        name=payload["name"], arguments=json.dumps(arguments)))
