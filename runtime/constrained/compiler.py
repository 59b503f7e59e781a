"""GrammarCompiler: compiles constraints off the decode loop, with a cache and a time bound.

One per model tokenizer. ``compile_async`` runs in a thread pool and returns a Future
that fails with ConstraintError("grammar compilation timed out ...") after
``timeout_s``; ``compile`` waits for it (used at submission, to surface errors before
decoding). The clock starts when a pool thread picks the job up, not while it waits
in the queue. Results, errors included, are cached by ``(backend name,
constraint.key)``; a timed-out compile is not cached, so a later request tries again.

Every result is a ``CheckedGrammar`` (the backend's grammar, the constraint, the JSON
number bounds). A backend's relaxed grammar (``approximation`` set) is counted in
``num_relaxed``, or refused when the constraint is ``strict``.

NOTE: a thread cannot be killed: a timed-out compile keeps its worker until the library
returns. llguidance and xgrammar bound their own work; outlines-core does not (hence
it is never a default backend, see registry.py).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from grammars import Constraint, ConstraintError, JsonBounds, JsonSchemaConstraint, to_constraint
from grammars.schema_check import MAX_SCHEMA_DEPTH, json_depth
from runtime.constrained.checked import CheckedGrammar
from runtime.constrained.json_bounds import BoundsTable
from runtime.constrained.matcher import CompiledGrammar, GrammarBackend
from runtime.constrained.registry import backend_class, create_backend, default_backend_name

DEFAULT_TIMEOUT_S = 30.0
DEFAULT_MAX_SOURCE_BYTES = 2 * 1024 * 1024  # a constraint's canonical source (EngineConfig.grammar_max_bytes)


class GrammarCompiler:
    """Compiles and caches constraints for one tokenizer across the named backends."""

    def __init__(
        self,
        hf_tokenizer: Any,
        vocab_size: int | None = None,
        *,
        backend: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        max_workers: int = 2,
        max_cached: int = 256,
        backends: dict[str, GrammarBackend] | None = None,
        max_source_bytes: int = DEFAULT_MAX_SOURCE_BYTES,
        max_schema_depth: int = MAX_SCHEMA_DEPTH,
    ) -> None:
        """
        Args:
            hf_tokenizer: the model's HF fast tokenizer.
            vocab_size: the model's logits width (None: ``len(hf_tokenizer)``).
            backend: force one backend for every kind; None picks the measured default
                per constraint kind (registry.DEFAULT_BACKEND_BY_KIND).
            timeout_s: bound on one compilation.
            max_workers: compile threads.
            max_cached: compiled grammars kept (least recently used dropped first).
            backends: already-built backends by name, used instead of building them
                (share one across compilers; inject a fake in tests).
            max_source_bytes: bound on a constraint's canonical source, in UTF-8 bytes;
                a larger one is refused (ConstraintError) before any compile work.
            max_schema_depth: bound on a JSON schema's nesting of objects and arrays
                (at most ``grammars.MAX_SCHEMA_DEPTH``); a deeper one is refused likewise.
        """
        if backend is not None:
            backend_class(backend)  # fail fast on an unknown name
        self.hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size or len(hf_tokenizer)
        self.forced_backend = backend
        self.timeout_s = timeout_s
        self.max_source_bytes = max_source_bytes
        self.max_schema_depth = max_schema_depth
        self.max_cached = max_cached
        self._backends: dict[str, GrammarBackend] = dict(backends or {})
        self._cache: OrderedDict[tuple[str, str], Future[CheckedGrammar]] = OrderedDict()
        self._lock = threading.Lock()  # guards _cache and num_relaxed
        self._bounds: dict[JsonBounds, BoundsTable] = {}  # guarded by _backend_lock
        self.num_relaxed = 0  # relaxed grammars compiled and served (cache hits not counted)
        self._backend_lock = threading.Lock()  # guards _backends and _bounds
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="grammar-compile")

    def backend_name_for(self, constraint: Constraint) -> str:
        """The backend that compiles ``constraint``."""
        return self.forced_backend or default_backend_name(constraint.kind)

    def backend(self, name: str) -> GrammarBackend:
        """The backend ``name`` for this tokenizer, built on first use."""
        with self._backend_lock:  # NOTE: not _lock: building takes ~0.5 s
            if name not in self._backends:
                self._backends[name] = create_backend(name, self.hf_tokenizer, self.vocab_size)
            return self._backends[name]

    def compile_async(self, constraint: Any) -> Future[CheckedGrammar]:
        """Start (or reuse) the compilation of ``constraint``; never blocks on it.

        ``constraint`` is anything ``grammars.to_constraint`` accepts; normalising errors
        come back through the Future too.
        """
        try:
            normal = to_constraint(constraint)
            self._check_size(normal)
        except ConstraintError as exc:
            return _failed(exc)
        cache_key = (self.backend_name_for(normal), normal.key)
        with self._lock:
            cached = self._cache.get(cache_key)
            if cached is not None:
                self._cache.move_to_end(cache_key)
                return cached
            future = self._start(cache_key, normal)
            self._cache[cache_key] = future
            while len(self._cache) > self.max_cached:
                self._cache.popitem(last=False)
        return future

    def _check_size(self, constraint: Constraint) -> None:
        size = len(constraint.canonical_text().encode("utf-8", "surrogatepass"))
        if size > self.max_source_bytes:
            raise ConstraintError(f"the {constraint.kind} constraint is {size} bytes; the limit is "
                                  f"{self.max_source_bytes} (grammar_max_bytes)")
        if isinstance(constraint, JsonSchemaConstraint):
            depth = json_depth(constraint.schema)
            if depth > self.max_schema_depth:
                raise ConstraintError(f"JSON schema too deep: it nests {depth} levels of objects and arrays; "
                                      f"the limit is {self.max_schema_depth} (schema_max_depth)")

    def compile(self, constraint: Any, timeout_s: float | None = None) -> CheckedGrammar:
        """Compile and wait; raises ConstraintError (invalid, unsupported, timed out)."""
        future = self.compile_async(constraint)
        try:
            return future.result(timeout=timeout_s if timeout_s is not None else self.timeout_s)
        except FutureTimeout:
            raise _timeout_error(timeout_s or self.timeout_s) from None

    def close(self) -> None:
        """Stop the compile threads (running compilations finish in the background)."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _start(self, cache_key: tuple[str, str], constraint: Constraint) -> Future[CheckedGrammar]:
        """Submit one compilation; the caller holds the lock."""
        outer: Future[CheckedGrammar] = Future()
        self._pool.submit(self._run, cache_key, constraint, outer)
        return outer

    def _run(
        self, cache_key: tuple[str, str], constraint: Constraint, outer: Future[CheckedGrammar]
    ) -> None:
        """Compile on a pool thread; the clock starts here, not while queued or while
        the backend's token tables are built (once per backend)."""
        try:
            backend = self.backend(cache_key[0])
        except Exception as exc:
            _try_set(outer, exception=ConstraintError(f"grammar backend failed: {exc!r}"))
            return
        timer = threading.Timer(self.timeout_s, self._expire, (cache_key, outer))
        timer.daemon = True
        timer.start()
        try:
            compiled = self._checked(constraint, backend.compile(constraint), backend.reports_relaxation)
        except ConstraintError as exc:
            _try_set(outer, exception=exc)
        except Exception as exc:  # a library bug, not the user's constraint: same error type
            _try_set(outer, exception=ConstraintError(f"grammar compilation failed: {exc!r}"))
        else:
            _try_set(outer, result=compiled)
        finally:
            timer.cancel()

    def _checked(self, constraint: Constraint, compiled: CompiledGrammar, reports_relaxation: bool) -> CheckedGrammar:
        """Refuse a relaxation of a strict constraint; attach bounds and the constraint.
        NOTE: a backend that may relax silently gets every JSON output checked."""
        schema = constraint if isinstance(constraint, JsonSchemaConstraint) else None
        if compiled.approximation is not None:
            if schema is not None and schema.strict:
                raise ConstraintError(
                    f"strict JSON schema refused: the grammar would be relaxed ({compiled.approximation}); "
                    "without strict those keywords are ignored while generating and each output "
                    "is checked against the full schema")
            with self._lock:
                self.num_relaxed += 1
        bounds = self._bounds_table(schema.bounds) if schema is not None and schema.bounds else None
        return CheckedGrammar(compiled, constraint, bounds, always_check=schema is not None and not reports_relaxation)

    def _bounds_table(self, bounds: JsonBounds) -> BoundsTable:
        with self._backend_lock:
            if bounds not in self._bounds:
                self._bounds[bounds] = BoundsTable(self.hf_tokenizer, self.vocab_size, bounds)
            return self._bounds[bounds]

    def _expire(self, cache_key: tuple[str, str], outer: Future[CheckedGrammar]) -> None:
        if _try_set(outer, exception=_timeout_error(self.timeout_s)):
            with self._lock:
                if self._cache.get(cache_key) is outer:
                    del self._cache[cache_key]


def _timeout_error(timeout_s: float) -> ConstraintError:
    return ConstraintError(f"grammar compilation timed out after {timeout_s:g} s")


def _try_set(
    future: Future[CheckedGrammar],
    result: CheckedGrammar | None = None,
    exception: BaseException | None = None,
) -> bool:
    """Resolve ``future`` unless already resolved (the timer and the job race)."""
    try:
        if exception is not None:
            future.set_exception(exception)
        else:
            future.set_result(result)  # type: ignore[arg-type]
    except Exception:  # InvalidStateError: the other side won
        return False
    return True


def _failed(exc: ConstraintError) -> Future[CheckedGrammar]:
    future: Future[CheckedGrammar] = Future()
    future.set_exception(exc)
    return future
