"""``ReasoningSpan``: a request whose output opens with a thinking span (reasoning models).

A reasoning model (Qwen 3, DeepSeek-R1, ...) writes ``<think> ... </think>`` before its
answer. A request that knows it carries a ``ReasoningSpan`` in ``SamplingParams.reasoning``;
the engine then

- leaves the thinking free: the request's constraint (JSON schema, regex, tool calls)
  starts where the span ends, at the first token after ``end_ids``;
- bounds it: after ``budget`` thinking tokens the end marker is forced, token by token;
- checks only the answer against the constraint.

Torch-free: the matcher that does this is ``runtime.constrained.reasoning``.
"""

from __future__ import annotations

from dataclasses import dataclass

from runtime.errors import InvalidRequestError


@dataclass(frozen=True)
class ReasoningSpan:
    """Where a request's thinking ends, and how long it may be.

    ``end_ids``: the token ids of the end marker (``</think>``), as the tokenizer writes
    it; the output's thinking span is every token up to and including them.
    ``budget``: at most this many thinking tokens before the marker (None: unbounded).
    """

    end_ids: tuple[int, ...]
    budget: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "end_ids", tuple(self.end_ids))
        if not self.end_ids or any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in self.end_ids):
            raise InvalidRequestError(f"reasoning end_ids must be a non-empty list of token ids, got {self.end_ids!r}")
        if self.budget is not None and (not isinstance(self.budget, int) or isinstance(self.budget, bool)
                                        or self.budget < 0):
            raise InvalidRequestError(f"reasoning budget must be an integer >= 0 or None, got {self.budget!r}")
