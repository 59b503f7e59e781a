"""The workers behind the router: their health and their load, as the router sees them.

A worker is healthy while it answers ``GET /health``. The health loop probes every worker
every ``interval_s``; ``failures_to_remove`` failed probes in a row take it out, and a
failed connection on a request takes it out at once. Taking a worker out sets its
``gone`` event, which every request in flight on it waits on beside its own I/O: they end
then (503, or a retry on another worker when nothing reached the client yet) instead of
waiting on a worker that stopped answering. One good probe brings it back, with a new
event and an empty prefix index (a restarted worker has an empty cache).

Single-threaded: everything here runs on the router's event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

import httpx

from runtime.router.config import HealthConfig

log = logging.getLogger("arbor.router")


@dataclass
class Worker:
    """One worker (an ``arbor serve`` URL) and the router's counters for it."""

    index: int
    url: str  # base URL, no trailing slash
    healthy: bool = False  # until the first good probe
    load: int = 0  # requests in flight from this router
    failed_probes: int = 0  # in a row
    gone: asyncio.Event = field(default_factory=asyncio.Event)  # set when taken out
    last_error: str | None = None
    num_removals: int = 0


class WorkerPool:
    """The workers, their health loop, and the hook a policy needs when one goes down."""

    def __init__(self, urls: list[str], health: HealthConfig, on_down: Callable[[int], None]) -> None:
        if not urls:
            raise ValueError("a router needs at least one worker URL")
        self.workers = [Worker(i, u.rstrip("/")) for i, u in enumerate(urls)]
        self.health = health
        self.on_down = on_down
        self._task: asyncio.Task[None] | None = None

    @property
    def loads(self) -> list[int]:
        return [w.load for w in self.workers]

    def candidates(self, exclude: Collection[int] = ()) -> list[int]:
        """Indices of the healthy workers, but ``exclude``."""
        return [w.index for w in self.workers if w.healthy and w.index not in exclude]

    def mark_down(self, worker: Worker, reason: str) -> None:
        if worker.healthy:
            log.warning("worker %s taken out: %s", worker.url, reason)
            worker.num_removals += 1
        worker.healthy, worker.last_error = False, reason
        worker.gone.set()
        self.on_down(worker.index)

    def mark_up(self, worker: Worker) -> None:
        if not worker.healthy:
            log.info("worker %s is healthy", worker.url)
            worker.gone = asyncio.Event()
        worker.healthy, worker.failed_probes, worker.last_error = True, 0, None

    async def probe(self, client: httpx.AsyncClient, worker: Worker) -> None:
        try:
            resp = await client.get(f"{worker.url}/health", timeout=self.health.timeout_s)
            ok, why = resp.status_code == 200, f"/health answered {resp.status_code}"
        except httpx.HTTPError as exc:
            ok, why = False, f"/health failed: {type(exc).__name__}: {exc}"
        if ok:
            self.mark_up(worker)
            return
        worker.failed_probes += 1
        worker.last_error = why
        if worker.failed_probes >= self.health.failures_to_remove or not worker.healthy:
            self.mark_down(worker, why)

    async def probe_all(self, client: httpx.AsyncClient) -> None:
        await asyncio.gather(*(self.probe(client, w) for w in self.workers))

    def start(self, client: httpx.AsyncClient) -> None:
        self._task = asyncio.create_task(self._loop(client), name="arbor-router-health")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _loop(self, client: httpx.AsyncClient) -> None:
        while True:
            started = time.monotonic()
            await self.probe_all(client)
            await asyncio.sleep(max(0.0, self.health.interval_s - (time.monotonic() - started)))
