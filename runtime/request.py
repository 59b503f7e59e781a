"""A request as the engine tracks it, from arrival to finish."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Literal

from runtime.cache.prefix_cache import EMPTY_MATCH, PrefixMatch
from runtime.output.request_output import FinishReason
from runtime.sampling.params import SamplingParams

# Priority classes, best first: under fair scheduling an interactive request is admitted
# (and prefilled) before any batch request, and may take a batch request's running slot.
Priority = Literal["interactive", "batch"]
PRIORITIES: tuple[Priority, ...] = ("interactive", "batch")


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued (new, or retracted and re-queued)
    RUNNING = "running"  # holds pages; prefilling (maybe in chunks) or decoding
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """One generation request.

    Every field has one writer:

    - the engine sets ``request_id``, ``prompt_ids``, ``params``, ``tenant``,
      ``priority`` and ``cache_namespace`` at submission; they never change;
    - the output processor appends to ``output_ids``, sets ``finish_reason`` (once) and
      keeps its per-request state in ``output_state``;
    - the scheduler owns admission and KV: ``arrival``, ``status``, ``prefix``, ``pages``,
      ``num_computed``, ``num_cached_tokens``, ``num_tier_cached_tokens``,
      ``num_retractions``, ``admitted_once``,
      ``num_overtaken``, ``arrival_s``.

    Everyone else only reads. Token bookkeeping (``all_ids = prompt_ids + output_ids``)::

        all_ids:  [ cached prefix | computed by us | not yet computed ]
                  0         prefix.num_tokens    num_computed     len(all_ids)

    While decoding, ``num_computed == len(all_ids) - 1``: the newest sampled token's KV is
    written by the next step.
    """

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    tenant: str | None = None  # who asked (fair share between tenants); None: anonymous
    priority: Priority = "interactive"
    # whose cached prefixes it may reuse, and under which its own are cached (cache/namespace.py)
    cache_namespace: str | None = None
    # ---- the output processor's ----
    output_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    # NOTE: a runtime.output.state.TrackedRequest (the detokenizer, callback, matcher, ...);
    # typed loosely because the request lives in the torch-free core.
    output_state: Any = None
    # ---- the scheduler's ----
    arrival: int = 0  # admission-order tiebreak, numbered by ``Scheduler.add`` (monotonic)
    arrival_s: float = 0.0  # the scheduler's clock at ``Scheduler.add`` (TTFT targets count from it)
    status: RequestStatus = RequestStatus.WAITING
    prefix: PrefixMatch = EMPTY_MATCH  # locked cache prefix while RUNNING
    pages: list[int] = field(default_factory=list)  # page table: prefix pages + own pages
    num_computed: int = 0  # tokens whose KV is in the pool
    num_cached_tokens: int = 0  # prompt tokens served by the cache at first admission
    # NOTE: of num_cached_tokens, those reloaded from a host tier rather than found in the
    # pool; no tier exists yet, so 0 (the pool served them all)
    num_tier_cached_tokens: int = 0
    num_retractions: int = 0
    admitted_once: bool = False
    num_overtaken: int = 0  # later arrivals admitted while this one waited (aging: policy.py)

    @property
    def priority_rank(self) -> int:
        """0 for the best class (``PRIORITIES`` order)."""
        return PRIORITIES.index(self.priority)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def own_pages(self) -> list[int]:
        return self.pages[len(self.prefix.pages) :]

    @property
    def num_remaining(self) -> int:
        """Known tokens whose KV is not computed yet."""
        return self.seq_len - self.num_computed

    @property
    def is_decoding(self) -> bool:
        """Running with only the newest sampled token left to compute."""
        return bool(self.output_ids) and self.num_remaining == 1
