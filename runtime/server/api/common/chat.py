"""The prompt of a chat request, whichever API it came by: the served model's chat
template over the shared turns (``messages.py``), with the tools given to a template that
renders them or described in the system message in the family's call syntax
(``formats/tool_calls.py``).
"""

from __future__ import annotations

import json
from typing import Any

from runtime.errors import InvalidRequestError
from runtime.server.api.common.messages import ChatMessageIn, ChatTool, ToolCallOut
from runtime.server.formats import model_template
from runtime.server.formats.tool_calls import JSON, ToolFormat, renders_tools, tools_prompt


def render_chat(engine: Any, messages: list[ChatMessageIn], tools: list[ChatTool],
                add_generation_prompt: bool, parallel: bool = False, fmt: ToolFormat = JSON,
                template_kwargs: dict[str, Any] | None = None) -> str:
    """The prompt text: the model's chat template over ``messages``; tools (if any) go to
    a template that renders them, else they are described in the system message in
    ``fmt``'s syntax."""
    template, _ = model_template(engine)
    native = bool(tools) and fmt is not JSON and renders_tools(template)
    dicts = [_message_dict(m, native) for m in messages]
    if tools and not native:
        note = tools_prompt(fmt, tools, parallel)
        if dicts[0]["role"] == "system":
            dicts[0] = {**dicts[0], "content": dicts[0]["content"] + "\n\n" + note}
        else:
            dicts.insert(0, {"role": "system", "content": note})
    specs = [t.model_dump(exclude_none=True) for t in tools] if native else None
    if specs is None and not template_kwargs:
        return str(engine.apply_chat_template(dicts, add_generation_prompt=add_generation_prompt))
    return str(engine.apply_chat_template(dicts, add_generation_prompt=add_generation_prompt, tools=specs,
                                          template_kwargs=template_kwargs))


def _message_dict(m: ChatMessageIn, native: bool = False) -> dict[str, Any]:
    if isinstance(m.content, list):
        if any(p.type != "text" for p in m.content):
            raise InvalidRequestError("only text content parts are supported")
        content = "".join(p.text or "" for p in m.content)
    else:
        content = m.content or ""
    role = "system" if m.role == "developer" else m.role
    extra: dict[str, Any] = {k: v for k, v in (("name", m.name), ("tool_call_id", m.tool_call_id)) if v is not None}
    if m.tool_calls and native:  # the template writes earlier calls in the model's syntax
        extra["tool_calls"] = [{"id": c.id, "type": "function", "function": {
            "name": c.function.name, "arguments": _arguments(c)}} for c in m.tool_calls]
    elif m.tool_calls and not content:  # an earlier call, shown as the JSON the model wrote
        content = "\n".join(json.dumps({"name": c.function.name, "arguments": _arguments(c)})
                            for c in m.tool_calls)
    return {"role": role, "content": content, **extra}  # NOTE: templates that know them use them


def _arguments(call: ToolCallOut) -> Any:
    try:
        return json.loads(call.function.arguments or "{}")
    except json.JSONDecodeError as exc:
        raise InvalidRequestError(f"tool call {call.id!r}: function.arguments is not JSON ({exc})") from None


