"""Chat templates rendered as transformers renders them, without importing transformers.

The environment is the one ``apply_chat_template`` gives a template (transformers'
``utils/chat_template_utils.py``): a sandbox that cannot change its inputs, blocks
trimmed, ``break`` / ``continue``, a ``tojson`` that leaves non-ASCII and HTML alone,
``raise_exception`` and ``strftime_now``, and a ``dict`` / ``namespace`` that refuse
private names. The messages are prepared the same way too: keys whose value is None
dropped, and a message's reasoning given under ``reasoning_content`` and ``thinking``.
What this module does not prepare (batches of chats, objects rather than JSON values,
tools given as Python functions, ``{% generation %}`` blocks, continuing the last
message) it reports with ``NotPlain``, and the caller hands the call to transformers.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

# names a message's reasoning comes under; templates read the first
_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


class NotPlain(Exception):
    """The call needs something only transformers' own rendering does."""


def render_chat(template: str, messages: Any, add_generation_prompt: bool, tools: Any, documents: Any,
                variables: dict[str, Any]) -> str:
    """``template`` rendered over ``messages`` (a list of message dicts).

    Raises:
        NotPlain: see the module docstring.
        jinja2.TemplateError: the template raised (``raise_exception``) or cannot render them.
        TypeError: a message is not a dict.
    """
    if not isinstance(messages, list | tuple) or (messages and not isinstance(messages[0], Mapping)):
        raise NotPlain("a batch of chats or message objects")
    if tools is not None and not all(isinstance(tool, Mapping) for tool in tools):
        raise NotPlain("tools given as functions")
    if documents is not None and not all(isinstance(doc, Mapping) for doc in documents):
        raise NotPlain("documents that are not dicts")
    chat = [_with_reasoning_aliases(_message(m)) for m in messages]
    return _compiled(template).render(messages=chat, tools=_plain(tools), documents=_plain(documents),
                                      add_generation_prompt=add_generation_prompt, **_plain(variables))


def _message(message: Any) -> dict[str, Any]:
    if not isinstance(message, Mapping):
        raise TypeError(f"Chat messages should be dicts, but got {message!r}.")
    return {key: _plain(value) for key, value in message.items() if value is not None}


def _with_reasoning_aliases(message: dict[str, Any]) -> dict[str, Any]:
    reasoning = next((message[key] for key in _REASONING_KEYS if message.get(key) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _plain(value: Any) -> Any:
    """``value`` when it is built of JSON types only (exactly: no subclasses), with tuples
    kept; anything else is transformers' to convert."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if type(value) is dict:
        return {_plain(k): _plain(v) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_plain(v) for v in value)
    raise NotPlain(f"a {type(value).__name__} value")


class _Dict:
    """``dict(...)`` inside a template, without the type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """jinja's ``namespace`` refusing underscore-prefixed names (a way to CPython's insides)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 (jinja's own signature: a ``self=`` key works)
        self, rest = args[0], args[1:]
        for name in dict(*rest, **kwargs):
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, *rest, **kwargs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a namespace cannot hold the private name {name!r}")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def _compiled(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_Dict(),
                       namespace=_Namespace)
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as exc:  # NOTE: {% generation %} is transformers' own tag
        if "generation" in template:
            raise NotPlain("a {% generation %} block") from exc
        raise
