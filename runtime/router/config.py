"""Router settings: frozen dataclasses, validated at construction (``arbor router`` flags
map 1:1). Importing this loads neither the web stack nor torch (the CLI builds its flags
from it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from runtime.errors import InvalidRequestError

PolicyName = Literal["cache_aware", "round_robin", "least_load", "consistent_hash"]
POLICY_NAMES: tuple[PolicyName, ...] = ("cache_aware", "round_robin", "least_load", "consistent_hash")


@dataclass(frozen=True)
class PolicyConfig:
    """Settings of the routing policies (``arbor router`` flags map 1:1)."""

    policy: PolicyName = "cache_aware"
    # cache_aware: a prefix match must cover this share of the key to count
    cache_threshold: float = 0.5
    balance_abs_threshold: int = 8  # requests in flight above the least loaded worker ...
    balance_rel_threshold: float = 1.5  # ... and this many times its load: overloaded
    index_capacity: int = 1 << 18  # key symbols remembered per worker (~9 MB each; ~65k tokens of text)
    hash_prefix_len: int = 256  # consistent_hash: key symbols hashed
    # the workers' share_prefix_cache_across_tenants: one key namespace for all tenants
    # (else a tenant's prefixes count only for that tenant, as on the workers)
    share_across_tenants: bool = False

    def __post_init__(self) -> None:
        if self.policy not in POLICY_NAMES:
            raise InvalidRequestError(f"policy must be one of {', '.join(POLICY_NAMES)}, got {self.policy!r}")
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise InvalidRequestError(f"cache_threshold must be in [0, 1], got {self.cache_threshold}")
        if self.balance_abs_threshold < 0 or self.balance_rel_threshold < 1.0:
            raise InvalidRequestError("balance_abs_threshold must be >= 0 and balance_rel_threshold >= 1")
        if self.index_capacity < 1 or self.hash_prefix_len < 1:
            raise InvalidRequestError("index_capacity and hash_prefix_len must be positive")


@dataclass(frozen=True)
class HealthConfig:
    interval_s: float = 1.0  # between probes of one worker
    timeout_s: float = 2.0  # a probe slower than this failed
    failures_to_remove: int = 2  # failed probes in a row that take a worker out

    def __post_init__(self) -> None:
        if self.interval_s <= 0 or self.timeout_s <= 0 or self.failures_to_remove < 1:
            raise InvalidRequestError("health interval and timeout must be > 0, failures_to_remove >= 1")
