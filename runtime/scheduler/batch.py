"""The contract between the scheduler and the model runner for one step."""

from __future__ import annotations

from dataclasses import dataclass, field

from runtime.request import Request


@dataclass(frozen=True)
class PrefillItem:
    """A run of not-yet-computed tokens of one request, computed this step."""

    request: Request
    start: int  # first position computed (== request.num_computed when scheduled)
    num_tokens: int  # tokens computed this step (a chunk when < request.num_remaining)

    @property
    def completes(self) -> bool:
        """True when this chunk reaches the end of the known tokens (so we sample)."""
        return self.start + self.num_tokens == self.request.seq_len


@dataclass(frozen=True)
class ScheduledBatch:
    """What one forward pass computes. Pages for every token are allocated already."""

    prefill: list[PrefillItem] = field(default_factory=list)  # extend part, in this order
    decode: list[Request] = field(default_factory=list)  # one token each, after the extend part
    # Decoding requests with speculative drafts: ``[newest token] + draft_ids`` computed
    # as an extend after the prefill items; every position gets logits.
    verify: list[Request] = field(default_factory=list)
    retracted: list[Request] = field(default_factory=list)  # paused this step (re-queued)

    @property
    def empty(self) -> bool:
        return not self.prefill and not self.decode and not self.verify

