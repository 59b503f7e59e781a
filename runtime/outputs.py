"""What the engine hands back for each request."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length", "abort"]


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
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    error: str | None = None  # set when the request failed (e.g. grammar compile error)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
