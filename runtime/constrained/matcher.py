"""The contract between the engine and a grammar backend.

Lifecycle, per model tokenizer::

    backend = LLGuidanceBackend.from_tokenizer(hf_tokenizer, vocab_size)  # once (~0.5 s)
    compiled = backend.compile(constraint)   # once per constraint (cached by GrammarCompiler)
    matcher = compiled.new_matcher()         # once per request (cheap)
    each decode step:  matcher.fill_bitmask(bitmask, row); sample; matcher.accept_token(t)

Token masks are bitmasks: int32 tensors ``[batch, ceil(vocab_size / 32)]`` on the CPU;
bit ``t % 32`` of word ``t // 32`` set means token ``t`` is allowed.

EOS rule: every backend allows the tokenizer's EOS only where the grammar accepts
(``can_end()``), and a matcher accepts EOS exactly then.

Threading: a backend and its compiled grammars may be used from several threads (the
compiler compiles in a pool); one matcher belongs to one request and is driven by one
thread at a time.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import torch

from grammars import Constraint


class GrammarMatcher(ABC):
    """The grammar state of one request: which token may come next."""

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed-next-token mask into ``bitmask[row]`` (int32, on the CPU)."""

    @abstractmethod
    def accept_token(self, token_id: int) -> bool:
        """Advance by ``token_id``; False (state unchanged) if the token is not allowed."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (EOS included).

        Raises:
            ValueError: more tokens than were accepted.
        """

    @abstractmethod
    def is_terminated(self) -> bool:
        """The grammar is complete and admits nothing more except EOS (or EOS was taken)."""

    @abstractmethod
    def can_end(self) -> bool:
        """EOS is allowed now: the text so far is a complete sentence of the grammar."""

    def error(self) -> str | None:
        """Why this matcher can no longer advance (a backend limit hit), else None.

        After an error the mask allows nothing useful; the engine should end the
        request with this message rather than sample.
        """
        return None

    def forced_tokens(self) -> list[int]:
        """Tokens the grammar forces next, in canonical tokenization; [] if unknown."""
        return []


class CompiledGrammar(ABC):
    """A constraint compiled against one tokenizer; immutable, shared by requests.

    ``approximation`` is None when the grammar admits exactly the constraint's
    language; otherwise it says what is not enforced (the grammar admits a superset,
    so the finished output must be checked with ``grammars.parse_output``).
    """

    approximation: str | None = None

    @abstractmethod
    def new_matcher(self) -> GrammarMatcher:
        """A fresh matcher at the start of the grammar."""


class GrammarBackend(ABC):
    """One grammar library bound to one tokenizer; compiles constraints."""

    name: str = "abstract"
    # True when a JSON grammar that admits more than its schema always says so in
    # ``CompiledGrammar.approximation``. xgrammar and outlines-core silently skip keywords
    # they do not implement (``not``, ``uniqueItems``...), so their JSON outputs are
    # always checked against the schema (``CheckedGrammar``).
    reports_relaxation: bool = False

    def __init__(self, vocab_size: int, eos_token_id: int) -> None:
        self.vocab_size = vocab_size  # logits width; bitmask rows hold ceil(vocab_size / 32)
        self.eos_token_id = eos_token_id

    @classmethod
    @abstractmethod
    def from_tokenizer(cls, hf_tokenizer: Any, vocab_size: int | None = None) -> GrammarBackend:
        """Build the backend's token tables from a HF fast tokenizer (slow: once per model).

        Args:
            hf_tokenizer: a ``transformers`` fast tokenizer with an EOS token.
            vocab_size: the model's logits width (may exceed ``len(hf_tokenizer)``);
                None means ``len(hf_tokenizer)``.
        """

    @abstractmethod
    def compile(self, constraint: Constraint) -> CompiledGrammar:
        """Compile ``constraint``; raises ConstraintError when invalid or unsupported."""

    def fill_bitmasks(
        self, entries: Sequence[tuple[GrammarMatcher, int]], bitmask: torch.Tensor
    ) -> None:
        """Fill ``bitmask[row]`` for every ``(matcher, row)``; backends may parallelise."""
        for matcher, row in entries:
            matcher.fill_bitmask(bitmask, row)
