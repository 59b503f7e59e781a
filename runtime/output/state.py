"""The output processor's records: its state of each request (``TrackedRequest``) and
what a step produced before it reaches anyone (``NewTokens``, ``StepTokens``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from runtime.constrained import CheckedGrammar, GrammarMatcher
from runtime.output.detokenizer import IncrementalDetokenizer
from runtime.output.request_output import ConstraintCheck, RequestOutput
from runtime.request import Request
from runtime.sampling.penalties import TokenHistory
from runtime.speculative import RequestSpeculation, SpecStats

OutputCallback = Callable[[RequestOutput], None]
TopLogprobs = dict[int, float]


@dataclass(eq=False)
class TrackedRequest:
    """The output processor's state of one request, from submission to finish."""

    request: Request
    detok: IncrementalDetokenizer
    callback: OutputCallback | None
    seed: int  # the request's own, or drawn from the engine's generator at submission
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[TopLogprobs] = field(default_factory=list)
    prompt_logprobs: list[float | None] = field(default_factory=list)  # per prompt token
    emitted_tokens: int = 0
    matcher: GrammarMatcher | None = None  # attached once the constraint is compiled
    grammar: CheckedGrammar | None = None  # the matcher's grammar: checks the final output
    spec: SpecStats = field(default_factory=SpecStats)
    # Acceptance per draft source and the pending shadow round (runtime.speculative.gate)
    speculation: RequestSpeculation = field(default_factory=RequestSpeculation)
    draft_source: str | None = None  # this step's drafts' lookup source; None: forced or none
    prompt_text: str | None = None  # decoded once, for text-level prompt lookup
    history: TokenHistory | None = None  # token counts, for a request with penalties


@dataclass(frozen=True)
class NewTokens:
    """Tokens one request produced in a step, before they are appended."""

    request: Request
    token_ids: list[int]  # empty: the grammar admits no token (or max_new_tokens == 0)
    logprobs: list[float] | None  # per token, when the request asked
    top_logprobs: list[TopLogprobs] | None  # per token, when the request asked
    verified: bool  # from a verify pass: the matcher has advanced past all of them


@dataclass(frozen=True)
class StepTokens:
    """Everything a step produced for the callers, in emission order."""

    new: list[NewTokens]
    prompt_logprobs: list[tuple[Request, list[tuple[int, float]]]]  # (position, logprob) pairs

    @property
    def num_verified(self) -> dict[str, int]:
        """Tokens each verify item produced (what the scheduler commits)."""
        return {n.request.request_id: len(n.token_ids) for n in self.new if n.verified}


@dataclass(frozen=True)
class Final:
    """A request the output processor has finished, whose final output is not sent yet:
    the engine releases its pages first, then ``OutputProcessor.send_finals``."""

    request: Request
    error: str | None
    check: ConstraintCheck | None
