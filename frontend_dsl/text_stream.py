"""``TextLog``: the text a streamed run produces, for ``state.text_iter()`` while it runs.

The executor's text listener (on the DSL loop) appends every piece of text a stream
gets, tagged with the variable being generated; readers in other threads (or coroutines,
through ``asyncio.to_thread``) iterate from the start, so a late reader misses nothing.
The run closes the log when it ends (with its error, if it failed).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class TextEvent:
    stream_id: int
    var: str | None  # the variable being generated, None for other text
    text: str
    final: bool  # ``var`` is finished


class TextLog:
    """Append-only, thread-safe log of a run's text events."""

    def __init__(self) -> None:
        self._events: list[TextEvent] = []
        self._closed = False
        self._error: BaseException | None = None
        self._changed = threading.Condition()

    def append(self, stream_id: int, var: str | None, text: str, final: bool) -> None:
        with self._changed:
            self._events.append(TextEvent(stream_id, var, text, final))
            self._changed.notify_all()

    def close(self, error: BaseException | None = None) -> None:
        with self._changed:
            self._closed, self._error = True, error
            self._changed.notify_all()

    def _has_news(self, position: int) -> bool:
        return position < len(self._events) or self._closed

    def iter_text(self, stream_id: int, var: str | None) -> Iterator[str]:
        """Pieces of ``stream_id``'s text (only those of ``var``'s generation when
        given, ending when it finishes) as they come; raises the run's error at the end."""
        position = 0
        while True:
            with self._changed:
                self._changed.wait_for(functools.partial(self._has_news, position))
                events, position = self._events[position:], len(self._events)
                closed, error = self._closed, self._error
            for event in events:
                if event.stream_id != stream_id or (var is not None and event.var != var):
                    continue
                if event.text:
                    yield event.text
                if var is not None and event.final:
                    return
            if closed and position == len(self._events):
                if error is not None:
                    raise error
                return
