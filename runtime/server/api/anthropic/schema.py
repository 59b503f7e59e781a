"""Anthropic Messages API wire shapes (``POST /v1/messages``, ``/v1/messages/count_tokens``),
as the spec and the official ``anthropic`` SDK (``anthropic.types``) spell them."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from runtime.server.api.common.fields import IgnoredFields, RefusedFields, WireModel, is_empty


class Block(WireModel):
    """A content block: text, tool_use (an earlier call) or tool_result (its answer)."""

    type: str
    text: str | None = None
    id: str | None = None  # tool_use
    name: str | None = None  # tool_use
    input: dict[str, Any] | None = None  # tool_use
    tool_use_id: str | None = None  # tool_result
    content: str | list[Block] | None = None  # tool_result
    is_error: bool | None = None  # tool_result


class Message(WireModel):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class Tool(WireModel):
    name: str
    description: str | None = None
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    type: Literal["custom"] | None = None


class ToolChoice(WireModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class OutputFormat(WireModel):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(WireModel):
    format: OutputFormat | None = None  # structured output: the answer's text matches the schema


class CountTokensRequest(WireModel):
    model: str | None = None
    messages: list[Message] = Field(min_length=1)
    system: str | list[Block] | None = None
    tools: list[Tool] = Field(default_factory=list)
    tool_choice: ToolChoice | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] = Field(default_factory=list)
    temperature: float = 1.0  # (newer SDKs send these as extra_body)
    top_p: float = 1.0
    top_k: int = 0
    output_config: OutputConfig = Field(default_factory=lambda: OutputConfig())
    stream: bool = False
    metadata: dict[str, Any] = Field(default_factory=dict)  # user_id: the tenant
    timeout: float | None = Field(default=None, gt=0)  # Arbor's: seconds, capped by the server's


IGNORED: IgnoredFields = {
    "service_tier": "this server has one tier",
    "cache_control": "the prefix cache is automatic (radix tree)",
    "inference_geo": "one server, one place",
    "messages.*.content.*.cache_control": "the prefix cache is automatic (radix tree)",
    "system.*.cache_control": "the prefix cache is automatic (radix tree)",
    "tools.*.cache_control": "the prefix cache is automatic (radix tree)",
    "messages.*.content.*.citations": "an earlier answer's citations; not part of the prompt",
}
REFUSED: RefusedFields = {
    "thinking": ("this model has no extended thinking", is_empty),
    "container": ("no code-execution container", is_empty),
    "mcp_servers": ("no MCP servers", is_empty),
    "speed": ("one speed", is_empty),
}


class TextOut(BaseModel):
    type: Literal["text"] = "text"
    text: str


class ToolUseOut(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


class UsageOut(BaseModel):
    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int = 0
    cache_creation_input_tokens: int = 0


class MessageOut(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[TextOut | ToolUseOut]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None
    stop_sequence: str | None = None
    usage: UsageOut
