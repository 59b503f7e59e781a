"""Who is asking, and how much they may ask: tenants, priority classes, per-tenant limits.

A request names its tenant with the ``X-Tenant`` header or, on the OpenAI endpoints,
the ``user`` field (the header wins); without either it is anonymous (one shared tenant
for limits). ``X-Priority: interactive | batch`` picks its class (default interactive).
Both go to the engine's fair scheduler (``runtime.scheduler.policy.FairPolicy``). The
tenant and a request's ``cache_salt`` (vLLM's field, on /generate, the OpenAI endpoints
and /v1/responses) also pick its prefix-cache namespace (``runtime.cache.namespace``):
another tenant, or another salt, never reuses its cached prefixes.

Per tenant, the server bounds requests in flight and tokens per minute. Tokens are
limited, not requests (serving practice): a request reserves its prompt plus its
``max_tokens`` from the tenant's bucket at admission, and the unused part comes back when
it ends. The bucket holds one minute's tokens and refills continuously; a request that
does not fit waits for no one: it is answered 429 with ``Retry-After`` (the seconds
until it would fit).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from runtime.cache.namespace import check_cache_salt
from runtime.errors import InvalidRequestError
from runtime.request import PRIORITIES, Priority

TENANT_HEADER = "x-tenant"
PRIORITY_HEADER = "x-priority"
MAX_TENANT_LEN = 128
MAX_IDLE_BUCKETS = 10_000  # beyond: drop the buckets of tenants back at a full minute


@dataclass(frozen=True)
class Caller:
    """A request's tenant (None: anonymous), priority class and cache salt (None: none)."""

    tenant: str | None = None
    priority: Priority = "interactive"
    cache_salt: str | None = None


def tenant_of(headers: Mapping[str, str], user: str | None = None) -> str | None:
    """The tenant a request names: the ``X-Tenant`` header, else the OpenAI ``user``
    field, else None (anonymous). Raises ``InvalidRequestError`` for an unusable name."""
    tenant = headers.get(TENANT_HEADER) or user or None
    if tenant is not None and (len(tenant) > MAX_TENANT_LEN or not tenant.isprintable()):
        raise InvalidRequestError(f"a tenant name is at most {MAX_TENANT_LEN} printable characters")
    return tenant


def caller_of(headers: Mapping[str, str], user: str | None = None, cache_salt: object = None) -> Caller:
    """Tenant and priority of a request, from its headers (and OpenAI ``user`` field), and
    its ``cache_salt`` field (any JSON value: a bad one is a 400 that says why)."""
    priority = headers.get(PRIORITY_HEADER, "interactive").strip().lower()
    if priority not in PRIORITIES:
        raise InvalidRequestError(f"X-Priority must be one of {', '.join(PRIORITIES)}, got {priority!r}")
    try:
        salt = check_cache_salt(cache_salt)
    except ValueError as exc:
        raise InvalidRequestError(str(exc)) from None
    return Caller(tenant_of(headers, user), priority, salt)  # type: ignore[arg-type]


class TenantLimitError(Exception):
    """A tenant is over one of its limits (HTTP 429); ``retry_after`` in seconds."""

    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class _Bucket:
    """A token bucket of ``capacity`` tokens refilled at ``capacity`` per minute."""

    def __init__(self, capacity: int, now: float) -> None:
        self.capacity = capacity
        self.level = float(capacity)
        self.at = now

    def refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.at) * self.capacity / 60.0)
        self.at = now

    def seconds_until(self, tokens: int) -> float:
        return max(0.0, (tokens - self.level) * 60.0 / self.capacity)


class TenantLimiter:
    """Concurrent requests and tokens per minute, per tenant. Only touched from the
    server's event loop thread (plain dicts suffice).

    Args:
        max_concurrent: requests in flight per tenant (None: no limit).
        tokens_per_minute: prompt + generated tokens per tenant per minute (None: no limit).
    """

    def __init__(self, max_concurrent: int | None, tokens_per_minute: int | None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_concurrent = max_concurrent
        self.tokens_per_minute = tokens_per_minute
        self.clock = clock
        self.inflight: dict[str | None, int] = {}
        self.buckets: dict[str | None, _Bucket] = {}

    def acquire(self, tenant: str | None, tokens: int) -> None:
        """Take a slot and reserve ``tokens`` for ``tenant``, or raise.

        Raises:
            InvalidRequestError: ``tokens`` exceed a whole minute's allowance (never fits).
            TenantLimitError: over a limit now; retry after ``retry_after`` seconds.
        """
        name = tenant or "anonymous"
        if self.max_concurrent is not None and self.inflight.get(tenant, 0) >= self.max_concurrent:
            raise TenantLimitError(f"tenant {name!r} has {self.max_concurrent} requests in flight "
                                   "(its limit); retry when one finishes", 1.0)
        bucket = self._bucket(tenant)
        if bucket is not None:
            if tokens > bucket.capacity:
                raise InvalidRequestError(
                    f"the request needs {tokens} tokens (prompt + max_tokens); tenant {name!r} "
                    f"may use at most {bucket.capacity} per minute")
            if tokens > bucket.level:
                wait = bucket.seconds_until(tokens)
                raise TenantLimitError(f"tenant {name!r} is over its {bucket.capacity} tokens per "
                                       f"minute; retry in {math.ceil(wait)} s", wait)
            bucket.level -= tokens
        self.inflight[tenant] = self.inflight.get(tenant, 0) + 1

    def release(self, tenant: str | None, unused_tokens: int = 0) -> None:
        """Give back the slot and the reserved tokens that were not used."""
        left = self.inflight.get(tenant, 0) - 1
        if left > 0:
            self.inflight[tenant] = left
        else:
            self.inflight.pop(tenant, None)
        bucket = self._bucket(tenant)
        if bucket is not None:
            bucket.level = min(bucket.capacity, bucket.level + max(0, unused_tokens))

    def charge(self, tenant: str | None, tokens: int) -> None:
        """Take ``tokens`` used beyond any reservation (a program's generations); the
        bucket may go below zero, so the tenant's next request waits."""
        bucket = self._bucket(tenant)
        if bucket is not None:
            bucket.level -= tokens

    def _bucket(self, tenant: str | None) -> _Bucket | None:
        if self.tokens_per_minute is None:
            return None
        now = self.clock()
        bucket = self.buckets.get(tenant)
        if bucket is None:
            if len(self.buckets) >= MAX_IDLE_BUCKETS:
                self._drop_full_buckets(now)
            bucket = self.buckets[tenant] = _Bucket(self.tokens_per_minute, now)
        bucket.refill(now)
        return bucket

    def _drop_full_buckets(self, now: float) -> None:
        """A full bucket of an idle tenant is the same as none: forget it (bounded memory
        however many tenant names clients invent)."""
        for tenant, bucket in list(self.buckets.items()):
            bucket.refill(now)
            if bucket.level >= bucket.capacity and tenant not in self.inflight:
                del self.buckets[tenant]
