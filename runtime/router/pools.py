"""Named pools of workers and the sticky choice of a pool for one request. Torch-free.

A request's sticky key (a session id, a tenant, a program name, or its prompt's first
characters: the plan's ``sticky`` order picks the first the request carries) hashes to
one of ``NUM_BUCKETS`` buckets. The pools own consecutive bucket ranges in a fixed order,
the candidate first and the baseline last::

    0            candidate            w_c | other pools ... |       baseline        NUM_BUCKETS
    [=============================)[===================)[==========================)

so one key stays on one pool while the weights stand, and a key on the candidate at 5%
is still there at 25% (raising the candidate's weight only moves keys off the baseline).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from runtime.errors import InvalidRequestError

NUM_BUCKETS = 10_000
PROMPT_KEY_CHARS = 256  # a conversation's later turns share its first characters


@dataclass(frozen=True)
class Pools:
    """Pool name -> indices of its workers in the router's one ``WorkerPool``."""

    members: Mapping[str, tuple[int, ...]]

    @staticmethod
    def parse(specs: Sequence[str]) -> tuple[Pools, list[str]]:
        """``["baseline=URL,URL", "candidate=URL"]`` -> (pools, every worker URL in order).

        Raises:
            InvalidRequestError: not NAME=URL, a URL that is not http(s), a pool given twice.
        """
        members: dict[str, tuple[int, ...]] = {}
        urls: list[str] = []
        for spec in specs:
            name, sep, rest = spec.partition("=")
            if not sep or not name or not rest:
                raise InvalidRequestError(f"--pool takes NAME=URL[,URL...], got {spec!r}")
            if name in members:
                raise InvalidRequestError(f"pool {name!r} given twice")
            pool_urls = [u for u in rest.split(",") if u]
            for url in pool_urls:
                if not url.startswith(("http://", "https://")):
                    raise InvalidRequestError(f"a worker URL must start with http:// or https://, got {url!r}")
            members[name] = tuple(range(len(urls), len(urls) + len(pool_urls)))
            urls += pool_urls
        return Pools(members), urls

    @property
    def names(self) -> list[str]:
        return list(self.members)

    def pool_of(self, worker: int) -> str:
        return next(name for name, idx in self.members.items() if worker in idx)


def bucket(key: str) -> int:
    """The key's bucket in [0, NUM_BUCKETS): stable across processes and restarts."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big") % NUM_BUCKETS


def choose_pool(key_bucket: int, weights: Mapping[str, int], baseline: str, candidate: str) -> str:
    """The pool owning ``key_bucket`` under ``weights`` (percent per pool, adding up to 100)."""
    order = [candidate, *sorted(p for p in weights if p not in (baseline, candidate)), baseline]
    edge = 0
    for pool in order:
        edge += weights.get(pool, 0) * NUM_BUCKETS // 100
        if key_bucket < edge:
            return pool
    return baseline


def entry_point(path: str) -> str:
    """The metric label and match value of a route: ``program:NAME`` for a program run."""
    if path.startswith("/programs/"):
        return "program:" + path[len("/programs/"):].split("/")[0]
    return path


def sticky_key(order: Sequence[str], path: str, headers: Mapping[str, str], body: Any,
               tenant: str | None) -> str | None:
    """The first key of ``order`` the request carries (None: none, e.g. an empty prompt)."""
    for kind in order:
        key = _key(kind, path, headers, body, tenant)
        if key:
            return f"{kind}:{key}"
    return None


def _key(kind: str, path: str, headers: Mapping[str, str], body: Any, tenant: str | None) -> str | None:
    if kind == "session":
        return headers.get("x-session-id") or (body.get("session_id") if isinstance(body, dict) else None)
    if kind == "tenant":
        return tenant
    if kind == "program":
        return entry_point(path) if path.startswith("/programs/") else None
    if kind == "prompt" and isinstance(body, dict):
        prompt = body.get("text") or body.get("input_ids") or body.get("prompt") or _first_turn(body.get("messages"))
        if path.startswith("/programs/"):
            prompt = body.get("arguments")
        if prompt:
            text = prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True)
            return f"{path}\n{text[:PROMPT_KEY_CHARS]}"
    return None


def _first_turn(messages: Any) -> Any:
    """The messages up to the first user message: what every later turn of the same
    conversation starts with (a later turn's longer list must keep its key)."""
    if not isinstance(messages, list):
        return None
    for i, m in enumerate(messages):
        if isinstance(m, dict) and m.get("role") == "user":
            return messages[: i + 1]
    return messages
