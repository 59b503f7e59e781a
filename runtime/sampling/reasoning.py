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


@dataclass(frozen=True)
class ReasoningFormat:
    """The text markers of a thinking span (``THINK``: ``<think>`` and ``</think>``)."""

    name: str
    start: str
    end: str

    def prompt_state(self, prompt: str) -> str:
        """"open" (the prompt ends inside a span), "closed" (it ends right after one: the
        template turned thinking off) or "none"."""
        last_start, last_end = prompt.rfind(self.start), prompt.rfind(self.end)
        if last_start > last_end and not prompt[last_start + len(self.start):].strip():
            return "open"
        if last_end >= 0 and last_end > last_start and not prompt[last_end + len(self.end):].strip():
            return "closed"
        return "none"

    def split(self, text: str) -> tuple[str | None, str]:
        """(thinking, answer) of an output that starts inside a span. An output whose
        span never ended is all thinking (answer "")."""
        text = text.lstrip().removeprefix(self.start)  # a model that opens the span itself
        thinking, found, answer = text.partition(self.end)
        if not found:
            return text.strip() or None, ""
        return thinking.strip() or None, answer.lstrip()


THINK = ReasoningFormat("think", "<think>", "</think>")
