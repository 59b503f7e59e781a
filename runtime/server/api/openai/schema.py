"""OpenAI's chat and completions wire shapes (``/v1/completions``,
``/v1/chat/completions``, ``/v1/models``). The chat turns and tools are the shared
internal ones (``common/messages.py``), which this API takes as they are on its wire.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator

from runtime.server.api.common.messages import (
    ChatMessageIn,
    ChatTool,
    ToolCallFunction,
    ToolCallOut,
)
from runtime.server.api.common.wire import ConstraintCheckInfo, Lenient, RetentionHint


class StreamOptions(Lenient):
    include_usage: bool = False
    # vLLM's extension (guidellm sends it): with include_usage, every chunk carries the
    # usage so far
    continuous_usage_stats: bool = False


class SamplingExtras(Lenient):
    """Fields shared by both OpenAI endpoints, with the vLLM/SGLang extensions."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=0)
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = Field(default=1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # the tenant, unless the X-Tenant header names one (tenants.py)
    # vLLM's: a prefix-cache namespace within the tenant; any JSON value, checked by
    # tenants.caller_of so that a bad one is a 400 saying why
    cache_salt: Any = None
    # extensions (vLLM / SGLang names)
    top_k: int = 0
    min_p: float = 0.0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    stop_regex: str | list[str] | None = None
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    regex: str | None = None  # SGLang: the output matches this regular expression
    guided_regex: str | None = None  # vLLM's name for the same
    guided_choice: list[str] | None = Field(default=None, min_length=1)  # vLLM: one of these strings
    # More constraint fields of other servers (``api/common/constraint_fields.py``): honoured or a 400.
    guided_json: dict[str, Any] | str | None = None  # vLLM: a JSON schema (object or text)
    json_schema: dict[str, Any] | str | None = None  # SGLang extra body: the same
    guided_grammar: str | None = None  # vLLM: GBNF or Lark
    ebnf: str | None = None  # SGLang: GBNF
    grammar: str | None = None  # llama.cpp server: GBNF
    structured_outputs: dict[str, Any] | None = None  # vLLM >= 0.10
    timeout: float | None = Field(default=None, gt=0)
    json_bounds: bool = True  # false: no bounds on number literals in JSON outputs
    retention: RetentionHint | None = None  # Arbor: keep the conversation for the next turn
    ttft_slo: float | None = Field(default=None, gt=0)  # Arbor's: seconds; None: the engine's target
    itl_slo: float | None = Field(default=None, gt=0)  # Arbor's: seconds; None: the engine's target


class JsonSchemaFormat(Lenient):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(Lenient):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs a json_schema")
        return self


class CompletionRequest(SamplingExtras):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=0)
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False  # the prompt before the completion (with its logprobs when asked)
    return_tokens_as_token_ids: bool = False  # vLLM: logprobs tokens as "token_id:<id>"
    best_of: int | None = None
    suffix: str | None = None
    response_format: ResponseFormat | None = None  # extension (as in vLLM)






class NamedFunction(Lenient):
    name: str


class NamedToolChoice(Lenient):
    type: Literal["function"] = "function"
    function: NamedFunction










class ChatCompletionRequest(SamplingExtras):
    messages: list[ChatMessageIn] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    add_generation_prompt: bool = True  # extension
    parallel_tool_calls: bool = True  # false: at most one tool call per answer
    # reasoning models (docs/reasoning-and-tool-formats.md): the most thinking tokens before
    # the span is closed; keyword arguments of the chat template (vLLM's, e.g. enable_thinking)
    reasoning_budget: int | None = Field(default=None, ge=0)
    chat_template_kwargs: dict[str, Any] | None = None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None] | None  # None: the first echoed prompt token
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None = None
    constraint_check: ConstraintCheckInfo | None = None  # extension: constrained, final


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallOut] | None = None
    reasoning_content: str | None = None  # a reasoning model's thinking span (as vLLM, DeepSeek)


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    finish_reason: str | None
    logprobs: ChoiceLogprobs | None = None
    constraint_check: ConstraintCheckInfo | None = None  # extension: constrained requests


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class DeltaToolCall(BaseModel):
    index: int
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None
    reasoning_content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    finish_reason: str | None = None
    logprobs: ChoiceLogprobs | None = None
    constraint_check: ConstraintCheckInfo | None = None  # extension: on the final chunk


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "arbor"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
