"""How long a new request would wait for its first token, from the server's own pace.

Little's law over the queue of requests still waiting for a first token: a newcomer waits
about ``(waiting + 1) / rate``, where ``rate`` is how many waiting requests got their first
token per second of busy time lately (the engine's measured throughput, in requests, not a
guess from the model or the hardware). The admission gate refuses a request whose expected
wait is past the server's bound (``ServerLimits.max_queue_wait_s``) with a 429 at once,
instead of admitting it only to time out in the queue.

Busy time: each first token is charged the time since the previous first token or since
the queue last became non-empty, whichever is later, so a lightly loaded server (first
tokens as slow as arrivals, the queue mostly empty) does not read as a slow one. While
requests wait, the time since the last first token counts too: a server that stops
producing first tokens sees its rate fall and its estimate rise without any new event.
Only the last ``window_s`` seconds count; before any first token in them the pace is
unknown and nothing is refused on it (``max_waiting`` still bounds the queue).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable


class QueueWaitEstimator:
    """First-token events of the last ``window_s`` seconds, each with the busy time it
    took; ``expected_wait`` from them. Only touched from the server's event loop thread.
    """

    def __init__(self, window_s: float = 30.0, clock: Callable[[], float] = time.monotonic) -> None:
        if not window_s > 0:
            raise ValueError(f"window_s must be > 0, got {window_s!r}")
        self.window_s = window_s
        self.clock = clock
        self._events: deque[tuple[float, float]] = deque()  # (time, busy seconds it took), oldest first
        self._busy_since = clock()  # when the queue last became non-empty
        self._last_event = self._busy_since  # the last first token

    def queue_busy(self) -> None:
        """The queue of requests waiting for a first token went from empty to non-empty."""
        self._busy_since = self.clock()

    def first_token(self) -> None:
        """A waiting request got its first token."""
        now = self.clock()
        self._events.append((now, now - self._since()))
        self._last_event = now
        self._forget(now)

    def rate(self, num_waiting: int) -> float | None:
        """First tokens per busy second over the window; None before any in it."""
        now = self.clock()
        self._forget(now)
        if not self._events:
            return None
        busy = sum(took for _, took in self._events)
        if num_waiting > 0:  # the wait so far for the next first token is busy time too
            busy += now - self._since()
        return len(self._events) / max(busy, 1e-3)

    def expected_wait(self, num_waiting: int) -> float | None:
        """Seconds a request arriving now would wait for its first token, behind
        ``num_waiting`` others; 0.0 with nobody waiting, None while the pace is unknown."""
        if num_waiting <= 0:
            return 0.0
        rate = self.rate(num_waiting)
        return None if rate is None else (num_waiting + 1) / rate

    def _since(self) -> float:
        return max(self._last_event, self._busy_since)

    def _forget(self, now: float) -> None:
        while self._events and self._events[0][0] < now - self.window_s:
            self._events.popleft()
