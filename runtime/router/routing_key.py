"""The routing key of a request: what the router compares between requests to find the
worker that already holds the longest shared prefix.

Keys are by text (code points), not by token ids. The router runs in front of any
``arbor serve`` URL without the model's tokenizer (``arbor router --workers ...`` may not
even have the model on its machine), and two requests that share a text prefix share the
token prefix up to the last token boundary, so a text match is the token match plus at most
a token's worth of characters. A request given as ``input_ids`` is keyed by those ids.
The two kinds never match each other: each key starts with its own tag (above the last
code point), so a text's code points cannot be mistaken for token ids.

A worker reuses a prefix only within a cache namespace (a tenant and a ``cache_salt``,
``runtime.cache.namespace``), so the router's picture must not either: a request with a
namespace is keyed ``[NAMESPACE_TAG, *namespace code points, TEXT_TAG | IDS_TAG, ...]``
(``namespaced_key``); the kind tag ends the namespace, as no code point reaches it.

    /generate              text | input_ids
    /v1/completions        prompt (a string, token ids, or the first of a list)
    /v1/chat/completions   messages, each as "<role>content" (the chat template's order)
    /programs/{name}       the name, then the arguments as canonical JSON
    anything else          no key: the least loaded worker
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from runtime.cache.namespace import cache_namespace, check_cache_salt

TEXT_TAG = 0x110000  # one past the last Unicode code point
IDS_TAG = 0x110001
NAMESPACE_TAG = 0x110002
TENANT_HEADER = "x-tenant"  # runtime.server.tenants reads the same header


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


def namespaced_key(path: str, body: Any, headers: Mapping[str, str],
                   share_across_tenants: bool = False) -> list[int] | None:
    """``routing_key`` behind the request's cache namespace (none for anonymous, unsalted
    requests: their key is the plain one)."""
    key = routing_key(path, body)
    if key is None:
        return None
    namespace = request_namespace(body, headers, share_across_tenants)
    return key if namespace is None else [NAMESPACE_TAG, *map(ord, namespace), *key]


def request_namespace(body: dict[str, Any], headers: Mapping[str, str], share_across_tenants: bool) -> str | None:
    """The cache namespace a worker gives the request: the tenant is the ``X-Tenant`` header,
    else the OpenAI ``user`` field or Anthropic's ``metadata.user_id`` (as the server reads
    them); the salt is ``cache_salt``. An unusable salt gives None (the worker refuses it)."""
    metadata = body.get("metadata")
    user = body.get("user")
    if isinstance(metadata, dict) and user is None:
        user = metadata.get("user_id")
    tenant = headers.get(TENANT_HEADER) or (user if isinstance(user, str) else None) or None
    try:
        salt = check_cache_salt(body.get("cache_salt"))
    except ValueError:
        return None
    return cache_namespace(tenant, salt, share_across_tenants)


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
