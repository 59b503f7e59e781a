"""Reasoning models' thinking spans: which models have one, and splitting it off.

A reasoning model writes ``<think> ... </think>`` before its answer (Qwen 3, QwQ,
DeepSeek-R1 and its distillations). The chat APIs return the span apart from the answer
(OpenAI chat: ``reasoning_content``; Anthropic: a ``thinking`` block), and the engine
constrains only what follows it (``runtime.sampling.reasoning``).

Where the span opens decides how the output reads:

- the template ends the prompt inside an open span (DeepSeek-R1 appends ``<think>\\n``):
  the output is ``thinking </think> answer``;
- the template closed an empty span (Qwen 3 with ``enable_thinking: false``): no span;
- otherwise the server opens the span at the end of the prompt itself, so that every
  answer of a reasoning model has the first shape (a constraint then always has a place
  to start, and a budget something to bound).
"""

from __future__ import annotations

from runtime.model.families import FAMILIES
from runtime.sampling.reasoning import THINK, ReasoningFormat
from runtime.server.formats import partial_suffix

__all__ = ["FORMATS", "THINK", "ReasoningFormat", "ReasoningStream", "reasoning_format"]

FORMATS = {f.name: f for f in (THINK,)}


def reasoning_format(family: str | None, template: str | None) -> ReasoningFormat | None:
    """The model's thinking span: its family's (``Family.reasoning_format``), else the one
    its chat template writes (both markers in it), else None (not a reasoning model)."""
    stated = FAMILIES[family].reasoning_format if family in FAMILIES else None
    if stated is not None:
        return FORMATS[stated]
    for fmt in FORMATS.values():
        if template and fmt.start in template and fmt.end in template:
            return fmt
    return None


class ReasoningStream:
    """Splits a streamed output (which starts inside a span) into thinking and answer
    deltas. A tail that may be the start of the end marker is held back until the next
    delta says what it is."""

    def __init__(self, fmt: ReasoningFormat) -> None:
        self.fmt = fmt
        self.ended = False
        self._held = ""  # thinking text not yet sent (a possible partial marker)
        self._started = False  # the first non-space thinking text was seen
        self._answering = False  # the first non-space answer text was sent

    def feed(self, delta: str) -> tuple[str, str]:
        """(thinking delta, answer delta) for the next piece of output text."""
        if self.ended:
            return "", self._answer(delta)
        text = self._held + delta
        if not self._started:
            stripped = text.lstrip()
            if self.fmt.start.startswith(stripped):  # may still become the opening marker
                self._held = text
                return "", ""
            text = stripped.removeprefix(self.fmt.start).lstrip()
            self._started = bool(text)
            if not text:
                self._held = ""
                return "", ""
        thinking, found, answer = text.partition(self.fmt.end)
        if found:
            self.ended, self._held = True, ""
            return thinking.rstrip(), self._answer(answer)
        # NOTE: blank space before the marker is not thinking either: held until text follows
        sendable = text[:len(text) - partial_suffix(text, self.fmt.end)].rstrip()
        self._held = text[len(sendable):]
        return sendable, ""

    def _answer(self, delta: str) -> str:
        if not self._answering:  # NOTE: the blank lines after the marker are not the answer
            delta = delta.lstrip()
            self._answering = bool(delta)
        return delta

    def flush(self) -> str:
        """Thinking text held back at the end of the output."""
        held, self._held = self._held, ""
        return "" if self.ended else held.rstrip()

