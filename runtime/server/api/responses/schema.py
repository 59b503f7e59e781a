"""OpenAI Responses API wire shapes (``POST /v1/responses``), as the spec and the
official ``openai`` SDK (``openai.types.responses``) spell them.

Requests: ``input`` (a string or items: messages, ``function_call`` and
``function_call_output``), ``instructions``, function ``tools`` and ``tool_choice``,
``text.format`` (structured output), ``previous_response_id``. Answers: a ``response``
object whose ``output`` holds ``message`` and ``function_call`` items; streamed as the
spec's typed events (``response.created`` ... ``response.completed``).
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, Field

from runtime.server.api.common.fields import (
    IgnoredFields,
    RefusedFields,
    WireModel,
    is_empty,
    is_false,
)

# ---- requests ---------------------------------------------------------------------------------


class ContentPart(WireModel):
    type: str  # input_text / output_text (others are refused)
    text: str | None = None


class InputMessage(WireModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]
    id: str | None = None  # an earlier output item given back
    status: str | None = None


class FunctionCallItem(WireModel):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str  # JSON text
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(WireModel):
    type: Literal["function_call_output"]
    call_id: str
    output: str
    id: str | None = None
    status: str | None = None


InputItem = FunctionCallItem | FunctionCallOutputItem | InputMessage


class FunctionTool(WireModel):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = None


class FunctionChoice(WireModel):
    type: Literal["function"]
    name: str


class TextFormat(WireModel):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(WireModel):
    format: TextFormat = Field(default_factory=lambda: TextFormat())


class ResponsesRequest(WireModel):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float = 1.0
    top_p: float = 1.0
    tools: list[FunctionTool] = Field(default_factory=list)
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice = "auto"
    parallel_tool_calls: bool = True
    text: TextConfig = Field(default_factory=lambda: TextConfig())
    stream: bool = False
    previous_response_id: str | None = None
    store: bool = True  # kept for previous_response_id (a bounded store: the oldest go first)
    metadata: dict[str, str] = Field(default_factory=dict)  # echoed on the response
    user: str | None = None  # the tenant, unless the X-Tenant header names one
    cache_salt: Any = None  # vLLM's prefix-cache namespace; checked by tenants.caller_of (400)
    timeout: float | None = Field(default=None, gt=0)  # Arbor's: seconds, capped by the server's


IGNORED: IgnoredFields = {
    "service_tier": "this server has one tier",
    "prompt_cache_key": "the prefix cache is automatic (radix tree), no key is needed",
    "prompt_cache_retention": "the prefix cache keeps what fits, least recently used out first",
    "safety_identifier": "no abuse monitoring on this server",
    "truncation": "a prompt past the context is refused (400), never truncated; 'disabled' is the same",
    "stream_options": "no obfuscation padding is sent",
    "input.*.content.*.annotations": "an earlier answer's citations; not part of the prompt",
}
REFUSED: RefusedFields = {
    "reasoning": ("this model has no reasoning mode", is_empty),
    "background": ("no background responses", is_false),
    "conversation": ("no stored conversations; use previous_response_id", is_empty),
    "prompt": ("no stored prompt templates", is_empty),
    "include": ("no extra output (logprobs, sources...) to include", is_empty),
    "top_logprobs": ("no logprobs in the Responses API here; use /v1/chat/completions", is_empty),
    "max_tool_calls": ("no built-in tools to cap", is_empty),
    "context_management": ("no server-side context compaction", is_empty),
}

# ---- answers ----------------------------------------------------------------------------------


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)


class MessageItem(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: Literal["in_progress", "completed", "incomplete"] = "completed"
    role: Literal["assistant"] = "assistant"
    content: list[OutputText] = Field(default_factory=list)


class FunctionCallOut(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed"] = "completed"


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: dict[str, int]
    output_tokens: int
    output_tokens_details: dict[str, int]
    total_tokens: int


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: Literal["in_progress", "completed", "incomplete"]
    model: str
    output: list[MessageItem | FunctionCallOut] = Field(default_factory=list)
    usage: ResponseUsage | None = None
    incomplete_details: dict[str, str] | None = None
    error: dict[str, Any] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float
    top_p: float
    tools: list[dict[str, Any]]
    tool_choice: Any
    parallel_tool_calls: bool
    previous_response_id: str | None = None
    text: dict[str, Any]
    store: bool
    metadata: dict[str, str]
