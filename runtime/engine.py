"""The engine: requests in, tokens out.

``Engine`` is the front: it builds the parts (model, KV pool, prefix cache, scheduler,
model runner, output processor), validates and submits requests, and offers the
blocking (``generate``) and async streaming (``generate_stream``) fronts. Offline use,
the DSL backend and the HTTP server all submit through ``add_request``; one background
thread runs ``EngineCore.step`` (``runtime/engine_core.py``) for all of them. Callers get
``RequestOutput`` objects through a per-request callback.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from typing import Any

import jinja2
import torch

from runtime import env
from runtime.cache.kv_tier import NoTier
from runtime.cache.namespace import cache_namespace, check_cache_salt
from runtime.cache.no_prefix_cache import NoPrefixCache
from runtime.cache.page_pool import PagePool
from runtime.cache.prefix_cache import PrefixCache
from runtime.cache.radix_tree import RadixTree
from runtime.config import EngineConfig
from runtime.constrained import CheckedGrammar, GrammarCompiler
from runtime.distributed.tensor_parallel import BroadcastingRunner, LeaderGroup, with_rendezvous
from runtime.engine_core import EngineCore, StepHook
from runtime.engine_setup import (
    freeze_gc,
    fused_decode,
    load_engine_model,
    on_own_thread,
    prefix_cache_max_pages,
)
from runtime.errors import EngineFailedError, InvalidRequestError, PromptTooLongError, check_unicode
from runtime.model.disk_tier import make_tier
from runtime.model.kv_cache import KVCache
from runtime.model.loader import eos_token_ids
from runtime.model.pooling import POOLINGS, Pooling, model_pooling
from runtime.model.runner import ModelRunner
from runtime.model.scorer import Scorer
from runtime.output.processor import OutputProcessor
from runtime.output.request_output import RequestOutput, final_output
from runtime.output.state import OutputCallback
from runtime.request import PRIORITIES, Priority, Request
from runtime.sampling.params import SamplingParams
from runtime.scheduler.budget import prefill_budget
from runtime.scheduler.cost_model import StepCostModel
from runtime.scheduler.policy import make_policy
from runtime.scheduler.scheduler import Scheduler


class Engine:
    """A Llama-family model on paged KV memory with a radix prefix cache.

    Args:
        model: "default" (the embedded SmolLM2-135M-Instruct), an HF-style directory or a
            ``.gguf`` file.
        **config: any ``EngineConfig`` field (``page_size=16``, ``num_pages=...``).
    """

    def __init__(self, model: str = "default", **config: Any) -> None:
        requested = EngineConfig.from_kwargs(model=model, **config)
        self._tp: LeaderGroup | None = None
        if requested.tensor_parallel_size > 1:
            if requested.node_rank != 0:
                raise InvalidRequestError("node_rank > 0 runs tensor-parallel ranks only "
                                          "(`arbor serve --node-rank k`), not an engine")
            requested = with_rendezvous(requested)
            self._tp = LeaderGroup(requested)  # NOTE: the other ranks load while we do
        try:
            loaded = on_own_thread(lambda: load_engine_model(requested))  # NOTE: see on_own_thread
        except BaseException:
            if self._tp is not None:
                self._tp.close()
            raise
        self.config = cfg = loaded.config  # device-dependent defaults filled in
        self.device, self.dtype, self.model_dir = loaded.device, loaded.dtype, loaded.model_dir
        self.tokenizer, self.model, self.max_model_len = loaded.tokenizer, loaded.model, loaded.max_model_len
        args, num_pages = self.model.args, loaded.num_pages
        self.vocab_size = args.vocab_size
        self.pool = PagePool(num_pages, cfg.page_size)
        self.kv = KVCache(args.num_layers, num_pages, cfg.page_size, args.num_kv_heads,
                          args.head_dim, loaded.kv_dtype, self.device)
        self.tier = NoTier() if cfg.disable_prefix_cache else make_tier(
            self.kv, cfg.kv_tier_dir, cfg.kv_tier_max_bytes, cfg.kv_tier_int8)
        self.cache: PrefixCache = NoPrefixCache(self.pool) if cfg.disable_prefix_cache else RadixTree(
            self.pool, prefix_cache_max_pages(cfg, self.device, loaded.memory.kv_bytes_per_token),
            retention_max_pages=cfg.retention_max_pages, tier=self.tier)
        assert cfg.chunked_prefill_size is not None and cfg.spec_fixed_cost_rows is not None
        self.cost_model = StepCostModel()  # step times, learnt online (speculation gate)
        self.scheduler = Scheduler(self.pool, self.cache, make_policy(cfg.schedule_policy, cfg.fair_scheduling,
                                                                      cfg.lpm_max_overtakes),
                                   cfg.max_running_requests, cfg.max_prefill_tokens,
                                   cfg.decode_reserve_tokens, cfg.chunked_prefill_size,
                                   prefill_budget(cfg, self.cost_model), window=args.kv_window)
        self.runner = ModelRunner(self.model, self.kv, self.device, fused_decode(cfg, self.model, self.kv, self.device),
                                  cfg.invariant_attention)
        self._scorer = Scorer(self.model, loaded.kv_dtype, cfg.page_size, self.device)
        if self._tp is not None:
            self._tp.send({"num_pages": num_pages})  # each rank's KV pool: the same page ids
            self.runner = BroadcastingRunner(self.model, self.kv, self.device, self._tp)
        self.eos_token_ids = eos_token_ids(loaded.hf_config, self.tokenizer.eos_token_id)
        self.outputs = OutputProcessor(self.tokenizer, self.eos_token_ids, self.max_model_len,
                                       torch.Generator().manual_seed(cfg.seed), cfg.spec_fixed_cost_rows,
                                       self.cost_model)
        self.spec = self.outputs.spec  # speculation counters over all requests
        self._core = EngineCore(self.scheduler, self.runner, self.outputs, cfg.speculation,
                                debug=cfg.debug or env.debug_enabled(), cost_model=self.cost_model)
        self._ids = itertools.count()
        self._grammar: GrammarCompiler | None = None  # built on the first constraint
        self._grammar_lock = threading.Lock()
        if cfg.freeze_gc:  # NOTE: last, so the model and the engine's own state are frozen too
            freeze_gc()

    @property
    def grammar_compiler(self) -> GrammarCompiler:
        """Compiles constraints for this model's tokenizer (off the engine loop, cached)."""
        with self._grammar_lock:
            if self._grammar is None:
                backend = None if self.config.grammar_backend == "auto" else self.config.grammar_backend
                self._grammar = GrammarCompiler(self.tokenizer, self.vocab_size, backend=backend,
                                                timeout_s=self.config.grammar_timeout_s,
                                                max_source_bytes=self.config.grammar_max_bytes,
                                                max_schema_depth=self.config.schema_max_depth)
            return self._grammar

    @property
    def failure(self) -> str | None:
        """Why this engine can no longer serve (a tensor-parallel rank died), or None."""
        return self._tp.failed if self._tp is not None else None

    def compile_constraint(self, constraint: Any) -> CheckedGrammar:
        """Compile ``constraint`` now (cached). Raises ConstraintError if invalid or unsupported."""
        return self.grammar_compiler.compile(constraint)

    def add_step_hook(self, hook: StepHook) -> Callable[[], None]:
        """Call ``hook(batch)`` on the engine thread before every forward pass (it may
        wait or observe, never change the batch). Returns the function that removes it."""
        self._core.step_hooks.append(hook)
        return lambda: self._core.step_hooks.remove(hook)

    # ---- submission ---------------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | None = None,
        params: SamplingParams | None = None,
        *,
        input_ids: list[int] | None = None,
        request_id: str | None = None,
        callback: OutputCallback | None = None,
        tenant: str | None = None,
        priority: Priority = "interactive",
        cache_salt: str | None = None,
    ) -> str:
        """Validate and queue one request; returns its id. Thread-safe.

        ``tenant`` (who asks) and ``priority`` ("interactive" | "batch") steer the fair
        scheduler (``EngineConfig.fair_scheduling``); they never change the output.
        ``tenant`` and ``cache_salt`` also pick the request's cache namespace
        (``runtime.cache.namespace``): it reuses only prefixes cached by requests of the
        same tenant (unless ``share_prefix_cache_across_tenants``) and the same salt.

        Raises:
            InvalidRequestError / PromptTooLongError: for input that can never be served.
            EngineClosedError: after ``close()``; EngineFailedError once ``failure`` is set.
        """
        if (failure := self.failure) is not None:
            raise EngineFailedError(f"the engine cannot serve: {failure}")
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        ids = self._prompt_ids(prompt, input_ids)
        if len(ids) >= self.max_model_len:
            raise PromptTooLongError(
                f"prompt has {len(ids)} tokens; max_model_len is {self.max_model_len} "
                "(the prompt must leave room for at least one generated token)"
            )
        if priority not in PRIORITIES:
            raise InvalidRequestError(f"priority must be one of {', '.join(PRIORITIES)}, got {priority!r}")
        if tenant is not None and not isinstance(tenant, str):
            raise InvalidRequestError(f"tenant must be a string, got {type(tenant).__name__}")
        try:
            salt = check_cache_salt(cache_salt)
        except ValueError as exc:
            raise InvalidRequestError(str(exc)) from None
        namespace = cache_namespace(tenant, salt, self.config.share_prefix_cache_across_tenants)
        if (retention := params.retention) is not None and retention.ttl_s > self.config.retention_max_ttl_s:
            raise InvalidRequestError(f"retention ttl_s is {retention.ttl_s:g}; this engine keeps prefixes "
                                      f"at most {self.config.retention_max_ttl_s:g} s (retention_max_ttl_s)")
        rid = request_id or f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        request = Request(rid, ids, params, tenant=tenant, priority=priority, cache_namespace=namespace)
        self._core.submit(request, callback, self._start_grammar(params))
        return rid

    def _start_grammar(self, params: SamplingParams) -> Future[CheckedGrammar] | None:
        """Start compiling the request's constraint; invalid ones raise here, at once."""
        if params.constraint is None:
            return None
        future = self.grammar_compiler.compile_async(params.constraint)
        if future.done() and (exc := future.exception()) is not None:
            raise exc
        return future

    def _prompt_ids(self, prompt: str | None, input_ids: list[int] | None) -> list[int]:
        if (prompt is None) == (input_ids is None):
            raise InvalidRequestError("give exactly one of a prompt string or input_ids")
        if prompt is not None:
            if not isinstance(prompt, str):
                raise InvalidRequestError(f"prompt must be a string, got {type(prompt).__name__}")
            check_unicode(prompt, "the prompt")
            ids: list[int] = self.tokenizer(prompt, add_special_tokens=True)["input_ids"]
        else:
            ids = list(input_ids or [])
            if any(not isinstance(t, int) or not 0 <= t < self.vocab_size for t in ids):
                raise InvalidRequestError(f"input_ids must be integers in [0, {self.vocab_size})")
        if not ids:
            raise InvalidRequestError("the prompt is empty")
        return ids

    def abort(self, request_id: str) -> None:
        """Cancel a request; its pages are released on the engine's next step."""
        self._core.abort(request_id)

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
        if not items:
            return []
        with self._core.holding_submissions():  # the loop sees all at once: they batch together
            for kind, value in items:
                p = params[len(rids)]
                rids.append(self.add_request(**{kind: value}, params=p, callback=on_output))
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
        tenant: str | None = None,
        priority: Priority = "interactive",
        cache_salt: str | None = None,
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
                               callback=deliver, tenant=tenant, priority=priority, cache_salt=cache_salt)
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
        tenant: str | None = None,
        priority: Priority = "interactive",
        cache_salt: str | None = None,
    ) -> RequestOutput:
        """The final output of one request, awaited."""
        return await final_output(self.generate_stream(prompt, sampling_params, input_ids=input_ids,
                                                       request_id=request_id, tenant=tenant,
                                                       priority=priority, cache_salt=cache_salt))

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None,
                            template_kwargs: dict[str, Any] | None = None) -> str:
        """Render ``messages`` with the model's chat template; ``tools`` (OpenAI function
        specs) and ``template_kwargs`` (say ``enable_thinking``) go to the template too.

        Raises:
            InvalidRequestError: the template cannot render them (no messages, a message
                without role or content, content that is not text...).
        """
        if not messages:
            raise InvalidRequestError("there are no messages to render")
        try:
            return str(self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt, tools=tools,
                **(template_kwargs or {})))
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, AttributeError) as exc:
            raise InvalidRequestError(f"the chat template cannot render these messages: "
                                      f"{type(exc).__name__}: {exc}") from None

    def score(self, input_ids: list[int]) -> torch.Tensor:  # [len(input_ids), vocab] fp32
        """Logits of every position of ``input_ids`` (row ``i``: the token after
        ``input_ids[:i + 1]``), as serving computes them (same kernels, same KV dtype), for
        quality replays (``arbor eval``). Runs between two steps, on a thread of its own
        (``engine_setup.on_own_thread``).

        Raises:
            InvalidRequestError / PromptTooLongError: empty, out-of-vocabulary or too long.
        """
        if self._tp is not None:
            raise InvalidRequestError("score() runs the model outside the step loop, which the "
                                      "tensor-parallel ranks do not follow: use tensor_parallel_size=1")
        ids = self._prompt_ids(None, input_ids)
        if len(ids) > self.max_model_len:
            raise PromptTooLongError(f"{len(ids)} tokens to score; max_model_len is {self.max_model_len}")
        with self._core.between_steps():
            return on_own_thread(lambda: self._scorer.logits(ids))

    def embed(self, inputs: list[list[int]], pooling: Pooling | None = None,
              dimensions: int | None = None) -> torch.Tensor:  # [len(inputs), dimensions or hidden] fp32
        """Embeddings of token sequences: final-norm hidden states pooled per sequence
        (``runtime.model.pooling``; None: the model's own, ``embedding_pooling``), cut to
        their first ``dimensions`` (Matryoshka truncation), L2-normalized. Nothing is
        generated; the model runs between two steps, on a KV pool of its own, in passes of
        at most ``max_model_len`` tokens.

        Raises:
            InvalidRequestError / PromptTooLongError: no inputs, or one empty,
                out-of-vocabulary or too long; an unknown pooling; dimensions out of range.
        """
        pooling = pooling or self.embedding_pooling
        if pooling not in POOLINGS:
            raise InvalidRequestError(f"pooling must be one of {', '.join(POOLINGS)}, got {pooling!r}")
        hidden_size = self.model.args.hidden_size
        if dimensions is not None and not (isinstance(dimensions, int) and 1 <= dimensions <= hidden_size):
            raise InvalidRequestError(f"dimensions must be an integer in [1, {hidden_size}], got {dimensions!r}")
        if self._tp is not None:
            raise InvalidRequestError("embed() runs the model outside the step loop, which the "
                                      "tensor-parallel ranks do not follow: use tensor_parallel_size=1")
        if not inputs:
            raise InvalidRequestError("nothing to embed: the input list is empty")
        seqs = [self._prompt_ids(None, ids) for ids in inputs]
        for ids in seqs:
            if len(ids) > self.max_model_len:
                raise PromptTooLongError(f"an input has {len(ids)} tokens; max_model_len is {self.max_model_len}")
        passes: list[list[list[int]]] = [[]]
        for ids in seqs:
            if passes[-1] and sum(map(len, passes[-1])) + len(ids) > self.max_model_len:
                passes.append([])
            passes[-1].append(ids)
        with self._core.between_steps():
            hidden = on_own_thread(lambda: torch.cat([self._scorer.last_hidden(p, pooling) for p in passes]))
        return torch.nn.functional.normalize(hidden.float()[:, :dimensions], dim=-1)

    @functools.cached_property
    def embedding_pooling(self) -> Pooling:
        """How ``embed`` pools by default: as the model's files state, else the last token."""
        return model_pooling(self.model_dir) or "last"

    def end_session(self, session_id: str) -> None:
        """A retention session ended (a DSL run, an HTTP caller's session): its pinned
        prefixes are released on the engine's next step (``runtime/cache/retention.py``)."""
        self._core.release_session(session_id)

    def end_session_now(self, session_id: str) -> int | None:
        """End a retention session between two steps (``end_session`` posts it to the next
        one): its pins are released before this returns. Returns the pages it pinned, or
        None when no such session is live (never pinned, dropped, or ended before)."""
        with self._core.between_steps():
            if not self.cache.has_session(session_id):
                return None
            return self.cache.release(session_id)

    def flush_cache(self, to_tier: bool = False) -> int:
        """Evict every unlocked page of the prefix cache (SGLang's ``/flush_cache``); the
        pages running requests hold stay. The second tier (``kv_tier_dir``) is emptied too,
        unless ``to_tier``: then the evicted pages go to it, as under memory pressure.
        Returns the number of pages evicted from the pool."""
        with self._core.between_steps():
            freed = self.cache.evict(self.cache.num_evictable_pages, offload=to_tier)
            if not to_tier:
                self.tier.clear()
            return freed

    def wait_tier_writes(self, timeout: float = 60.0) -> bool:
        """Block until the pages evicted so far are written to the second tier
        (``kv_tier_dir``; they are written in the background). False on timeout."""
        return self.tier.flush(timeout)

    # ---- introspection --------------------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        """Counters and gauges of the engine (exported by the server)."""
        relaxed = self._grammar.num_relaxed if self._grammar is not None else 0
        return {**self._core.metrics(), "constraint_relaxed_compilations": relaxed}

    def check_integrity(self) -> None:
        """Page-accounting invariants; call when the engine is idle."""
        self._core.check_integrity()

    def wait_idle(self, timeout: float = 30.0) -> bool:
        """Block until nothing is queued or running (for tests and benchmarks)."""
        return self._core.wait_idle(timeout)

    def close(self) -> None:
        """Stop the loop after its current step; requests still in flight end as aborted
        with an error, so no caller waits for them forever. Idempotent."""
        self._core.close()
        self.tier.close()
        if self._grammar is not None:
            self._grammar.close()
        if self._tp is not None:
            self._tp.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

