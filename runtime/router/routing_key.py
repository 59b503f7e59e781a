"""The routing key of a request: what the router compares between requests to find the
worker that already holds the longest shared prefix.

Keys are by text (code points), not by token ids. The router runs in front of any
``arbor serve`` URL without the model's tokenizer (``arbor router --workers ...`` may not
even have the model on its machine), and two requests that share a text prefix share the
token prefix up to the last token boundary, so a text match is the token match plus at most
a token's worth of characters. A request given as ``input_ids`` is keyed by those ids.
The two kinds never match each other: each key starts with its own tag (above the last
code point), so a text's code points cannot be mistaken for token ids.

    /generate              text | input_ids
    /v1/completions        prompt (a string, token ids, or the first of a list)
    /v1/chat/completions   messages, each as "<role>content" (the chat template's order)
    /programs/{name}       the name, then the arguments as canonical JSON
    anything else          no key: the least loaded worker
"""

from __future__ import annotations

import json
from typing import Any

TEXT_TAG = 0x110000  # one past the last Unicode code point
IDS_TAG = 0x110001


def text_key(text: str) -> list[int]:
    return [TEXT_TAG, *map(ord, text)]


def ids_key(ids: list[int]) -> list[int]:
    return [IDS_TAG, *ids]


def routing_key(path: str, body: Any) -> list[int] | None:
    """The key of a request to ``path`` with JSON ``body``; None when it has none (a GET,
    a body that is not a JSON object, a route without a prompt)."""
    if not isinstance(body, dict):
        return None
    if path == "/generate":
        return _prompt_key(body.get("text") if body.get("text") is not None else body.get("input_ids"))
    if path == "/v1/completions":
        return _prompt_key(body.get("prompt"))
    if path == "/v1/chat/completions":
        return _chat_key(body.get("messages"))
    if path.startswith("/programs/"):
        args = json.dumps(body.get("arguments", {}), sort_keys=True, separators=(",", ":"))
        return text_key(f"{path}\n{args}")
    return None


def _prompt_key(prompt: Any) -> list[int] | None:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of prompts: keyed by the first
    if isinstance(prompt, str) and prompt:
        return text_key(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return ids_key(prompt)
    return None


def _chat_key(messages: Any) -> list[int] | None:
    if not isinstance(messages, list) or not messages:
        return None
    parts = []
    for m in messages:
        if not isinstance(m, dict):
            return None
        content = m.get("content")
        text = content if isinstance(content, str) else json.dumps(content, sort_keys=True)
        parts.append(f"<{m.get('role')}>{text}")
    return text_key("".join(parts))
