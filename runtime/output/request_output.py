"""What the engine hands back for each request."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length", "abort"]


@dataclass(frozen=True)
class ConstraintCheck:
    """A finished constrained output measured against its whole constraint.

    Set by the output processor on the final output of a request with a constraint that
    finished by ``stop`` or ``length``. Only an output of a relaxed grammar, or one that
    ended before its grammar did (a stop string or stop id), is actually checked
    (``grammars.parse_output``: jsonschema for JSON, ``re`` for regexes, lark for
    grammars); an exact grammar that reached its own end is valid by construction.
    """

    relaxed: str | None  # what the grammar did not enforce (the keywords); None: exact grammar
    valid: bool | None  # satisfies the whole constraint; None: cut by max_new_tokens, not checked
    checked: bool = False  # the output was parsed and checked (else valid by construction)
    error: str | None = None  # why not, when valid is False


# RequestOutput.error's prefix when the constraint's grammar failed mid-generation (a
# resource bound of the grammar engine, say): the client's constraint, not the engine.
GRAMMAR_ERROR = "grammar error: "


@dataclass
class RequestOutput:
    """The state of one request as seen by its caller.

    For a finished request the fields are final. In streaming, one ``RequestOutput`` is
    emitted per step with ``delta_text`` / ``delta_token_ids`` holding what is new since the
    previous one, while ``text`` / ``token_ids`` hold everything so far.
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated tokens (stop token excluded when it is EOS/stop id)
    text: str  # detokenized output; never ends mid UTF-8 char, never holds a stop string
    finish_reason: FinishReason | None = None  # None while running
    logprobs: list[float] | None = None  # per generated token, when requested
    top_logprobs: list[dict[int, float]] | None = None  # per generated token, when requested
    prompt_logprobs: list[float | None] | None = None  # per prompt token; first is None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # NOTE: of num_cached_tokens, those reloaded from a host tier (the rest were in the KV
    # pool); 0 while no tier exists
    num_tier_cached_tokens: int = 0
    # Speculation so far (counts of this request; see runtime.speculative.SpecStats):
    num_draft_tokens: int = 0  # draft tokens sent for verification (grammar-forced included)
    num_accepted_tokens: int = 0  # of those, accepted
    num_forced_tokens: int = 0  # draft tokens the grammar forced
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    # Set when the request failed (e.g. grammar compile error); it starts with
    # GRAMMAR_ERROR when the request's grammar itself failed while generating.
    error: str | None = None
    constraint_check: ConstraintCheck | None = None  # final outputs of constrained requests

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


async def final_output(stream: AsyncIterator[RequestOutput]) -> RequestOutput:
    """The last (finished) output of a request's stream of outputs."""
    last: RequestOutput | None = None
    async for out in stream:
        last = out
    assert last is not None, "a request's stream ends with its final output"
    return last
