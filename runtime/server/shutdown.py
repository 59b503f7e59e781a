"""Graceful shutdown: SIGTERM (or Ctrl-C) stops admission at once, lets the requests in
flight finish within a deadline, aborts the rest, and the process exits 0.

In order: the admission gate answers 503 to new requests (``closing``); uvicorn stops
listening and waits for the requests in flight; at ``deadline_s``
(``ServerLimits.shutdown_timeout_s``) the engine is closed, which ends every request still
in flight as aborted with an error ("the engine was closed": a stream gets it as its last
event, a plain request as a 503), so every connection ends with a clean answer; uvicorn's
own cancellation (``timeout_graceful_shutdown``, a few seconds later) is only a backstop.
NOTE: plain uvicorn re-raises the signal after its own shutdown, which ends the process
with status -15 instead of 0.
"""

from __future__ import annotations

import asyncio
import signal
import socket
from types import FrameType

import uvicorn

from runtime.engine import Engine
from runtime.server.limits import AdmissionGate

BACKSTOP_S = 5.0  # after the deadline, uvicorn cancels whatever still runs


class GracefulServer(uvicorn.Server):
    def __init__(self, app: object, gate: AdmissionGate, engine: Engine, deadline_s: float,
                 **uvicorn_config: object) -> None:
        super().__init__(uvicorn.Config(app, timeout_graceful_shutdown=deadline_s + BACKSTOP_S,  # type: ignore[arg-type]
                                        **uvicorn_config))  # type: ignore[arg-type]
        self.gate, self.engine, self.deadline_s = gate, engine, deadline_s

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.gate.closing = True
        loop = asyncio.get_running_loop()
        timer = loop.call_later(self.deadline_s, lambda: loop.run_in_executor(None, self.engine.close))
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.gate.closing = True
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True  # a second Ctrl-C: stop waiting
        self.should_exit = True
