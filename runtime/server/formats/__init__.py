"""What a model's chat output looks like beyond plain text, per model family: its
tool-call syntax (``tool_calls.py``) and its thinking span (``reasoning.py``), read from
the family (``runtime.model.families``) or the chat template."""

from __future__ import annotations

from typing import Any


def model_template(engine: Any) -> tuple[str | None, str | None]:
    """(chat template, family name) of the served model (what picks its formats)."""
    template = getattr(getattr(engine, "tokenizer", None), "chat_template", None)
    args = getattr(getattr(engine, "model", None), "args", None)
    return (template if isinstance(template, str) else None), getattr(args, "family", None)


def partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that begins ``marker`` (but is not all of
    it): text a stream holds back until the next delta says whether the marker came."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
