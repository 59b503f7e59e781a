"""Retention: prefixes a live program run (or an HTTP session) will extend are kept.

A request may carry a ``Retention`` hint: the session it belongs to (a DSL program run,
or a caller's own session id) and how long to keep its state after its latest request.
When such a request finishes, the prefix cache pins what it computed for the session,
so the session's next turn (after a tool call, a fork, a user's reply) finds it cached.

Pins are soft: pinned pages still count as evictable (the scheduler may promise them), but
the radix tree evicts them last. Its order (``RadixTree.evict``):

1. leaves released by ended sessions (demoted to the front of the LRU order);
2. unpinned leaves, least recently used first;
3. pinned sessions, earliest deadline first: sessions past their deadline go whole, before
   live ones; a live session inside its budget gives pages only when nothing else is
   left, from its tail, and what the eviction did not need stays pinned.

A session's pins are bounded by a page budget per owner (a tenant, or the run itself): a
pin that would take the owner past it is refused (counted and logged, never an error),
after the owner's expired sessions were dropped. A session that ends releases its pins
at once.

This module keeps the sessions' bookkeeping; the tree counts pins on its nodes.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("arbor.cache")

MAX_SESSION_ID_LEN = 256
ENDED_MEMORY = 4096  # ended sessions remembered, so a straggler of theirs pins nothing


@dataclass(frozen=True)
class Retention:
    """Keep what this request computes for its session's next request.

    ``session_id`` names the session (a DSL program run, or an HTTP caller's session);
    ``ttl_s`` is how long its pins hold (seconds after its latest request) before they are
    evicted ahead of live sessions'; ``owner`` is whose page budget they count against
    (the tenant; for a DSL run, the run itself).
    """

    session_id: str
    ttl_s: float
    owner: str = ""


@dataclass
class RetainedSession:
    """One session's pins (node handles of the cache) and when they expire."""

    session_id: str
    owner: str
    deadline: float  # clock seconds; refreshed by every request of the session
    pins: list[Any] = field(default_factory=list)  # cache nodes; none is another's ancestor


class RetentionTable:
    """Sessions by id, with their owners' and deadlines' views. Torch-free, node-agnostic.

    Args:
        clock: seconds (monotonic); deadlines are on it.
    """

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.sessions: dict[str, RetainedSession] = {}
        self.num_refused = 0  # pins refused: their owner's budget was spent
        self._warned: set[str] = set()  # sessions whose refusal was logged
        # NOTE: a run's last request may finish in the step that drains its end (it was
        # cancelled as the run failed, but finished first): it must not pin anything again.
        self._ended: OrderedDict[str, None] = OrderedDict()

    def session(self, retention: Retention) -> RetainedSession | None:
        """The session of ``retention`` (created if new), its deadline refreshed; None
        once it has ended."""
        if retention.session_id in self._ended:
            return None
        deadline = self.clock() + retention.ttl_s
        s = self.sessions.get(retention.session_id)
        if s is None:
            s = self.sessions[retention.session_id] = RetainedSession(retention.session_id, retention.owner, deadline)
        s.deadline = max(s.deadline, deadline)
        return s

    def of_owner(self, owner: str) -> Iterator[RetainedSession]:
        return (s for s in self.sessions.values() if s.owner == owner)

    def expired(self, owner: str) -> list[RetainedSession]:
        now = self.clock()
        return [s for s in self.of_owner(owner) if s.deadline <= now]

    def pop(self, session_id: str) -> RetainedSession | None:
        self._warned.discard(session_id)
        return self.sessions.pop(session_id, None)

    def restore(self, session: RetainedSession) -> bool:
        """Take back a session popped under memory pressure (its pins are set by the
        caller); False if it ended, or another of its id started, meanwhile."""
        if session.session_id in self._ended or session.session_id in self.sessions:
            return False
        self.sessions[session.session_id] = session
        return True

    def end(self, session_id: str) -> RetainedSession | None:
        """The session ended: forget it, and refuse its later pins."""
        self._ended[session_id] = None
        if len(self._ended) > ENDED_MEMORY:
            self._ended.popitem(last=False)
        return self.pop(session_id)

    def next_victim(self) -> RetainedSession | None:
        """The session whose pins go first under pressure: the earliest deadline."""
        return min(self.sessions.values(), key=lambda s: s.deadline, default=None)

    def refuse(self, session: RetainedSession, pages: int, budget: int) -> None:
        """Count (and log once per session) a pin refused for its owner's budget."""
        self.num_refused += 1
        if session.session_id not in self._warned:
            self._warned.add(session.session_id)
            log.warning("retention: session %r would pin %d pages, over its owner's budget of %d; "
                        "its newest state is not kept (the older pins stay)",
                        session.session_id, pages, budget)
