"""The contracts of one step: what the scheduler chose (``ScheduledBatch``) and the plain
description of it that the model runner computes (``ForwardBatch``).

The runner never sees a ``Request``: it gets token ids, positions and page tables as
immutable values, so it cannot change a request's state (the scheduler owns pages and
positions; the output processor owns tokens).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from runtime.request import Request
from runtime.scheduler.cost_model import StepShape

LogitsWanted = Literal["none", "last", "all"]


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
class VerifyItem:
    """A decoding request with speculative drafts: ``[newest token] + draft_ids`` are
    computed in one pass and every position gets logits."""

    request: Request
    draft_ids: tuple[int, ...]  # set by the scheduler from the output processor's proposal


@dataclass(frozen=True)
class ForwardSeq:
    """One request's rows in a forward pass.

    ::

        positions:  0 ............ start ........... start + len(token_ids)
                    [ KV in the pool | token_ids: KV computed now ]
        page_table: the pool pages of positions 0 .. start + len(token_ids) - 1, in order
    """

    request_id: str
    token_ids: tuple[int, ...]  # [n] tokens at positions start .. start + n - 1
    start: int  # position of token_ids[0]
    page_table: tuple[int, ...]  # pages covering every position up to start + n - 1
    logits: LogitsWanted  # "last": sample after it; "all": verify every row; "none": mid-prompt
    # (row within token_ids, prompt position it predicts, the prompt token there): rows
    # whose log-probability of the next prompt token was asked for (prompt_logprobs).
    prompt_logprob_rows: tuple[tuple[int, int, int], ...] = ()


@dataclass(frozen=True)
class ForwardBatch:
    """What one forward pass computes: multi-token rows first, then one-token rows."""

    extend: tuple[ForwardSeq, ...]  # prefill chunks, then verify items
    decode: tuple[ForwardSeq, ...]  # one token each (the newest sampled token)


@dataclass(frozen=True)
class ScheduledBatch:
    """What one step computes. Pages for every token are allocated already."""

    prefill: list[PrefillItem]  # extend part, in this order
    decode: list[Request]  # one token each, after the extend part
    verify: list[VerifyItem]  # decoding requests with drafts, after the prefill items
    retracted: list[Request]  # paused this step (re-queued)
    forward: ForwardBatch  # the same step as plain values, for the model runner

    @classmethod
    def build(cls, prefill: list[PrefillItem] | None = None, decode: list[Request] | None = None,
              verify: list[VerifyItem] | None = None,
              retracted: list[Request] | None = None) -> ScheduledBatch:
        """The batch with its forward description (pages must be allocated already)."""
        prefill, decode, verify = prefill or [], decode or [], verify or []
        extend = tuple(_prefill_seq(i) for i in prefill) + tuple(_verify_seq(v) for v in verify)
        forward = ForwardBatch(extend, tuple(_decode_seq(r) for r in decode))
        return cls(prefill, decode, verify, retracted or [], forward)

    @property
    def empty(self) -> bool:
        return not self.prefill and not self.decode and not self.verify

    @property
    def shape(self) -> StepShape:
        """The rows this step computes, for the step cost model."""
        return StepShape(decode_rows=len(self.decode), prefill_tokens=sum(i.num_tokens for i in self.prefill),
                         verify_rows=sum(1 + len(v.draft_ids) for v in self.verify))


def _prefill_seq(item: PrefillItem) -> ForwardSeq:
    r, end = item.request, item.start + item.num_tokens
    return ForwardSeq(r.request_id, tuple(r.all_ids[item.start : end]), item.start, tuple(r.pages),
                      "last" if item.completes else "none", _prompt_logprob_rows(item))


def _verify_seq(item: VerifyItem) -> ForwardSeq:
    r = item.request
    return ForwardSeq(r.request_id, (r.output_ids[-1], *item.draft_ids), r.num_computed,
                      tuple(r.pages), "all")


def _decode_seq(r: Request) -> ForwardSeq:
    return ForwardSeq(r.request_id, (r.output_ids[-1],), r.num_computed, tuple(r.pages), "last")


def _prompt_logprob_rows(item: PrefillItem) -> tuple[tuple[int, int, int], ...]:
    """Rows of the chunk whose next prompt token's logprob was asked for: the logits at
    position j predict the token at j + 1, from ``logprob_start_len`` (at least 1) on."""
    r = item.request
    if not r.params.prompt_logprobs:
        return ()
    first = max(r.params.logprob_start_len, 1)
    prompt: Sequence[int] = r.prompt_ids
    return tuple((j - item.start, j + 1, prompt[j + 1])
                 for j in range(item.start, item.start + item.num_tokens)
                 if first <= j + 1 < len(prompt))
