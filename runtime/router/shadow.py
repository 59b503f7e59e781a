"""Live quality replay: a share of the baseline's ``/generate`` requests is sent again to
the candidate in the background, and the two answers are compared. The user only ever
gets the baseline's answer. Torch-free.

Per pair (``compare_pair``), with ``runtime.eval.compare`` (the functions ``arbor eval``
uses, so the figures mean the same): identical tokens for a greedy request, the first
divergence, each side's constraint validity (the worker's own check), the length ratio,
and, when the request asked for top logprobs, the mean KL(baseline || candidate) over
the shared positions (up to and including the first divergence: the context is the
same there).

Cost is bounded: jobs wait in a queue of ``queue_cap``; a job that finds it full, or
that finds more than ``max_user_inflight`` user requests in flight, is dropped and
counted. One job runs at a time, so shadow work holds at most one candidate slot.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from runtime.eval.compare import first_divergence, mean_topk_kl, prefix_share
from runtime.router.rollout_plan import ShadowSettings

log = logging.getLogger("arbor.router.shadow")


@dataclass(frozen=True)
class PairComparison:
    greedy: bool  # temperature 0: the two answers should be identical
    exact: bool  # identical output tokens
    first_divergence: int | None  # None: identical, or one a prefix of the other
    prefix_share: float  # of the baseline's tokens before the first difference
    base_valid: bool | None  # the constraint check of each side; None: no constraint (or cut)
    cand_valid: bool | None
    length_ratio: float  # candidate tokens / baseline tokens
    kl: float | None  # mean top-k KL over the shared positions; None: no logprobs on a side
    kl_positions: int


def is_greedy(body: Mapping[str, Any]) -> bool:
    params = body.get("sampling_params") or {}
    return isinstance(params, dict) and params.get("temperature", 1.0) == 0.0


def compare_pair(body: Mapping[str, Any], base: Mapping[str, Any], cand: Mapping[str, Any]) -> PairComparison:
    """Compare two ``/generate`` answers (JSON objects) to the request ``body``."""
    b_ids, c_ids = list(base["output_ids"]), list(cand["output_ids"])
    div = first_divergence(b_ids, c_ids)
    b_meta, c_meta = base.get("meta") or {}, cand.get("meta") or {}
    kl, kl_positions = _kl(b_meta.get("top_logprobs"), c_meta.get("top_logprobs"), div)
    return PairComparison(is_greedy(body), b_ids == c_ids, div, prefix_share(b_ids, c_ids),
                          _valid(b_meta), _valid(c_meta), len(c_ids) / max(len(b_ids), 1), kl, kl_positions)


def _valid(meta: Mapping[str, Any]) -> bool | None:
    check = meta.get("constraint_check")
    return check.get("valid") if isinstance(check, dict) else None


def _kl(base_tops: Any, cand_tops: Any, div: int | None) -> tuple[float | None, int]:
    if not base_tops or not cand_tops:
        return None, 0
    shared = min(len(base_tops), len(cand_tops)) if div is None else div + 1
    b = [{int(t): float(lp) for t, lp in top.items()} for top in base_tops[:shared]]
    c = [{int(t): float(lp) for t, lp in top.items()} for top in cand_tops[:shared]]
    return (mean_topk_kl(b, c), shared) if b else (None, 0)


@dataclass(frozen=True)
class ShadowJob:
    body: dict[str, Any]  # the user's request (sent again with stream off)
    headers: list[tuple[str, str]]
    base_answer: dict[str, Any]


# (the job) -> the candidate's answer, or None when it failed
SendFn = Callable[[ShadowJob], Awaitable[dict[str, Any] | None]]


class ShadowRunner:
    """The bounded queue of shadow jobs and the one task that runs them."""

    def __init__(self, settings: ShadowSettings, send: SendFn, on_pair: Callable[[PairComparison], None],
                 user_inflight: Callable[[], int]) -> None:
        self.settings = settings
        self.send = send
        self.on_pair = on_pair
        self.user_inflight = user_inflight
        self.queue: asyncio.Queue[ShadowJob] = asyncio.Queue(maxsize=settings.queue_cap)
        self.counts: Counter[str] = Counter()  # offered, sent, compared, failed, dropped_full, dropped_load
        self._credit = 0.0
        self._task: asyncio.Task[None] | None = None

    def wants(self) -> bool:
        """Whether the next eligible baseline request is shadowed: exactly ``share`` of them,
        evenly spread (a running credit, not a coin, so a test can count them)."""
        self._credit += self.settings.share
        if self._credit >= 1.0 - 1e-9:
            self._credit -= 1.0
            return True
        return False

    def offer(self, job: ShadowJob) -> bool:
        """Queue ``job`` unless the queue is full or users are waiting; False: dropped."""
        self.counts["offered"] += 1
        if self.user_inflight() > self.settings.max_user_inflight:
            self.counts["dropped_load"] += 1
            return False
        try:
            self.queue.put_nowait(job)
        except asyncio.QueueFull:
            self.counts["dropped_full"] += 1
            return False
        return True

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="arbor-router-shadow")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def drain(self) -> None:
        """Wait until every queued job ran (tests and the benchmark)."""
        await self.queue.join()

    async def _loop(self) -> None:
        while True:
            job = await self.queue.get()
            try:
                await self._run(job)
            finally:
                self.queue.task_done()

    async def _run(self, job: ShadowJob) -> None:
        if self.user_inflight() > self.settings.max_user_inflight:
            self.counts["dropped_load"] += 1  # NOTE: users came first while it waited
            return
        self.counts["sent"] += 1
        answer = None
        with contextlib.suppress(Exception):
            answer = await self.send(job)
        if answer is None or "output_ids" not in answer:
            self.counts["failed"] += 1
            return
        try:
            pair = compare_pair(job.body, job.base_answer, answer)
        except (KeyError, TypeError, ValueError) as exc:
            log.warning("shadow pair not comparable: %s", exc)
            self.counts["failed"] += 1
            return
        self.counts["compared"] += 1
        self.on_pair(pair)
