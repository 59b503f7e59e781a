"""``gen(..., reasoning=True)``: a reasoning model's output is a thinking span, then the
answer (``<think> ... </think> answer``). The span's end marker goes to the backend
(``GenParams.reasoning_end``: the engine starts the constraint after it); the executor
splits the output here: the answer is the gen's value, the thinking its own variable."""

from __future__ import annotations

THINK_START = "<think>"
THINK_END = "</think>"
# The key under which a gen node defines its thinking variable (``tracer.Session.ref``):
# the node's value is the answer; the thinking is kept by the executor, by node id.
REASONING_KEY = "\0reasoning"


def split_thinking(text: str) -> tuple[str, str | None]:
    """(thinking, answer) of an output that starts inside a span; answer None when the
    span never ended (the output was cut, or the model never closed it)."""
    body = text.lstrip().removeprefix(THINK_START)
    thinking, found, answer = body.partition(THINK_END)
    return thinking.strip(), (answer.lstrip() if found else None)
