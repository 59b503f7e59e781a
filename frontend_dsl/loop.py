"""The DSL's event loop: one daemon thread running asyncio for every program and backend.

Program bodies run in ordinary threads (the caller's, or a pool's for ``run_batch``) and
hand nodes to this loop; all backend coroutines run here, so an in-process engine sees
every concurrent request from one loop.
"""

from __future__ import annotations

import asyncio
import threading

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None


def get_loop() -> asyncio.AbstractEventLoop:
    """The running DSL loop, started on first use."""
    global _loop
    with _lock:
        if _loop is None:
            _loop = asyncio.new_event_loop()
            thread = threading.Thread(target=_loop.run_forever, name="arbor-dsl-loop", daemon=True)
            thread.start()
        return _loop
