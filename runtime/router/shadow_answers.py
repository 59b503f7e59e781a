"""What the shadow replay compares in an answer, per route: its tokens, each position's
top logprobs, its constraint validity, whether the request was greedy. Torch-free.

The tokens are the finest unit the answer carries on both sides:

    unit      answers that carry it
    "ids"     native ``/generate`` (``output_ids``); ``/v1/completions`` with
              ``logprobs`` and ``return_tokens_as_token_ids`` ("token_id:<id>")
    "tokens"  ``/v1/completions`` with ``logprobs`` (token texts);
              ``/v1/chat/completions`` with ``logprobs: true`` (``content[].token``)
    "text"    any other OpenAI answer: its text, one unit per character

An OpenAI answer is compared on its first choice. Top logprobs (for the KL) come with
the ids or token texts when the request asked for them (``top_logprobs`` /
``logprobs: N``), keyed the same way as the tokens.
"""

from __future__ import annotations

import json
from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from typing import Any

SHADOW_ROUTES = frozenset({"/generate", "/v1/completions", "/v1/chat/completions"})
TOKEN_ID_PREFIX = "token_id:"  # return_tokens_as_token_ids


@dataclass(frozen=True)
class AnswerTokens:
    unit: str  # "ids", "tokens" or "text" (above)
    tokens: list[Hashable]  # the output, in that unit
    tops: list[dict[Hashable, float]] | None  # per output position, keyed like ``tokens``; None: not asked
    text: str  # the output text (the fallback when the two sides' units differ)
    valid: bool | None  # the worker's constraint check; None: unconstrained


def shadowable(path: str, body: Mapping[str, Any]) -> bool:
    """Whether a request to ``path`` can be replayed and compared (not streamed; an
    echoed prompt would be counted as output)."""
    return path in SHADOW_ROUTES and not body.get("stream") and not body.get("echo")


def is_greedy(path: str, body: Mapping[str, Any]) -> bool:
    if path == "/generate":
        params = body.get("sampling_params") or {}
        return isinstance(params, dict) and params.get("temperature", 1.0) == 0.0
    return body.get("temperature", 1.0) == 0.0  # OpenAI's default is 1


def answer_tokens(path: str, answer: Mapping[str, Any]) -> AnswerTokens:
    """The comparable content of ``answer`` (a JSON object) to a request on ``path``.
    Raises KeyError / TypeError / ValueError for an answer of another shape."""
    if path == "/generate":
        meta = answer.get("meta") or {}
        tops = meta.get("top_logprobs")
        return AnswerTokens("ids", list(answer["output_ids"]),
                            [{int(t): float(lp) for t, lp in top.items()} for top in tops] if tops else None,
                            str(answer.get("text", "")), _valid(meta))
    choice = answer["choices"][0]
    if path == "/v1/completions":
        return _completion(choice)
    return _chat(choice)


def _completion(choice: Mapping[str, Any]) -> AnswerTokens:
    text, valid = str(choice["text"]), _valid(choice)
    lp = choice.get("logprobs")
    if not lp or not lp.get("tokens"):
        return AnswerTokens("text", list(text), None, text, valid)
    raw = list(lp["tokens"])
    as_ids = all(t.startswith(TOKEN_ID_PREFIX) for t in raw)
    tops = lp.get("top_logprobs")
    return AnswerTokens("ids" if as_ids else "tokens", [_key(t, as_ids) for t in raw],
                        [{_key(t, as_ids): float(v) for t, v in top.items()} for top in tops] if tops else None,
                        text, valid)


def _chat(choice: Mapping[str, Any]) -> AnswerTokens:
    message = choice["message"]
    # NOTE: a tool call's id is made up per answer: compare what was called, with what
    calls = [c["function"] for c in message.get("tool_calls") or []]
    text = json.dumps(calls, sort_keys=True) if calls else str(message.get("content") or "")
    content = (choice.get("logprobs") or {}).get("content")
    if not content or calls:
        return AnswerTokens("text", list(text), None, text, _valid(choice))
    tops = [{t["token"]: float(t["logprob"]) for t in c["top_logprobs"]} for c in content]
    return AnswerTokens("tokens", [c["token"] for c in content], tops if all(tops) else None, text,
                        _valid(choice))


def _key(token: str, as_id: bool) -> Hashable:
    return int(token[len(TOKEN_ID_PREFIX):]) if as_id else token


def _valid(holder: Mapping[str, Any]) -> bool | None:
    check = holder.get("constraint_check")
    return check.get("valid") if isinstance(check, dict) else None
