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

# Chosen by measurement (benchmarks/bench_grammar_engines.py --per-split 10 --timeout 5,
# SmolLM2-135M vocabulary 49152, 1 torch thread on a shared, loaded 2-core Zen 3 box,
# 2026-11-29; compile ms are medians over compiled schemas, mask µs per decode step):
#   json_schema, 100 JSONSchemaBench schemas:
#     llguidance  95% compiled (17 as flagged relaxations), 1 timeout; compile 11.6 ms;
#                 mask b1 10 µs (p99 220), b32 238 µs
#     xgrammar    74% compiled, 26 timeouts at 5 s; compile 235 ms; mask b1 3 µs, b32 105 µs
#     outlines    47% compiled, 32 timeouts; compile 497 ms; mask b1 3.6 µs, b32 546 µs
#   regex: compile llguidance 1.2 ms, xgrammar 1025 ms, outlines 1229 ms ([A-Za-z ]{1,40}).
#   grammar (sql_select.lark): mask steps llguidance 0.03-8.5 ms, xgrammar 0.02-950 ms;
#     outlines cannot compile CFGs.
#   choice / type: compile llguidance 1-14 ms, xgrammar 0.2-0.4 ms, outlines 68-273 ms;
#     mask llguidance 13-160 µs, xgrammar 2-7 µs. xgrammar is faster, but both are far
#     below a decode step, and llguidance alone gives canonical forced_tokens() (for
#     speculation) and keeps one regex dialect and one JSON layout for all kinds.
# Baseline in the same run: the lm_head matmul of one decode step, 30 ms (b1) / 98 ms (b32).
# outlines-core 0.2.14 also drops tokens that leave a final state for a non-final one
# (see tests/runtime/constrained/test_matchers.py), so it is never a default.
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
    """Build backend ``name`` for a tokenizer (slow: once per model)."""
    return backend_class(name).from_tokenizer(hf_tokenizer, vocab_size)
