"""The engine's core: the inbox, the step, and the thread that runs it.

One step reads like the algorithm (``EngineCore.step``)::

    take new work from the inbox (requests, aborts, grammars that finished compiling)
    drafts  = outputs.propose_drafts(scheduler.decoding)     # speculation, if on
    batch   = scheduler.schedule(drafts)                     # admission, pages, chunks
    logits  = runner.forward(batch.forward)                  # plain values in, logits out
    tokens  = outputs.sample(batch, logits)                  # verify drafts / sample
    scheduler.commit(batch, tokens.num_verified)             # KV bookkeeping
    outputs.emit(tokens)                                     # stop checks, callbacks
    settle: finished requests leave the scheduler, then their final outputs go out

Each stage has one owner: the scheduler writes pages and positions (and holds the only
list of live requests), the runner only reads plain values, the output processor writes
tokens and finishes requests. Data flows one way: a request the processor finished is
handed to the scheduler by this core (``_settle``), never by a callback.

Locking: ``_cv`` guards the inbox and submission; ``_step_lock`` is held while a step (or
``close``) changes engine state. A step takes ``_step_lock`` then ``_cv``, never the
reverse.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path

import torch

from runtime import env
from runtime.constrained import CheckedGrammar
from runtime.errors import EngineClosedError, InvalidRequestError
from runtime.model.runner import ModelRunner
from runtime.output.processor import OutputProcessor
from runtime.output.state import OutputCallback
from runtime.request import Request
from runtime.scheduler.batch import ScheduledBatch
from runtime.scheduler.cost_model import StepCostModel, StepShape
from runtime.scheduler.scheduler import Scheduler

StepHook = Callable[[ScheduledBatch], None]

log = logging.getLogger("arbor.engine")
_open_cores: weakref.WeakSet[EngineCore] = weakref.WeakSet()


@atexit.register
def _close_open_cores() -> None:
    """Close every engine before the interpreter tears down.

    A loop thread still inside a forward pass at interpreter shutdown aborts the process
    ("terminate called without an active exception", exit status 134): seen in 4 of 5 runs
    of a script that exits while a request is running.
    """
    for core in list(_open_cores):
        core.close()


class StepTrace:
    """One JSON line per step, appended to a file (``ARBOR_STEP_TRACE``): the time, the
    step's rows, its measured seconds and the cost model's prediction before it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file = path.open("a", buffering=1)  # NOTE: line-buffered: a killed server keeps its lines

    def write(self, shape: StepShape, seconds: float, predicted: float | None) -> None:
        self._file.write(json.dumps({
            "t": round(time.time(), 4), "decode_rows": shape.decode_rows, "prefill_tokens": shape.prefill_tokens,
            "verify_rows": shape.verify_rows, "seconds": round(seconds, 5),
            "predicted": None if predicted is None else round(predicted, 5)}) + "\n")

    def close(self) -> None:
        self._file.close()


class EngineCore:
    """Runs steps on a background thread (started on first use) until closed.

    Args:
        speculation: propose drafts each step (``EngineConfig.speculation``).
        debug: check the page invariants after every step and whenever idle.
        cost_model: learns step times from every step (forward pass and sampling) it runs.
    """

    def __init__(self, scheduler: Scheduler, runner: ModelRunner, outputs: OutputProcessor,
                 speculation: bool, debug: bool, cost_model: StepCostModel | None = None) -> None:
        self.scheduler, self.runner, self.outputs = scheduler, runner, outputs
        self.speculation, self.debug = speculation, debug
        self.cost_model = cost_model or StepCostModel()
        self.forward_passes = 0
        # Called on the engine thread with each batch before its forward pass (tests,
        # tracing). A hook must not change the batch; one that raises fails the batch.
        self.step_hooks: list[StepHook] = []
        trace = env.step_trace_path()
        self.step_trace = StepTrace(trace) if trace is not None else None
        self._inbox: list[tuple[str, Request | str]] = []  # ("add", req) | ("abort"/"grammar_ready", id)
        self._inbox_ids: set[str] = set()  # ids of the requests added in the inbox
        # request id -> (the request, its grammar compiling): not in the scheduler yet
        self._pending: dict[str, tuple[Request, Future[CheckedGrammar]]] = {}
        self._cv = threading.Condition()  # guards the inbox; notified on new work
        self._step_lock = threading.Lock()  # held while a step mutates engine state
        self._thread: threading.Thread | None = None
        self.closed = False
        _open_cores.add(self)

    # ---- submission (any thread) -----------------------------------------------------------
    def submit(self, request: Request, callback: OutputCallback | None,
               grammar: Future[CheckedGrammar] | None) -> None:
        """Queue ``request``; one with a grammar still compiling waits for it outside the
        scheduler, so it never stalls the batch.

        Raises:
            EngineClosedError: after ``close()``.
            InvalidRequestError: a request with the same id is in flight.
        """
        rid = request.request_id
        with self._cv:
            if self.closed:  # NOTE: under _cv: close() drains the inbox once, after this
                raise EngineClosedError("the engine is closed")
            if rid in self._inbox_ids or rid in self._pending or self.scheduler.find(rid) is not None:
                raise InvalidRequestError(f"duplicate request id {rid!r}")
            self.outputs.register(request, callback)
            if grammar is None:
                self._inbox.append(("add", request))
                self._inbox_ids.add(rid)
            else:
                self._pending[rid] = (request, grammar)
                grammar.add_done_callback(lambda _: self._post("grammar_ready", rid))
            self._cv.notify()
        self._ensure_thread()

    @contextlib.contextmanager
    def holding_submissions(self) -> Iterator[None]:
        """Requests submitted inside reach the loop together (so they batch together)."""
        with self._cv:
            yield

    @contextlib.contextmanager
    def between_steps(self) -> Iterator[None]:
        """Hold the loop between two steps: for work that runs the model outside the
        batch (``Engine.score``), so the two never compete for the cores."""
        with self._step_lock:
            yield

    def abort(self, request_id: str) -> None:
        """Cancel a request; its pages are released on the next step."""
        self._post("abort", request_id)

    def release_session(self, session_id: str) -> None:
        """Unpin a retention session's prefixes on the next step."""
        with self._cv:
            if self.closed:  # the loop is gone; the cache goes with the engine
                return
        self._post("release", session_id)
        self._ensure_thread()  # NOTE: a run that generated nothing never started the loop

    def _post(self, kind: str, request_id: str) -> None:
        with self._cv:
            self._inbox.append((kind, request_id))
            self._cv.notify()

    # ---- the loop ----------------------------------------------------------------------------
    def _ensure_thread(self) -> None:
        with self._cv:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="arbor-engine", daemon=True)
                self._thread.start()

    def _loop(self) -> None:
        while True:
            if self.debug and self._idle():
                self.check_integrity()  # NOTE: never under _cv: steps take _step_lock, then _cv
            with self._cv:
                while self._idle() and not self.closed:
                    self._cv.wait()
                if self.closed:
                    return
            try:
                progressed = self.step()
            except Exception:  # a bug must not kill the loop and strand every caller
                log.exception("engine step failed; failing the requests in flight")
                self._fail_all("internal error in the engine step")
                continue
            if not progressed:  # work exists but none can run yet: don't spin
                with self._cv:
                    self._cv.wait(timeout=0.01)

    def _idle(self) -> bool:
        return not self._inbox and not self.scheduler.has_work

    def _fail_all(self, message: str) -> None:
        with self._step_lock:
            for req in [*self.scheduler.running, *self.scheduler.waiting]:
                self.outputs.finish(req, "abort", error=message)
            self._settle()

    # ---- one step ----------------------------------------------------------------------------
    def step(self) -> bool:
        """One iteration (see the module docstring). False when nothing could run."""
        with self._step_lock, torch.inference_mode():
            self._drain_inbox()
            drafts = self.outputs.propose_drafts(self.scheduler.decoding) if self.speculation else {}
            batch = self.scheduler.schedule(drafts)
            if batch.empty:
                return False
            try:
                for hook in list(self.step_hooks):
                    hook(batch)
                started = time.perf_counter()
                logits = self.runner.forward(batch.forward)
            except Exception as exc:  # a bug or device error: fail this batch, keep serving
                log.exception("forward pass failed")
                for req in [i.request for i in batch.prefill] + batch.decode + [v.request for v in batch.verify]:
                    self.outputs.finish(req, "abort", error=f"internal error: {exc}")
                self._settle()
                return True
            self.forward_passes += 1
            tokens = self.outputs.sample(batch, logits)
            seconds = time.perf_counter() - started
            if self.step_trace is not None:
                self.step_trace.write(batch.shape, seconds, self.cost_model.predict(batch.shape))
            self.cost_model.observe(batch.shape, seconds)
            self.scheduler.commit(batch, tokens.num_verified)
            if self.debug:
                self.scheduler.check_integrity()
            self.outputs.emit(tokens)
            self._settle()
            return True

    def _settle(self) -> None:
        """Finished requests leave the scheduler (or the grammar queue), their pages go
        back, and only then do their final outputs reach the callers."""
        finals = self.outputs.take_finals()
        for final in finals:
            req = final.request
            if self._pending.pop(req.request_id, None) is None:  # else it never reached the scheduler
                self.scheduler.finish(req, aborted=req.finish_reason == "abort")
        self.outputs.send_finals(finals)

    def _drain_inbox(self) -> None:
        with self._cv:
            inbox, self._inbox = self._inbox, []
            self._inbox_ids.clear()
            for kind, value in inbox:  # NOTE: under _cv, so wait_idle never sees a gap
                if kind == "add":
                    assert isinstance(value, Request)
                    self.scheduler.add(value)
        for kind, value in inbox:
            if kind == "grammar_ready":
                assert isinstance(value, str)
                self._grammar_ready(value)
            elif kind == "abort" and (req := self._find(str(value))) is not None:
                self.outputs.finish(req, "abort")
            elif kind == "release":
                self.scheduler.cache.release(str(value))
        self._settle()

    def _find(self, rid: str) -> Request | None:
        """The live request with this id: scheduled, or waiting for its grammar."""
        pending = self._pending.get(rid)
        return pending[0] if pending is not None else self.scheduler.find(rid)

    def _grammar_ready(self, rid: str) -> None:
        if (pending := self._pending.get(rid)) is None:  # aborted while compiling
            return
        req, future = pending
        if (exc := future.exception()) is not None:
            self.outputs.finish(req, "abort", error=str(exc))
            return
        self.outputs.attach_grammar(req, future.result())
        self.scheduler.add(req)
        del self._pending[rid]  # NOTE: after add, so wait_idle never sees a gap

    # ---- state ---------------------------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        """Counters and gauges (exported by the server). O(1) counters, never a tree walk:
        other threads read them mid-step."""
        sched, spec, tier = self.scheduler, self.outputs.spec, self.scheduler.cache.tier
        total = sched.pool.num_usable_pages
        with sched.pool.lock:  # whole page moves only (see PagePool)
            free, evictable = sched.pool.num_free_pages, sched.cache.num_evictable_pages
            cached = evictable + sched.cache.num_locked_pages
            retained = sched.cache.num_retained_pages
        s = sched.stats
        return {
            "num_running": len(sched.running), "num_waiting": len(sched.waiting),
            "kv_pages_used": total - free - evictable, "kv_pages_total": total,
            "kv_pages_free": free, "kv_pages_cached": cached, "kv_pages_retained": retained,
            "kv_pages_touched": sched.pool.num_touched_pages,
            "retention_pins_refused": sched.cache.num_refused_pins,
            "cache_hit_rate": s.cache_hit_rate, "prompt_tokens": s.prompt_tokens,
            "cached_prompt_tokens": s.cached_prompt_tokens, "prefill_tokens": s.prefill_tokens,
            "tier_cached_prompt_tokens": s.tier_cached_prompt_tokens, "kv_tier_pages": tier.num_pages,
            "kv_tier_stored_pages": tier.stats.stored_pages, "kv_tier_dropped_pages": tier.stats.dropped_pages,
            "kv_tier_corrupt_pages": tier.stats.corrupt_pages,
            "decode_tokens": s.decode_tokens, "num_retractions": s.num_retractions,
            "num_aborts": s.num_aborts, "num_finished": self.outputs.num_finished,
            "forward_passes": self.forward_passes,
            "spec_draft_tokens": spec.draft_tokens, "spec_accepted_tokens": spec.accepted_tokens,
            "spec_forced_tokens": spec.forced_tokens, "spec_verify_rounds": spec.verify_rounds,
            "spec_acceptance_rate": spec.acceptance_rate,
            "constraint_outputs_checked": self.outputs.checks.num_checked,
            "constraint_outputs_invalid": self.outputs.checks.num_invalid,
        }

    def check_integrity(self) -> None:
        """Page-accounting invariants; call when idle."""
        with self._step_lock:
            self.scheduler.check_integrity()

    def wait_idle(self, timeout: float) -> bool:
        """Block until nothing is queued, compiling or running."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._cv:
                if self._idle() and not self._pending:
                    return True
            time.sleep(0.005)
        return False

    def close(self) -> None:
        """Stop the loop after its current step; requests still in flight end as aborted
        with an error, so no caller waits for them forever. Idempotent."""
        with self._cv:
            if self.closed:
                return
            self.closed = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with self._step_lock:  # NOTE: waits for a step that outlived the join
            self._drain_inbox()
            pending = [req for req, _ in self._pending.values()]
            for req in [*self.scheduler.running, *self.scheduler.waiting, *pending]:
                self.outputs.finish(req, "abort", error="the engine was closed")
            self._settle()
            if self.step_trace is not None:
                self.step_trace.close()
