"""Cache namespaces: whose prefixes a request may reuse.

A prefix cached for one tenant, or under one ``cache_salt`` (vLLM's request field), is
never matched for another: sharing KV across callers is a timing side channel (a caller
can tell from its time to first token whether someone else sent a prompt). Each
namespace is a separate tree under the cache's top (``RadixTree``), so a lookup in one
cannot reach another's pages; eviction stays global (one LRU over all namespaces).

``None`` is the shared namespace of anonymous requests without a salt. A server started
with ``share_prefix_cache_across_tenants`` drops the tenant from the key: then only
salts separate requests.
"""

from __future__ import annotations

import json

Namespace = str | None  # None: the shared default; else an opaque key (cache_namespace)

MAX_CACHE_SALT_LEN = 1024  # characters: a salt is a key, not a payload


def check_cache_salt(salt: object) -> str | None:
    """``salt`` if it is a usable ``cache_salt`` (None: none given).

    Raises:
        ValueError: not a string, empty, or longer than ``MAX_CACHE_SALT_LEN``.
    """
    if salt is None:
        return None
    if not isinstance(salt, str):
        raise ValueError(f"cache_salt must be a string, got {type(salt).__name__}")
    if not salt:
        raise ValueError("cache_salt must be a non-empty string (leave it out for no salt)")
    if len(salt) > MAX_CACHE_SALT_LEN:
        raise ValueError(f"cache_salt is at most {MAX_CACHE_SALT_LEN} characters, got {len(salt)}")
    return salt


def cache_namespace(tenant: str | None, salt: str | None, share_across_tenants: bool = False) -> Namespace:
    """The namespace of a request from ``tenant`` with ``salt``.

    NOTE: JSON of the pair, so no choice of tenant and salt strings can collide with
    another's (``"a|b" + "c"`` vs ``"a" + "b|c"``).
    """
    owner = None if share_across_tenants else tenant
    if owner is None and salt is None:
        return None
    return json.dumps([owner, salt])
