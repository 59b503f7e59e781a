"""The engine: requests in, tokens out. One ``step()`` drives everything.

Offline ``generate``, the async streaming API, the DSL backend and the HTTP server all
submit through ``add_request`` and are served by the same ``step()``, run by one
background thread (started on first use). Callers get ``RequestOutput`` objects through a
per-request callback; ``generate`` waits on them, ``generate_stream`` turns them into an
async iterator.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
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
from runtime.detokenizer import IncrementalDetokenizer
from runtime.engine_setup import (
    enable_cpu_kernels,
    freeze_gc,
    resolve_device,
    resolve_dtype,
    size_pool,
    use_prepacked_linears,
)
from runtime.errors import EngineClosedError, InvalidRequestError, PromptTooLongError
from runtime.grammar_step import mask_logits
from runtime.model.loader import load_model, load_tokenizer, read_config, resolve_model_dir
from runtime.model_runner import ModelRunner
from runtime.outputs import FinishReason, RequestOutput
from runtime.request import Request
from runtime.sampler import sample
from runtime.sampling_params import SamplingParams
from runtime.scheduler.policy import make_policy
from runtime.scheduler.scheduler import Scheduler
from runtime.speculative import DraftProposer, SpecStats, lookup_break_even, verify_drafts

log = logging.getLogger("arbor.engine")
OutputCallback = Callable[[RequestOutput], None]


@dataclass(eq=False)
class _Tracked:
    """Engine-side companions of a request: its detokenizer, callback, generator."""

    request: Request
    detok: IncrementalDetokenizer
    callback: OutputCallback | None
    generator: torch.Generator | None
    logprobs: list[float]
    top_logprobs: list[dict[int, float]]
    emitted_tokens: int = 0
    matcher: Any = None  # runtime.constrained GrammarMatcher when constrained
    spec: SpecStats = field(default_factory=SpecStats)
    drafts_from_lookup: bool = False  # this step's drafts came from prompt lookup
    prompt_text: str | None = None  # decoded once, for text-level prompt lookup


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
        self._tracked: dict[str, _Tracked] = {}
        self._inbox: list[tuple[str, Any]] = []
        self._cv = threading.Condition()  # guards the inbox; notified on new work
        self._step_lock = threading.Lock()  # held while a step mutates engine state
        self._thread: threading.Thread | None = None
        self._closed = False
        self._debug = cfg.debug or env.debug_enabled()  # integrity checks each step and when idle
        self._ids = itertools.count()
        self.forward_passes = 0
        self.num_finished = 0
        self.proposer = DraftProposer(self.tokenizer)
        self.spec = SpecStats()  # global speculation counters
        self._spec_fixed_cost_rows = cfg.spec_fixed_cost_rows or (256.0 if self.device.type == "cuda" else 16.0)
        self._grammar: GrammarCompiler | None = None  # built on the first constraint
        self._grammar_lock = threading.Lock()
        self._pending: dict[str, Future[Any]] = {}  # request id -> grammar still compiling
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
        tracked = _Tracked(
            request,
            IncrementalDetokenizer(self.tokenizer, params.stop, params.skip_special_tokens),
            callback,
            torch.Generator().manual_seed(params.seed) if params.seed is not None else None,
            [], [],
        )
        future = self._start_grammar(params)
        with self._cv:
            if rid in self._tracked:
                raise InvalidRequestError(f"duplicate request id {rid!r}")
            self._tracked[rid] = tracked
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
        done.wait()
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
                self._finish(req, "abort", error=message)

    def step(self) -> bool:
        """One engine iteration: take new work, schedule, run the model, emit outputs.

        Returns False when nothing could be scheduled.
        """
        with self._step_lock, torch.inference_mode():
            return self._step()

    def _step(self) -> bool:
        self._drain_inbox()
        if self.config.speculation:
            self._propose_drafts()
        batch = self.scheduler.schedule()
        if batch.empty:
            return False
        try:
            result = self.runner.forward(batch)
        except Exception as exc:  # a bug or device error: fail this batch, keep serving
            log.exception("forward pass failed")
            for req in [i.request for i in batch.prefill] + batch.decode + batch.verify:
                self._finish(req, "abort", error=f"internal error: {exc}")
            return True
        self.forward_passes += 1
        self.scheduler.commit(batch)
        self._verify_and_emit(batch.verify, result.verify_logits)
        if self._debug:
            self.scheduler.check_integrity()
        self._record_prompt_logprobs(result.prompt_logprobs)
        self._sample_and_emit(result)
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
            elif value in self._tracked:
                self._finish(self._tracked[value].request, "abort")

    def _propose_drafts(self) -> None:
        """Draft tokens for every decoding request that allows speculation."""
        decoding = [r for r in self.scheduler.running if r.is_decoding]
        batch_even = lookup_break_even(len(decoding), self._spec_fixed_cost_rows)
        alone_even = lookup_break_even(1, self._spec_fixed_cost_rows)
        for req in decoding:
            if not req.params.speculation:
                continue
            t = self._tracked[req.request_id]
            room = min(req.params.max_new_tokens - len(req.output_ids), self.max_model_len - req.seq_len) - 1
            if room <= 0:
                continue
            if t.prompt_text is None:
                t.prompt_text = self.tokenizer.decode(req.prompt_ids)
            texts = (t.prompt_text, t.detok.text)
            # NOTE: only greedy requests follow the batch size: a sampled request's random
            # draws depend on whether it drafted, and a seeded request must give the same
            # tokens alone and inside any batch, so it is judged as if alone.
            gate = batch_even if req.params.greedy else alone_even
            drafts, forced = self.proposer.propose(req.all_ids, t.matcher, t.spec, room, texts, gate)
            req.draft_ids = drafts
            t.drafts_from_lookup = bool(drafts) and not forced
            if t.drafts_from_lookup:
                t.spec.lookup_rounds += 1
                t.spec.lookup_draft_tokens += len(drafts)
            t.spec.forced_tokens += forced
            self.spec.forced_tokens += forced

    def _verify_and_emit(self, reqs: list[Request], logits: dict[str, torch.Tensor]) -> None:
        """Accept drafts exactly (see runtime.speculative.verify), then emit the tokens."""
        for req in reqs:
            t = self._tracked[req.request_id]
            drafts = req.draft_ids
            rows = logits[req.request_id]
            stop_ids = set(req.params.stop_token_ids) | set(self.eos_token_ids)
            tokens, accepted = verify_drafts(rows, drafts, req.params, t.matcher,
                                             t.generator or self._generator, stop_ids)
            self.scheduler.commit_verify(req, len(tokens))
            self._count_spec(t, len(drafts), accepted, from_lookup=t.drafts_from_lookup)
            if not tokens:
                self._finish(req, "abort", error="the grammar admits no further token")
                continue
            logprobs = self._logprobs_of(req.params, rows[: len(tokens)], tokens)
            for j, token in enumerate(tokens):
                if logprobs is not None:
                    chosen, top = logprobs
                    if req.params.logprobs:
                        t.logprobs.append(chosen[j])
                    if top is not None:
                        t.top_logprobs.append(top[j])
                # NOTE: the matcher already advanced past *all* tokens, so its
                # "terminated" state only speaks for the last one.
                self._append_token(req, t, token, matcher_advanced=True, last=j == len(tokens) - 1)
                if req.finish_reason is not None:
                    break

    def _count_spec(self, t: _Tracked, drafted: int, accepted: int, from_lookup: bool) -> None:
        for stats in (t.spec, self.spec):
            stats.draft_tokens += drafted
            stats.accepted_tokens += accepted
            stats.verify_rounds += 1
        if from_lookup:
            t.spec.lookup_accepted_tokens += accepted

    @staticmethod
    def _logprobs_of(
        params: SamplingParams, rows: torch.Tensor, tokens: list[int]
    ) -> tuple[list[float], list[dict[int, float]] | None] | None:
        """(logprob of each token, top-k dicts) from verify rows, when asked for."""
        if not params.logprobs and not params.top_logprobs:
            return None
        logp = torch.log_softmax(rows.float(), dim=-1)
        picked = logp[torch.arange(len(tokens)), torch.tensor(tokens)].tolist()
        top = None
        if params.top_logprobs:
            vals, idx = logp.topk(params.top_logprobs, dim=-1)
            top = [dict(zip(i, v, strict=True)) for i, v in zip(idx.tolist(), vals.tolist(), strict=True)]
        return picked, top

    def _grammar_ready(self, rid: str) -> None:
        future = self._pending.get(rid)
        if future is None:  # aborted while compiling
            return
        t = self._tracked[rid]
        if future.exception() is not None:
            self._finish(t.request, "abort", error=str(future.exception()))
            return
        t.matcher = future.result().new_matcher()
        self.scheduler.add(t.request)
        del self._pending[rid]  # NOTE: after add, so wait_idle never sees a gap

    def _record_prompt_logprobs(self, found: dict[str, list[tuple[int, float]]]) -> None:
        for rid, pairs in found.items():
            req = self._tracked[rid].request
            if not req.prompt_logprobs:
                req.prompt_logprobs = [None] * len(req.prompt_ids)
            for pos, lp in pairs:
                req.prompt_logprobs[pos] = lp

    def _sample_and_emit(self, result: Any) -> None:
        reqs: list[Request] = result.sample_requests
        if not reqs:
            return
        tracked = [self._tracked[r.request_id] for r in reqs]
        dead = set(mask_logits(result.logits, [t.matcher for t in tracked]))
        out = sample(result.logits, [r.params for r in reqs], [t.generator for t in tracked], self._generator)
        for i, (req, t) in enumerate(zip(reqs, tracked, strict=True)):
            if req.params.max_new_tokens == 0:
                self._finish(req, "length")
                continue
            if i in dead:
                self._finish(req, "abort", error="the grammar admits no further token")
                continue
            token = out.token_ids[i]
            if out.logprobs is not None and req.params.logprobs:
                t.logprobs.append(out.logprobs[i])
            if out.top_logprobs is not None and req.params.top_logprobs:
                top = out.top_logprobs[i]
                t.top_logprobs.append(dict(list(top.items())[: req.params.top_logprobs]))
            self._append_token(req, t, token)

    def _append_token(
        self, req: Request, t: _Tracked, token: int, matcher_advanced: bool = False, last: bool = True
    ) -> None:
        params = req.params
        if t.matcher is not None and not matcher_advanced and not t.matcher.accept_token(token):
            self._finish(req, "abort", error=f"token {token} rejected by the grammar")
            return
        if t.matcher is not None and (problem := t.matcher.error()):
            self._finish(req, "abort", error=f"grammar error: {problem}")
            return
        ignore_eos = params.ignore_eos and t.matcher is None  # a grammar decides where EOS goes
        if token in params.stop_token_ids or (token in self.eos_token_ids and not ignore_eos):
            if t.logprobs and len(t.logprobs) > len(req.output_ids):
                t.logprobs.pop()
            if t.top_logprobs and len(t.top_logprobs) > len(req.output_ids):
                t.top_logprobs.pop()
            self._finish(req, "stop")
            return
        req.output_ids.append(token)
        t.detok.add(req.output_ids)
        if t.detok.stopped or (last and t.matcher is not None and t.matcher.is_terminated()):
            self._finish(req, "stop")
        elif len(req.output_ids) >= params.max_new_tokens or req.seq_len >= self.max_model_len:
            self._finish(req, "length")
        else:
            self._emit(t)

    def _finish(self, req: Request, reason: FinishReason, error: str | None = None) -> None:
        if req.finish_reason is not None:
            return
        if self._pending.pop(req.request_id, None) is not None:  # never reached the scheduler
            req.finish_reason = reason
        else:
            self.scheduler.finish(req, reason)
        t = self._tracked.pop(req.request_id)
        if reason != "stop" or not t.detok.stopped:
            t.detok.finish(req.output_ids)
        self.num_finished += 1
        self._emit(t, error=error)

    def _emit(self, t: _Tracked, error: str | None = None) -> None:
        req = t.request
        final = req.finish_reason is not None
        delta = t.detok.take(final)
        out = RequestOutput(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_ids,
            token_ids=list(req.output_ids),
            text=t.detok.text[: t.detok.emitted],
            finish_reason=req.finish_reason,
            logprobs=list(t.logprobs) if req.params.logprobs else None,
            top_logprobs=list(t.top_logprobs) if req.params.top_logprobs else None,
            prompt_logprobs=(req.prompt_logprobs or [None] * len(req.prompt_ids)) if req.params.prompt_logprobs else None,
            num_cached_tokens=req.num_cached_tokens,
            delta_text=delta,
            delta_token_ids=req.output_ids[t.emitted_tokens :],
            error=error,
        )
        t.emitted_tokens = len(req.output_ids)
        if t.callback is not None:
            try:
                t.callback(out)
            except Exception:  # a caller's callback must never take the engine down
                log.exception("output callback failed for %s", req.request_id)

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
            "num_finished": self.num_finished,
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
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._grammar is not None:
            self._grammar.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
