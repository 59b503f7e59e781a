"""Tool-call syntaxes per model family: how a model writes a call, read into OpenAI
``tool_calls``.

| format | a model writes | families / templates |
|---|---|---|
| ``hermes`` | text, then ``<tool_call>{"name": .., "arguments": {..}}</tool_call>`` blocks | Qwen 2.5 / 3, Hermes |
| ``llama3_json`` | ``{"name": .., "parameters": {..}}`` (after ``<|python_tag|>``), ``;`` between calls | Llama 3.x |
| ``mistral`` | text, then ``[TOOL_CALLS][{"name": .., "arguments": {..}}, ..]`` | Mistral, Mixtral |
| ``json`` | the whole answer one JSON call or a JSON list of them (Arbor's own prompt) | any other template |

A family names its format (``Family.tool_format``); otherwise the chat template's markers
say it (``tool_format``). A template that renders ``tools`` itself gets them (its own words
for them); otherwise the tools are described in the system message with the format's own
syntax (``tools_prompt``).

A forced call (``tool_choice`` "required" or named) is generated under a JSON schema after
the format's opening marker, which the server writes at the end of the prompt
(``ToolFormat.forced_prefix``): the answer is then the calls in the family's syntax (with
parallel calls, one JSON list of calls after the marker, which every parser here reads).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from runtime.model.families import FAMILIES
from runtime.server.api.common.messages import ChatTool, ToolCallFunction, ToolCallOut
from runtime.server.formats import model_template, partial_suffix
from runtime.server.serving import new_id


@dataclass(frozen=True)
class ToolFormat:
    """One family's tool-call syntax.

    ``marker``: what opens the calls after any text (None: the whole answer is calls).
    ``arguments_key``: the JSON key of a call's arguments.
    ``forced_prefix``: written after the prompt when a call is forced.
    ``instruction``: the tools prompt's sentence on how to call; ``several``: how to call
    several at once (added with parallel calls).
    """

    name: str
    marker: str | None
    arguments_key: str
    forced_prefix: str
    instruction: str
    several: str = " To call several at once, write several calls."

    def parse(self, text: str, tools: list[ChatTool], parallel: bool = True) -> tuple[str | None, list[ToolCallOut]]:
        """(content, calls) of an answer: the calls it ends with, each to one of ``tools``,
        and the text before them (None when empty). An answer whose calls do not parse,
        name an unknown tool, or (without ``parallel``) are several, is all content."""
        if self.marker is None:
            calls = _parse_payloads(_whole_answer_payloads(text, self.name), tools, parallel)
            return (None, calls) if calls else (text, [])
        at = text.find(self.marker)
        if at < 0:
            return text, []
        payloads = _marked_payloads(text[at:], self)
        calls = _parse_payloads(payloads, tools, parallel)
        if not calls:
            return text, []
        return text[:at].strip() or None, calls

    def call_schema(self, tools: list[ChatTool]) -> dict[str, Any]:
        """JSON schema of exactly one call to one of ``tools``, in this format's keys
        (``$defs`` hoisted to the top so references stay valid)."""
        return tool_call_schema(tools, self.arguments_key)


JSON = ToolFormat("json", None, "arguments", "",
                  'To call one, answer with a single JSON object {"name": <function name>, "arguments": '
                  "<arguments object>} and nothing else.",
                  " To call several at once, answer with a JSON list of such objects.")
HERMES = ToolFormat("hermes", "<tool_call>", "arguments", "<tool_call>\n",
                    'To call one, write <tool_call>{"name": <function name>, "arguments": '
                    "<arguments object>}</tool_call>.", " To call several at once, write one block per call.")
LLAMA3_JSON = ToolFormat("llama3_json", None, "parameters", "",
                         'To call one, answer with a single JSON object {"name": <function name>, '
                         '"parameters": <arguments object>} and nothing else.',
                         " To call several at once, separate them with ;.")
MISTRAL = ToolFormat("mistral", "[TOOL_CALLS]", "arguments", "[TOOL_CALLS]",
                     'To call functions, write [TOOL_CALLS] and then a JSON list of {"name": '
                     '<function name>, "arguments": <arguments object>} objects.', "")
FORMATS = {f.name: f for f in (JSON, HERMES, LLAMA3_JSON, MISTRAL)}

# A chat template's markers -> its format (the first found wins)
_TEMPLATE_MARKERS = (("<tool_call>", HERMES), ("[TOOL_CALLS]", MISTRAL), ("<|python_tag|>", LLAMA3_JSON))


def tool_format(family: str | None, template: str | None) -> ToolFormat:
    """The model's tool-call syntax: its family's (``Family.tool_format``), else the one
    its chat template's markers show, else Arbor's ``json``."""
    stated = FAMILIES[family].tool_format if family in FAMILIES else None
    if stated is not None:
        return FORMATS[stated]
    for marker, fmt in _TEMPLATE_MARKERS:
        if template and marker in template:
            return fmt
    return JSON


def model_tool_format(engine: Any) -> ToolFormat:
    """The served model's tool-call syntax (its family's, else its template's)."""
    template, family = model_template(engine)
    return tool_format(family, template)


def renders_tools(template: str | None) -> bool:
    """Whether a chat template renders the ``tools`` it is given (else they go in the
    system message)."""
    return bool(template) and re.search(r"\btools\b", template or "") is not None


def tools_prompt(fmt: ToolFormat, tools: list[ChatTool], parallel: bool) -> str:
    """The system-message text that describes ``tools`` to a model whose template does not."""
    specs = "\n".join(json.dumps(t.function.model_dump(exclude_none=True)) for t in tools)
    how = fmt.instruction + (fmt.several if parallel else "")
    return f"You can call the following functions. {how}\nFunctions:\n{specs}"


def tool_call_schema(tools: list[ChatTool], arguments_key: str = "arguments") -> dict[str, Any]:
    """JSON schema of exactly one call ``{"name", arguments_key}`` to one of ``tools``
    (``$defs`` hoisted to the top so references stay valid)."""
    defs: dict[str, Any] = {}
    options = []
    for t in tools:
        params = dict(t.function.parameters)
        defs.update(params.pop("$defs", {}))
        options.append({"type": "object",
                        "properties": {"name": {"const": t.function.name}, arguments_key: params},
                        "required": ["name", arguments_key], "additionalProperties": False})
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


def parse_tool_calls(text: str, tools: list[ChatTool], parallel: bool = True) -> list[ToolCallOut]:
    """The calls ``text`` is made of: one JSON call, a JSON list of calls, or
    ``<tool_call>`` blocks, each to one of ``tools``; empty unless the whole text is calls
    (or, without ``parallel``, unless it is exactly one call)."""
    return JSON.parse(text, tools, parallel)[1]


def parse_tool_call(text: str, tools: list[ChatTool]) -> ToolCallOut | None:
    """A tool call if ``text`` is exactly one JSON call to one of ``tools``, else None."""
    calls = parse_tool_calls(text, tools, parallel=False)
    return calls[0] if calls else None


_TOOL_CALL_BLOCK = re.compile(r"\s*<tool_call>(.*?)</tool_call>\s*", re.S)
_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)


def _whole_answer_payloads(text: str, name: str) -> list[str]:
    """JSON sources of an answer that is nothing but calls (``json``, ``llama3_json``)."""
    body = text.strip()
    if name == "llama3_json":
        body = body.removeprefix("<|python_tag|>").strip()
        return [p for p in (s.strip() for s in body.split(";")) if p] if body.startswith("{") else [body]
    blocks = _TOOL_CALL_BLOCK.findall(body)
    return blocks if blocks and _TOOL_CALL_BLOCK.sub("", body) == "" else [body]


def _marked_payloads(text: str, fmt: ToolFormat) -> list[str]:
    """JSON sources after the marker (``text`` starts with it); [] when anything but
    calls follows."""
    if fmt is HERMES:
        blocks = _HERMES_BLOCK.findall(text)
        return blocks if _HERMES_BLOCK.sub("", text).strip() == "" else []
    return [text[len(fmt.marker or ""):]]


def _parse_payloads(sources: list[str], tools: list[ChatTool], parallel: bool) -> list[ToolCallOut]:
    payloads: list[Any] = []
    for source in sources:
        try:
            payload = json.loads(source)
        except json.JSONDecodeError:
            return []
        payloads += payload if isinstance(payload, list) else [payload]
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


class ToolCallStream:
    """Content of a streamed answer up to its calls' marker; what follows is held back
    until the end (it is parsed then). For a format without a marker the whole answer is
    held (it may turn out to be calls)."""

    def __init__(self, fmt: ToolFormat) -> None:
        self.fmt = fmt
        self.holding = fmt.marker is None
        self._text = ""  # everything fed
        self._sent = 0  # characters of it sent as content

    def feed(self, delta: str) -> str:
        """The content that may be sent now."""
        self._text += delta
        if self.holding:
            return ""
        marker = self.fmt.marker or ""
        at = self._text.find(marker, self._sent)
        if at >= 0:
            self.holding = True
            out, self._sent = self._text[self._sent:at], at
            return out
        keep = partial_suffix(self._text, marker)
        end = len(self._text) - keep
        out, self._sent = self._text[self._sent:end], max(self._sent, end)
        return out

    def rest(self) -> str:
        """The text not sent as content (at the end: the calls, or content after all)."""
        return self._text[self._sent:]

