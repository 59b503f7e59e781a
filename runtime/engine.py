"""The engine: requests in, tokens out. One ``step()`` drives everything.

Offline ``generate``, the async streaming API, the DSL backend and the HTTP server all
submit through ``add_request`` and are served by the same ``step()``, run by one
background thread (started on first use). Callers get ``RequestOutput`` objects through a
per-request callback; ``generate`` waits on them, ``generate_stream`` turns them into an
async iterator.

A step: take new work from the inbox, let the ``OutputProcessor`` draft, let the
``Scheduler`` form the batch, run the ``ModelRunner``, commit the KV, then the
``OutputProcessor`` verifies, samples and emits (``runtime/output_processor.py``).
"""

from __future__ import annotations

import asyncio
import atexit
import itertools
import logging
import threading
import time
import uuid
import weakref
from collections.abc import AsyncIterator
from concurrent.futures import Future
from typing import Any

import torch

from runtime import env
from runtime.cache.kv_cache import KVCache
from runtime.cache.no_prefix_cache import NoPrefixCache
from runtime.cache.page_pool import PagePool
from runtime.cache.prefix_cache import PrefixCache
from runtime.cache.radix_tree import RadixTree
from runtime.config import EngineConfig
from runtime.constrained import GrammarCompiler
from runtime.engine_setup import (
    enable_cpu_kernels,
    freeze_gc,
    resolve_device,
    resolve_dtype,
    size_pool,
    use_prepacked_linears,
)
from runtime.errors import EngineClosedError, InvalidRequestError, PromptTooLongError
from runtime.model.loader import load_model, load_tokenizer, read_config, resolve_model_dir
from runtime.model_runner import ModelRunner
from runtime.output_processor import OutputCallback, OutputProcessor
from runtime.outputs import FinishReason, RequestOutput
from runtime.request import Request
from runtime.sampling_params import SamplingParams
from runtime.scheduler.policy import make_policy
from runtime.scheduler.scheduler import Scheduler

log = logging.getLogger("arbor.engine")
_open_engines: weakref.WeakSet[Engine] = weakref.WeakSet()


@atexit.register
def _close_open_engines() -> None:
    """Close every engine before the interpreter tears down.

    A loop thread still inside a forward pass at interpreter shutdown aborts the process
    ("terminate called without an active exception", exit status 134): seen in 4 of 5 runs
    of a script that exits while a request is running.
    """
    for engine in list(_open_engines):
        engine.close()


class Engine:
    """A Llama-family model on paged KV memory with a radix prefix cache.

    Args:
        model: "default" (the embedded SmolLM2-135M-Instruct), an HF-style directory or a
            ``.gguf`` file.
        **config: any ``EngineConfig`` field (``page_size=16``, ``num_pages=...``).
    """

    def __init__(self, model: str = "default", **config: Any) -> None:
        self.config = EngineConfig.from_kwargs(model=model, **config)
        cfg = self.config
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        self.device = resolve_device(cfg.device)
        self.dtype = resolve_dtype(cfg.dtype, self.device)
        self.model_dir = resolve_model_dir(cfg.model)
        self.tokenizer = load_tokenizer(self.model_dir)
        hf_config = read_config(self.model_dir)
        self.hf_config = hf_config
        self.eos_token_ids = self._eos_ids(hf_config)
        num_pages, self.max_model_len = size_pool(cfg, hf_config, self.device, self.dtype)
        self.model = load_model(self.model_dir, self.device, self.dtype, self.max_model_len)
        if cfg.prepack_weights and use_prepacked_linears(self.device, self.dtype):
            self.model.prepack_linears()
        if self.device.type == "cpu":
            enable_cpu_kernels()
        args = self.model.args
        self.vocab_size = args.vocab_size
        self.pool = PagePool(num_pages, cfg.page_size)
        self.kv = KVCache(args.num_layers, num_pages, cfg.page_size, args.num_kv_heads,
                          args.head_dim, self.dtype, self.device)
        self.cache: PrefixCache = NoPrefixCache(self.pool) if cfg.disable_prefix_cache else RadixTree(self.pool)
        self.scheduler = Scheduler(self.pool, self.cache, make_policy(cfg.schedule_policy),
                                   cfg.max_running_requests, cfg.max_prefill_tokens,
                                   cfg.decode_reserve_tokens,
                                   cfg.chunked_prefill_size or (512 if self.device.type == "cuda" else 16))
        self.runner = ModelRunner(self.model, self.kv, self.device)
        self._generator = torch.Generator().manual_seed(cfg.seed)
        self.outputs = OutputProcessor(
            self.tokenizer, self.scheduler, self.eos_token_ids, self.max_model_len, self._generator,
            self._release, cfg.spec_fixed_cost_rows or (256.0 if self.device.type == "cuda" else 16.0))
        self.spec = self.outputs.spec  # speculation counters over all requests
        self._inbox: list[tuple[str, Any]] = []
        self._cv = threading.Condition()  # guards the inbox; notified on new work
        self._step_lock = threading.Lock()  # held while a step mutates engine state
        self._thread: threading.Thread | None = None
        self._closed = False
        self._debug = cfg.debug or env.debug_enabled()  # integrity checks each step and when idle
        self._ids = itertools.count()
        self.forward_passes = 0
        self._grammar: GrammarCompiler | None = None  # built on the first constraint
        self._grammar_lock = threading.Lock()
        self._pending: dict[str, Future[Any]] = {}  # request id -> grammar still compiling
        _open_engines.add(self)
        if cfg.freeze_gc:  # NOTE: last, so the model and the engine's own state are frozen too
            freeze_gc()

    @property
    def grammar_compiler(self) -> GrammarCompiler:
        """Compiles constraints for this model's tokenizer (off the engine loop, cached)."""
        with self._grammar_lock:
            if self._grammar is None:
                backend = None if self.config.grammar_backend == "auto" else self.config.grammar_backend
                self._grammar = GrammarCompiler(self.tokenizer, self.vocab_size, backend=backend)
            return self._grammar

    def compile_constraint(self, constraint: Any) -> Any:
        """Compile ``constraint`` now (cached). Raises ConstraintError if invalid or unsupported."""
        return self.grammar_compiler.compile(constraint)

    def _eos_ids(self, hf_config: dict[str, Any]) -> list[int]:
        ids: set[int] = set()
        for source in (hf_config.get("eos_token_id"), self.tokenizer.eos_token_id):
            if isinstance(source, int):
                ids.add(source)
            elif isinstance(source, list):
                ids.update(int(i) for i in source)
        return sorted(ids)

    # ---- submission ---------------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | None = None,
        params: SamplingParams | None = None,
        *,
        input_ids: list[int] | None = None,
        request_id: str | None = None,
        callback: OutputCallback | None = None,
    ) -> str:
        """Validate and queue one request; returns its id. Thread-safe.

        Raises:
            InvalidRequestError / PromptTooLongError: for input that can never be served.
            EngineClosedError: after ``close()``.
        """
        if self._closed:
            raise EngineClosedError("the engine is closed")
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        ids = self._prompt_ids(prompt, input_ids)
        self._check_length(ids, params)
        rid = request_id or f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        request = Request(rid, ids, params, arrival=0)
        tracked = self.outputs.track(request, callback)
        future = self._start_grammar(params)
        with self._cv:
            if self._closed:  # NOTE: again under _cv: close() drains the inbox once, after this
                raise EngineClosedError("the engine is closed")
            if rid in self.outputs.tracked:
                raise InvalidRequestError(f"duplicate request id {rid!r}")
            self.outputs.tracked[rid] = tracked
            if future is None:
                self._inbox.append(("add", request))
            else:  # queued once its grammar is compiled, so it never stalls the batch
                self._pending[rid] = future
                future.add_done_callback(lambda _: self._post("grammar_ready", rid))
            self._cv.notify()
        self._ensure_thread()
        return rid

    def _start_grammar(self, params: SamplingParams) -> Future[Any] | None:
        """Start compiling the request's constraint; invalid ones raise here, at once."""
        if params.constraint is None:
            return None
        future = self.grammar_compiler.compile_async(params.constraint)
        if future.done() and future.exception() is not None:
            raise future.exception()  # type: ignore[misc]
        return future

    def _post(self, kind: str, value: Any) -> None:
        with self._cv:
            self._inbox.append((kind, value))
            self._cv.notify()

    def _prompt_ids(self, prompt: str | None, input_ids: list[int] | None) -> list[int]:
        if (prompt is None) == (input_ids is None):
            raise InvalidRequestError("give exactly one of a prompt string or input_ids")
        if prompt is not None:
            if not isinstance(prompt, str):
                raise InvalidRequestError(f"prompt must be a string, got {type(prompt).__name__}")
            ids: list[int] = self.tokenizer(prompt, add_special_tokens=True)["input_ids"]
        else:
            ids = list(input_ids or [])
            if any(not isinstance(t, int) or not 0 <= t < self.vocab_size for t in ids):
                raise InvalidRequestError(f"input_ids must be integers in [0, {self.vocab_size})")
        if not ids:
            raise InvalidRequestError("the prompt is empty")
        return ids

    def _check_length(self, ids: list[int], params: SamplingParams) -> None:
        if len(ids) >= self.max_model_len:
            raise PromptTooLongError(
                f"prompt has {len(ids)} tokens; max_model_len is {self.max_model_len} "
                "(the prompt must leave room for at least one generated token)"
            )

    def abort(self, request_id: str) -> None:
        """Cancel a request; its pages are released on the engine's next step."""
        self._post("abort", request_id)

    # ---- blocking and async fronts --------------------------------------------------------------
    def generate(
        self,
        prompts: str | list[str] | None = None,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        *,
        input_ids: list[int] | list[list[int]] | None = None,
    ) -> list[RequestOutput]:
        """Run a batch of requests to completion; outputs in input order."""
        items = self._batch_inputs(prompts, input_ids)
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(items)
        if len(params) != len(items):
            raise InvalidRequestError("one SamplingParams per prompt, or a single one for all")
        done = threading.Event()
        results: dict[str, RequestOutput] = {}
        lock = threading.Lock()

        def on_output(out: RequestOutput) -> None:
            if out.finished:
                with lock:
                    results[out.request_id] = out
                    if len(results) == len(rids):
                        done.set()

        for p in params:  # constraint errors surface here, before anything decodes
            if p is not None and p.constraint is not None:
                self.compile_constraint(p.constraint)
        rids: list[str] = []
        with self._cv:  # submit all before the loop sees any, so they batch together
            for kind, value in items:
                p = params[len(rids)]
                rids.append(self.add_request(**{kind: value}, params=p, callback=on_output))
        if not rids:
            return []
        try:
            # NOTE: short waits, so a Ctrl-C that the OS gave to another thread (the signal
            # handler runs on the main thread only) is raised here within 0.1 s.
            while not done.wait(0.1):
                pass
        except BaseException:  # Ctrl-C (KeyboardInterrupt) while waiting: stop the work too
            for rid in rids:
                self.abort(rid)
            raise
        return [results[r] for r in rids]

    @staticmethod
    def _batch_inputs(prompts: Any, input_ids: Any) -> list[tuple[str, Any]]:
        if prompts is not None and input_ids is not None:
            raise InvalidRequestError("give prompts or input_ids, not both")
        if prompts is not None:
            items = [prompts] if isinstance(prompts, str) else list(prompts)
            return [("prompt", p) for p in items]
        if input_ids is None:
            raise InvalidRequestError("give prompts or input_ids")
        if input_ids and isinstance(input_ids[0], int):
            return [("input_ids", list(input_ids))]
        return [("input_ids", list(ids)) for ids in input_ids]

    async def generate_stream(
        self,
        prompt: str | None = None,
        sampling_params: SamplingParams | None = None,
        *,
        input_ids: list[int] | None = None,
        request_id: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield a ``RequestOutput`` per step (deltas since the last); the last is final.

        Leaving the iteration early (or cancelling the task) aborts the request.
        """
        loop = asyncio.get_running_loop()
        if sampling_params is not None and sampling_params.constraint is not None:
            # Compile off the event loop; errors reach the caller before decoding.
            await asyncio.wrap_future(self.grammar_compiler.compile_async(sampling_params.constraint))
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        def deliver(out: RequestOutput) -> None:
            if not loop.is_closed():  # the caller may be gone (its loop closed)
                loop.call_soon_threadsafe(queue.put_nowait, out)

        rid = self.add_request(prompt, sampling_params, input_ids=input_ids, request_id=request_id,
                               callback=deliver)
        finished = False
        try:
            while not finished:
                out = await queue.get()
                finished = out.finished
                yield out
        finally:
            if not finished:
                self.abort(rid)

    async def agenerate(
        self,
        prompt: str | None = None,
        sampling_params: SamplingParams | None = None,
        *,
        input_ids: list[int] | None = None,
        request_id: str | None = None,
    ) -> RequestOutput:
        """The final output of one request, awaited."""
        last: RequestOutput | None = None
        async for out in self.generate_stream(prompt, sampling_params, input_ids=input_ids,
                                              request_id=request_id):
            last = out
        assert last is not None
        return last

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """Render ``messages`` with the model's chat template."""
        text: str = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        return text

    # ---- the loop -------------------------------------------------------------------------------
    def _ensure_thread(self) -> None:
        with self._cv:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="arbor-engine", daemon=True)
                self._thread.start()

    def _loop(self) -> None:
        while True:
            if self._debug and self._idle():
                self.check_integrity()  # NOTE: never under _cv: steps take _step_lock, then _cv
            with self._cv:
                while self._idle() and not self._closed:
                    self._cv.wait()
                if self._closed:
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
            for req in list(self.scheduler.running) + list(self.scheduler.waiting):
                self.outputs.finish(req, "abort", error=message)

    def step(self) -> bool:
        """One engine iteration: take new work, schedule, run the model, emit outputs.

        Returns False when nothing could be scheduled.
        """
        with self._step_lock, torch.inference_mode():
            return self._step()

    def _step(self) -> bool:
        self._drain_inbox()
        if self.config.speculation:
            self.outputs.propose_drafts([r for r in self.scheduler.running if r.is_decoding])
        batch = self.scheduler.schedule()
        if batch.empty:
            return False
        try:
            result = self.runner.forward(batch)
        except Exception as exc:  # a bug or device error: fail this batch, keep serving
            log.exception("forward pass failed")
            for req in [i.request for i in batch.prefill] + batch.decode + batch.verify:
                self.outputs.finish(req, "abort", error=f"internal error: {exc}")
            return True
        self.forward_passes += 1
        self.scheduler.commit(batch)
        self.outputs.verify_and_emit(batch.verify, result.verify_logits)
        if self._debug:
            self.scheduler.check_integrity()
        self.outputs.record_prompt_logprobs(result.prompt_logprobs)
        self.outputs.sample_and_emit(result)
        return True

    def _drain_inbox(self) -> None:
        with self._cv:
            inbox, self._inbox = self._inbox, []
            for kind, value in inbox:  # NOTE: under _cv, so wait_idle never sees a gap
                if kind == "add":
                    self.scheduler.add(value)
        for kind, value in inbox:
            if kind == "add":
                continue
            if kind == "grammar_ready":
                self._grammar_ready(value)
            elif value in self.outputs.tracked:
                self.outputs.finish(self.outputs.tracked[value].request, "abort")

    def _grammar_ready(self, rid: str) -> None:
        future = self._pending.get(rid)
        if future is None:  # aborted while compiling
            return
        t = self.outputs.tracked[rid]
        if future.exception() is not None:
            self.outputs.finish(t.request, "abort", error=str(future.exception()))
            return
        t.matcher = future.result().new_matcher()
        self.scheduler.add(t.request)
        del self._pending[rid]  # NOTE: after add, so wait_idle never sees a gap

    def _release(self, req: Request, reason: FinishReason) -> None:
        """Take a finishing request out of the scheduler (or the grammar queue)."""
        if self._pending.pop(req.request_id, None) is not None:  # never reached the scheduler
            req.finish_reason = reason
        else:
            self.scheduler.finish(req, reason)

    # ---- introspection --------------------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        """Counters and gauges of the engine (exported by the server)."""
        s = self.scheduler.stats
        total = self.pool.num_usable_pages
        with self.pool.lock:  # whole page moves only (see PagePool)
            free, evictable = self.pool.num_free_pages, self.cache.num_evictable_pages
            cached = evictable + self.cache.num_locked_pages
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "kv_pages_used": total - free - evictable,
            "kv_pages_total": total,
            "kv_pages_free": free,
            # O(1) counters, not a tree walk: metrics are read from other threads mid-step.
            "kv_pages_cached": cached,
            "cache_hit_rate": s.cache_hit_rate,
            "prompt_tokens": s.prompt_tokens,
            "cached_prompt_tokens": s.cached_prompt_tokens,
            "prefill_tokens": s.prefill_tokens,
            "decode_tokens": s.decode_tokens,
            "num_retractions": s.num_retractions,
            "num_aborts": s.num_aborts,
            "num_finished": self.outputs.num_finished,
            "forward_passes": self.forward_passes,
            "spec_draft_tokens": self.spec.draft_tokens,
            "spec_accepted_tokens": self.spec.accepted_tokens,
            "spec_forced_tokens": self.spec.forced_tokens,
            "spec_verify_rounds": self.spec.verify_rounds,
            "spec_acceptance_rate": self.spec.acceptance_rate,
        }

    def check_integrity(self) -> None:
        """Page-accounting invariants; call when the engine is idle."""
        with self._step_lock:
            self.scheduler.check_integrity()

    def wait_idle(self, timeout: float = 30.0) -> bool:
        """Block until nothing is queued or running (for tests and benchmarks)."""
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
            if self._closed:
                return
            self._closed = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with self._step_lock:  # NOTE: waits for a step that outlived the join
            self._drain_inbox()
            pending = [self.outputs.tracked[rid].request for rid in self._pending]
            for req in [*self.scheduler.running, *self.scheduler.waiting, *pending]:
                self.outputs.finish(req, "abort", error="the engine was closed")
        if self._grammar is not None:
            self._grammar.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
