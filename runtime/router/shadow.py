"""Live quality replay: a share of the baseline's non-streamed ``/generate``,
``/v1/completions`` and ``/v1/chat/completions`` requests is sent again to the candidate
in the background, and the two answers are compared (on token ids where the answer
carries them, else token texts, else characters: ``shadow_answers``). The user only ever
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
from collections.abc import Awaitable, Callable, Hashable, Mapping
from dataclasses import dataclass
from typing import Any

from runtime.eval.compare import first_divergence, mean_topk_kl, prefix_share
from runtime.router.rollout_plan import ShadowSettings
from runtime.router.shadow_answers import answer_tokens, is_greedy

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
    unit: str  # what was compared: "ids", "tokens" (token texts) or "text" (characters)


def compare_pair(body: Mapping[str, Any], base: Mapping[str, Any], cand: Mapping[str, Any],
                 path: str = "/generate") -> PairComparison:
    """Compare two answers (JSON objects) to the request ``body`` on ``path``."""
    b, c = answer_tokens(path, base), answer_tokens(path, cand)
    unit, b_toks, c_toks = b.unit, b.tokens, c.tokens
    b_tops, c_tops = b.tops, c.tops
    if b.unit != c.unit:  # NOTE: the same request: only a misconfigured worker answers otherwise
        unit, b_toks, c_toks, b_tops, c_tops = "text", list(b.text), list(c.text), None, None
    div = first_divergence(b_toks, c_toks)
    kl, kl_positions = _kl(b_tops, c_tops, div)
    return PairComparison(is_greedy(path, body), b_toks == c_toks, div, prefix_share(b_toks, c_toks),
                          b.valid, c.valid, len(c_toks) / max(len(b_toks), 1), kl, kl_positions, unit)


def _kl(base_tops: list[dict[Hashable, float]] | None, cand_tops: list[dict[Hashable, float]] | None,
        div: int | None) -> tuple[float | None, int]:
    if not base_tops or not cand_tops:
        return None, 0
    shared = min(len(base_tops), len(cand_tops)) if div is None else min(div + 1, len(base_tops), len(cand_tops))
    return (mean_topk_kl(base_tops[:shared], cand_tops[:shared]), shared) if shared else (None, 0)


@dataclass(frozen=True)
class ShadowJob:
    path: str  # the route ("/generate", "/v1/completions", "/v1/chat/completions")
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
        if answer is None:
            self.counts["failed"] += 1
            return
        try:
            pair = compare_pair(job.body, job.base_answer, answer, job.path)
        except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
            log.warning("shadow pair not comparable: %s", exc)
            self.counts["failed"] += 1
            return
        self.counts["compared"] += 1
        self.on_pair(pair)
