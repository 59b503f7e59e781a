"""The chat request every chat-like API translates into: turns (``ChatMessageIn``) and
function tools (``ChatTool``), and the tool calls read back from an answer
(``ToolCallOut``). OpenAI chat takes them as its wire shapes; Responses and Anthropic
Messages build them from theirs, so one template rendering (``chat.render_chat``) and one
set of tool-call formats (``formats/``) serve every API.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from runtime.server.api.common.wire import Lenient


class FunctionDef(Lenient):
    name: str
    description: str | None = None
    strict: bool | None = None  # a forced call refuses parameters the grammar could only relax
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})


class ChatTool(Lenient):
    type: Literal["function"] = "function"
    function: FunctionDef


class ToolCallFunction(Lenient):
    name: str
    arguments: str  # JSON text


class ToolCallOut(Lenient):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ContentPart(Lenient):
    type: str
    text: str | None = None


class ChatMessageIn(Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallOut] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _content_given(self) -> ChatMessageIn:
        # NOTE: as in OpenAI's API, only an assistant turn that calls tools may go without text.
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content (null only for an assistant "
                             "message with tool_calls)")
        return self
