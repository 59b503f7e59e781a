"""Backends by name, and the default backend for each constraint kind."""

from __future__ import annotations

import importlib
from typing import Any

from grammars import ConstraintError
from runtime.constrained.matcher import GrammarBackend

# name -> "module:class". Imported on first use: xgrammar and outlines take seconds to
# import, and an engine that never sees a constraint should not pay for them.
BACKENDS: dict[str, str] = {
    "llguidance": "runtime.constrained.llguidance_backend:LLGuidanceBackend",
    "xgrammar": "runtime.constrained.xgrammar_backend:XGrammarBackend",
    "outlines": "runtime.constrained.outlines_backend:OutlinesBackend",
}

# Chosen by measurement (benchmarks/bench_grammar_engines.py; docs/benchmarks.md#grammar_engines):
# llguidance compiles the most JSONSchemaBench schemas with the fewest timeouts, its masks
# stay far below a decode step for every kind, and it alone gives canonical forced tokens
# (for speculation) with one regex dialect and one JSON layout for all kinds. xgrammar's
# masks are faster but it times out on many schemas; outlines-core cannot compile CFGs and
# drops tokens that leave a final state for a non-final one
# (tests/runtime/constrained/test_matchers.py), so it is never a default.
DEFAULT_BACKEND_BY_KIND: dict[str, str] = {
    "json_schema": "llguidance",
    "regex": "llguidance",
    "choice": "llguidance",
    "type": "llguidance",
    "grammar": "llguidance",
}


def backend_class(name: str) -> type[GrammarBackend]:
    """The backend class called ``name`` ("llguidance", "xgrammar" or "outlines")."""
    if name not in BACKENDS:
        raise ConstraintError(f"unknown grammar backend {name!r}; choose one of {sorted(BACKENDS)}")
    module, cls = BACKENDS[name].split(":")
    backend: type[GrammarBackend] = getattr(importlib.import_module(module), cls)
    return backend


def default_backend_name(kind: str) -> str:
    """The measured default backend for a constraint kind."""
    return DEFAULT_BACKEND_BY_KIND.get(kind, "llguidance")


def create_backend(name: str, hf_tokenizer: Any, vocab_size: int | None = None) -> GrammarBackend:
    """Build backend ``name`` for a tokenizer (slow: once per model). A tokenizer that is
    not transformers' own (a GGUF's ``FastTokenizer``) hands over its transformers twin:
    the backends' libraries read transformers' objects."""
    as_transformers = getattr(hf_tokenizer, "as_transformers", None)
    if as_transformers is not None:
        hf_tokenizer = as_transformers()
    return backend_class(name).from_tokenizer(hf_tokenizer, vocab_size)
