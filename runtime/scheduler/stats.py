"""Counters the scheduler keeps for ``engine.metrics()``."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SchedulerStats:
    prompt_tokens: int = 0  # prompt tokens of admitted requests (first admission only)
    cached_prompt_tokens: int = 0  # of those, served by the prefix cache
    tier_cached_prompt_tokens: int = 0  # of those, reloaded from its second tier (kv_tier.py)
    prefill_tokens: int = 0  # tokens computed in prefill (incl. recomputation)
    decode_tokens: int = 0  # tokens computed in decode steps
    num_retractions: int = 0
    num_aborts: int = 0

    @property
    def cache_hit_rate(self) -> float:
        return self.cached_prompt_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
