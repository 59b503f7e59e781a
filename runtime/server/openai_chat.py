"""``/v1/chat/completions``: the chat template, response_format, tools and tool_choice.

Forced tool calls (``tool_choice`` "required" or a named function) and ``response_format``
become a JSON-schema constraint (strict when the format or a forced function says so); each
final choice says how its output fared against that schema (``constraint_check``).
``tool_choice="auto"`` describes the tools in the system message and returns a tool call
when the model's whole answer is one (``{"name": ..., "arguments": {...}}``).
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request

from runtime.errors import InvalidRequestError
from runtime.outputs import RequestOutput
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
    '{{"name": <function name>, "arguments": <arguments object>}} and nothing else.\n'
    "Functions:\n{specs}"
)


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
        constraint = (engine_constraints.json_schema(tool_call_schema(self.forced),
                                                     strict=any(t.function.strict for t in self.forced),
                                                     json_bounds=body.json_bounds) if self.forced
                      else constraint)
        text = render_chat(ctx.engine, body.messages, self.tools, body.add_generation_prompt)
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
        call = self._tool_call(out.text)
        message = (ChatMessageOut(content=None, tool_calls=[call]) if call is not None
                   else ChatMessageOut(content=out.text))
        return ChatChoice(index=index, message=message, finish_reason=self._finish(out, call),
                          logprobs=self._logprobs(out.token_ids, out),
                          constraint_check=engine_constraints.check_info(out.constraint_check))

    def _tool_call(self, text: str) -> ToolCallOut | None:
        if not self.tools:
            return None
        return parse_tool_call(text, self.forced or self.tools)

    @staticmethod
    def _finish(out: RequestOutput, call: ToolCallOut | None) -> str | None:
        return "tool_calls" if call is not None and out.finish_reason == "stop" else out.finish_reason

    def chunks(self, index: int, out: RequestOutput) -> list[dict[str, Any]]:
        """Content deltas as they come; with tools, the answer is held back to the end
        (it may turn out to be a tool call), then sent as one delta."""
        payloads = []
        first = len(out.token_ids) == len(out.delta_token_ids)
        if first:
            payloads.append(self._chunk(index, ChatDelta(role="assistant", content="")))
        if self.tools and not out.finished:
            return payloads
        call = self._tool_call(out.text) if out.finished else None
        if call is not None:
            delta = ChatDelta(tool_calls=[DeltaToolCall(index=0, id=call.id, function=call.function)])
        else:
            delta = ChatDelta(content=out.text if self.tools else out.delta_text)
        token_ids = out.token_ids if self.tools else out.delta_token_ids
        payloads.append(self._chunk(index, delta, self._finish(out, call) if out.finished else None,
                                    self._logprobs(token_ids, out), out))
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

    def usage_chunk(self, finals: list[RequestOutput]) -> dict[str, Any]:
        chunk = ChatCompletionChunk(id=self.id, model=self.model, choices=[],
                                    usage=usage([len(self.prompt_ids)], finals))
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
                add_generation_prompt: bool) -> str:
    """The prompt text: the model's chat template over ``messages``; tools (if any) are
    described in the system message."""
    dicts = [_message_dict(m) for m in messages]
    if tools:
        specs = "\n".join(json.dumps(t.function.model_dump(exclude_none=True)) for t in tools)
        note = TOOLS_PROMPT.format(specs=specs)
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


def parse_tool_call(text: str, tools: list[ChatTool]) -> ToolCallOut | None:
    """A tool call if ``text`` is exactly one JSON call to one of ``tools``, else None."""
    body = text.strip().removeprefix("<tool_call>").removesuffix("</tool_call>").strip()
    try:
        payload = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(payload, dict) or payload.get("name") not in {t.function.name for t in tools}:
        return None
    arguments = payload.get("arguments", payload.get("parameters", {}))
    if not isinstance(arguments, dict):
        return None
    return ToolCallOut(id=new_id("call"), function=ToolCallFunction(
        name=payload["name"], arguments=json.dumps(arguments)))
