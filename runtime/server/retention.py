"""A request's retention hint (``RetentionHint``) → the engine's ``Retention``.

Sessions are namespaced by tenant (one tenant cannot touch another's pins by naming its
session), and a tenant is the owner whose page budget its pins count against
(``EngineConfig.retention_max_pages``). The TTL is capped by ``retention_max_ttl_s``.
"""

from __future__ import annotations

from runtime.cache.retention import MAX_SESSION_ID_LEN, Retention
from runtime.config import EngineConfig
from runtime.errors import InvalidRequestError
from runtime.server.api.common.wire import RetentionHint

ANONYMOUS = "anonymous"  # the owner of requests that name no tenant
MAX_HINT_ID_LEN = 128


def retention_of(hint: RetentionHint | None, tenant: str | None, config: EngineConfig) -> Retention | None:
    """The engine's hint for a request of ``tenant``, or None without one.

    Raises:
        InvalidRequestError: an empty or too long session id, or a TTL outside
            (0, ``retention_max_ttl_s``] (a 400).
    """
    if hint is None:
        return None
    if not 0 < len(hint.session_id) <= MAX_HINT_ID_LEN:
        raise InvalidRequestError(f"retention.session_id must have 1 to {MAX_HINT_ID_LEN} characters")
    cap = config.retention_max_ttl_s
    if not 0 < hint.ttl_s <= cap:
        raise InvalidRequestError(f"retention.ttl_s is {hint.ttl_s:g}; this server keeps a session's "
                                  f"prefix for more than 0 and at most {cap:g} seconds")
    owner = tenant or ANONYMOUS
    return Retention(session_key(hint.session_id, tenant), hint.ttl_s, owner=owner)


def session_key(session_id: str, tenant: str | None) -> str:
    """The engine's id of ``tenant``'s session ``session_id``.

    Raises:
        InvalidRequestError: the id is empty or too long (a 400).
    """
    if not 0 < len(session_id) <= MAX_HINT_ID_LEN:
        raise InvalidRequestError(f"retention.session_id must have 1 to {MAX_HINT_ID_LEN} characters")
    key = f"{tenant or ANONYMOUS}/{session_id}"
    if len(key) > MAX_SESSION_ID_LEN:
        raise InvalidRequestError(f"retention: the tenant and session id together exceed "
                                  f"{MAX_SESSION_ID_LEN} characters")
    return key
