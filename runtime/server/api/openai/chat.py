"""``/v1/chat/completions``: the chat template, response_format, tools and tool_choice.

Forced tool calls (``tool_choice`` "required" or a named function) and ``response_format``
become a JSON-schema constraint (strict when the format or a forced function says so); each
final choice says how its output fared against that schema (``constraint_check``).
``tool_choice="auto"`` gives the model the tools (through its template when it renders
them, else in the system message) and returns the calls its answer ends with, in the
model family's own syntax (``formats/tool_calls.py``: Hermes ``<tool_call>`` blocks,
Llama 3 JSON, Mistral ``[TOOL_CALLS]``, or Arbor's JSON).

Parallel tool calls: with ``parallel_tool_calls`` (OpenAI's default: true) an answer may
hold several calls. ``tool_choice="required"`` is then constrained as a non-empty JSON list
of calls, each against its tool's schema; a named ``tool_choice`` stays one call of that
function. With ``parallel_tool_calls: false`` the answer is at most one call (an "auto"
answer of several calls is returned as content, not cut to its first). Streamed, content
flows until the calls' marker; each call is then one delta with its ``index``.

Reasoning models (``formats/reasoning.py``): the thinking span comes back as
``reasoning_content`` (streamed as such deltas), ``reasoning_budget`` bounds it, and every
constraint (response_format, forced calls) starts after it (``SamplingParams.reasoning``).
"""

from __future__ import annotations

from typing import Any

from fastapi import Request

from runtime.errors import InvalidRequestError
from runtime.output.request_output import RequestOutput
from runtime.sampling.reasoning import ReasoningSpan
from runtime.server import engine_constraints
from runtime.server.api.common.chat import render_chat
from runtime.server.api.common.messages import ChatTool, ToolCallOut
from runtime.server.api.openai.endpoint import Endpoint, Job, output_constraint, token_text, usage
from runtime.server.api.openai.schema import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatMessageOut,
    ChoiceLogprobs,
    DeltaToolCall,
    NamedToolChoice,
    TokenLogprob,
    TopLogprob,
)
from runtime.server.formats import model_template
from runtime.server.formats.reasoning import ReasoningFormat, ReasoningStream, reasoning_format
from runtime.server.formats.tool_calls import (
    ToolCallStream,
    ToolFormat,
    calls_list_schema,
    tool_format,
)
from runtime.server.serving import ServerContext, encode_prompt, new_id
from runtime.server.sse import EventStreamResponse
from runtime.server.tenants import Caller

__all__ = ["ChatEndpoint"]

# chat_template_kwargs the server sets itself
_RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "tools", "tokenize", "add_generation_prompt", "chat_template",
                                       "conversation", "documents", "continue_final_message", "return_dict"})


class ChatEndpoint(Endpoint):
    name = "chat"

    def __init__(self, ctx: ServerContext, body: ChatCompletionRequest, caller: Caller) -> None:
        super().__init__(ctx, body, caller)
        self.id = new_id("chatcmpl")
        self.req = body
        template, family = model_template(ctx.engine)
        self.format = tool_format(family, template)
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
            schema = self.format.call_schema(self.forced)
            constraint = engine_constraints.json_schema(
                calls_list_schema(schema) if self.parallel else schema,
                strict=any(t.function.strict for t in self.forced), json_bounds=body.json_bounds)
        text = render_chat(ctx.engine, body.messages, self.tools, body.add_generation_prompt,
                           self.parallel, self.format, _template_kwargs(body.chat_template_kwargs))
        self.reasoning, text = _open_thinking(reasoning_format(family, template), text, body)
        # a forced call's opening marker: after the prompt, or (reasoning) read as if written
        self.prefix = self.format.forced_prefix if self.forced else ""
        if self.reasoning is None:
            text += self.prefix
        self.prompt_ids = encode_prompt(ctx.engine, text)
        span = None
        if self.reasoning is not None and (constraint is not None or body.reasoning_budget is not None):
            end_ids = ctx.engine.tokenizer(self.reasoning.end, add_special_tokens=False)["input_ids"]
            span = ReasoningSpan(tuple(end_ids), body.reasoning_budget)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        self.jobs: list[Job] = [
            (self.prompt_ids, self.params(len(self.prompt_ids), j, max_tokens, constraint,
                                          body.logprobs, body.top_logprobs or 0, span))
            for j in range(body.n)]
        self._streams: dict[int, _ChoiceStream] = {}

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

    def _answer(self, text: str) -> tuple[str | None, str | None, list[ToolCallOut]]:
        """(thinking, content, calls) of a whole output."""
        thinking, answer = self.reasoning.split(text) if self.reasoning is not None else (None, text)
        if not self.tools:
            return thinking, answer, []
        content, calls = self.format.parse(self.prefix + answer, self.forced or self.tools, self.parallel)
        return thinking, (content if calls else answer), calls

    def _choice(self, index: int, out: RequestOutput) -> ChatChoice:
        thinking, content, calls = self._answer(out.text)
        message = ChatMessageOut(content=content, tool_calls=calls or None, reasoning_content=thinking)
        return ChatChoice(index=index, message=message, finish_reason=self._finish(out, calls),
                          logprobs=self._logprobs(out.token_ids, out),
                          constraint_check=engine_constraints.check_info(out.constraint_check))

    @staticmethod
    def _finish(out: RequestOutput, calls: list[ToolCallOut]) -> str | None:
        return "tool_calls" if calls and out.finish_reason == "stop" else out.finish_reason

    def chunks(self, index: int, out: RequestOutput) -> list[dict[str, Any]]:
        """Thinking and content deltas as they come; text that may be the start of the
        tool calls is held back to the end (it is parsed then), and each call is sent as
        one delta."""
        payloads = []
        state = self._streams.get(index)
        if state is None:
            state = self._streams[index] = _ChoiceStream(self.reasoning, self.format if self.tools else None)
            payloads.append(self._chunk(index, ChatDelta(role="assistant", content="")))
        thinking, content = state.feed(out.delta_text, out.finished)
        deltas = []
        if thinking:
            deltas.append(ChatDelta(reasoning_content=thinking))
        calls: list[ToolCallOut] = []
        if out.finished and self.tools:
            _, _, calls = self._answer(out.text)
            content += "" if calls else state.rest()
        if content:
            deltas.append(ChatDelta(content=content))
        deltas += [ChatDelta(tool_calls=[DeltaToolCall(index=i, id=c.id, function=c.function)])
                   for i, c in enumerate(calls)]
        if out.finished and not deltas:
            deltas.append(ChatDelta(content=""))
        for j, delta in enumerate(deltas):
            last = j == len(deltas) - 1
            logprobs = None
            if last:  # the tokens not yet reported, on the step's last chunk
                logprobs = self._logprobs(out.token_ids[state.num_reported:], out)
                state.num_reported = len(out.token_ids)
            payloads.append(self._chunk(index, delta, self._finish(out, calls) if last and out.finished else None,
                                        logprobs, out if last else None))
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


def _template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
    if kwargs and (reserved := sorted(_RESERVED_TEMPLATE_KWARGS & kwargs.keys())):
        raise InvalidRequestError(f"chat_template_kwargs may not set {', '.join(reserved)} (the server does)")
    return kwargs


def _open_thinking(fmt: ReasoningFormat | None, prompt: str,
                   body: ChatCompletionRequest) -> tuple[ReasoningFormat | None, str]:
    """The thinking span of this answer (None: there is none) and the prompt, which opens
    the span when the template left that to the model (``formats/reasoning.py``)."""
    state = fmt.prompt_state(prompt) if fmt is not None and body.add_generation_prompt else "closed"
    if state == "closed":
        if body.reasoning_budget is not None:
            raise InvalidRequestError("reasoning_budget applies to a reasoning model with thinking on; "
                                      "this answer has no thinking span")
        return None, prompt
    assert fmt is not None
    return fmt, prompt if state == "open" else prompt + fmt.start


class _ChoiceStream:
    """One streamed choice: its thinking and content split (``ReasoningStream``), the
    content held back from its tool calls' marker on (``ToolCallStream``)."""

    def __init__(self, reasoning: ReasoningFormat | None, tools: ToolFormat | None) -> None:
        self.reasoning = ReasoningStream(reasoning) if reasoning is not None else None
        self.tools = ToolCallStream(tools) if tools is not None else None
        self.num_reported = 0  # output tokens whose logprobs were sent

    def feed(self, delta: str, finished: bool) -> tuple[str, str]:
        """(thinking, content) to send for the next piece of output text."""
        thinking, answer = self.reasoning.feed(delta) if self.reasoning is not None else ("", delta)
        if finished and self.reasoning is not None:
            thinking += self.reasoning.flush()
        content = self.tools.feed(answer) if self.tools is not None else answer
        return thinking, content

    def rest(self) -> str:
        """Content held back (an answer that did not turn out to be calls)."""
        return self.tools.rest() if self.tools is not None else ""
