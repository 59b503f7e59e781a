"""Grammar-constrained decoding: constraints → compiled grammars → per-step token masks.

Engine-facing surface::

    compiler = GrammarCompiler(hf_tokenizer, vocab_size)          # once per model
    compiled = compiler.compile(params.constraint)                 # at submission (CheckedGrammar)
    matcher = compiled.new_matcher()                               # per request
    bitmask = allocate_token_bitmask(batch_size, vocab_size)
    matcher.fill_bitmask(bitmask, row)                             # per step, per row
    apply_token_bitmask(logits, bitmask, rows)                     # once per step
    matcher.accept_token(token_id)
"""

from runtime.constrained.bitmask import (
    allocate_token_bitmask,
    allowed_token_ids,
    apply_token_bitmask,
    bitmask_width,
    unpack_bitmask,
)
from runtime.constrained.checked import CheckedGrammar
from runtime.constrained.compiler import DEFAULT_TIMEOUT_S, GrammarCompiler
from runtime.constrained.matcher import CompiledGrammar, GrammarBackend, GrammarMatcher
from runtime.constrained.registry import (
    BACKENDS,
    DEFAULT_BACKEND_BY_KIND,
    create_backend,
    default_backend_name,
)

__all__ = [
    "BACKENDS",
    "DEFAULT_BACKEND_BY_KIND",
    "DEFAULT_TIMEOUT_S",
    "CheckedGrammar",
    "CompiledGrammar",
    "GrammarBackend",
    "GrammarCompiler",
    "GrammarMatcher",
    "allocate_token_bitmask",
    "allowed_token_ids",
    "apply_token_bitmask",
    "bitmask_width",
    "create_backend",
    "default_backend_name",
    "unpack_bitmask",
]
