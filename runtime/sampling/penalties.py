"""Repetition penalties and ``min_tokens``: logits adjustments that depend on what a
request has already produced.

Semantics (applied to raw logits, before temperature, top-k/p and Gumbel noise; the
repetition penalty first, as vLLM and HF order them):

- ``repetition_penalty`` ``p`` (HF's ``RepetitionPenaltyLogitsProcessor``, CTRL): every
  token that occurs in the prompt or the output so far gets ``logit / p`` if its logit is
  > 0, else ``logit * p``. Once per token, however often it occurred.
- ``frequency_penalty`` ``f`` and ``presence_penalty`` ``r`` (OpenAI): every token that
  occurs ``c > 0`` times in the *output* gets ``logit - c * f - r``.
- ``min_tokens`` ``m``: while fewer than ``m`` tokens were generated, EOS and the stop
  ids get ``-inf``. Under a grammar this keeps the output going where the grammar could
  end, but a grammar that has ended (nothing but a stop id can follow) ends the output.

Logprobs returned to the caller are of the adjusted distribution (as they are of the
grammar-masked one). Speculative verification adjusts each row as if the drafts before it
were appended (``TokenHistory.with_pending``), so drafts stay exact.

Cost: the counts are kept incrementally as arrays (``TokenHistory.add`` per appended
token, owned by the output processor), so a step costs O(distinct tokens of the penalized
rows) in a few vectorised ops, never O(output length) in Python or O(batch x vocab):
the adjustment touches only the entries it changes (``benchmarks/bench_penalties.py``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Sequence

import numpy as np
import torch

from runtime.sampling.params import SamplingParams


class _Growing:
    """An append-only numpy array (amortised doubling), read as a view of its values."""

    def __init__(self, dtype: type, values: Sequence[int] = ()) -> None:
        self._data: np.ndarray = np.zeros(max(16, 2 * len(values)), dtype=dtype)
        self._data[: len(values)] = values
        self.size = len(values)

    def append(self, value: float) -> None:
        if self.size == len(self._data):
            self._data = np.concatenate([self._data, np.zeros_like(self._data)])
        self._data[self.size] = value
        self.size += 1

    @property
    def values(self) -> np.ndarray:
        return self._data[: self.size]


class TokenHistory:
    """The tokens a penalized request has seen, kept as arrays a step can use at once:
    the distinct ids of its prompt and output (for the repetition penalty) and the
    distinct output ids with their counts (frequency, presence). Owned by the output
    processor, which adds each token it appends (O(1) per token)."""

    def __init__(self, prompt_ids: Iterable[int]) -> None:
        distinct = sorted(set(prompt_ids))
        self._seen = set(distinct)
        self._seen_ids = _Growing(np.int64, distinct)  # prompt or output, each id once
        self._slots: dict[int, int] = {}  # output id -> its index in _out_ids
        self._out_ids = _Growing(np.int64)
        self._out_counts = _Growing(np.float32)

    def add(self, token: int) -> None:
        slot = self._slots.get(token)
        if slot is None:
            self._slots[token] = self._out_ids.size
            self._out_ids.append(token)
            self._out_counts.append(1.0)
        else:
            self._out_counts.values[slot] += 1.0
        if token not in self._seen:
            self._seen.add(token)
            self._seen_ids.append(token)

    def with_pending(self, pending: Sequence[int]) -> TokenHistory:
        """This history as if ``pending`` (tokens accepted earlier in this verify pass)
        were already appended; ``self`` is unchanged."""
        if not pending:
            return self
        other = copy.deepcopy(self)
        for token in pending:
            other.add(token)
        return other

    @property
    def seen_ids(self) -> np.ndarray:  # [S] int64
        return self._seen_ids.values

    @property
    def output_ids(self) -> np.ndarray:  # [D] int64, distinct
        return self._out_ids.values

    @property
    def output_counts(self) -> np.ndarray:  # [D] float32, >= 1
        return self._out_counts.values


def apply_penalties(
    logits: torch.Tensor,  # [B, V], changed in place
    params: Sequence[SamplingParams],
    histories: Sequence[TokenHistory | None],  # None: the row has no penalty
    pending: Sequence[Sequence[int]] | None = None,  # per row: tokens not yet in its history
) -> None:
    """Apply each row's repetition, frequency and presence penalties in place.

    NOTE: the rows' arrays are concatenated into one (row, id) index, so the whole batch
    is two gathers and two scatters, whatever the number of rows.
    """
    rows = [i for i, (p, h) in enumerate(zip(params, histories, strict=True)) if h is not None and p.penalized]
    hist = {i: histories[i].with_pending(pending[i] if pending is not None else ())  # type: ignore[union-attr]
            for i in rows}
    rep = [i for i in rows if params[i].repetition_penalty != 1.0]
    if rep:
        index, per_row = _index(rep, [hist[i].seen_ids for i in rep])
        penalty = per_row(torch.tensor([params[i].repetition_penalty for i in rep]))
        values = logits[index]
        logits.index_put_(index, torch.where(values > 0, values / penalty, values * penalty))
    additive = [i for i in rows if params[i].frequency_penalty or params[i].presence_penalty]
    if additive:
        # NOTE: output ids are distinct per row, so a plain (non-accumulating) put is exact.
        index, per_row = _index(additive, [hist[i].output_ids for i in additive])
        counts = torch.from_numpy(np.concatenate([hist[i].output_counts for i in additive]))
        frequency = per_row(torch.tensor([params[i].frequency_penalty for i in additive]))
        presence = per_row(torch.tensor([params[i].presence_penalty for i in additive]))
        logits.index_put_(index, logits[index] - counts * frequency - presence)


def _index(rows: list[int], ids: list[np.ndarray]) -> tuple[tuple[torch.Tensor, torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]:
    """The (row, id) index of the rows' id arrays, and a function spreading one value per
    row over that index."""
    lengths = torch.tensor([len(a) for a in ids])
    index = (torch.repeat_interleave(torch.tensor(rows), lengths), torch.from_numpy(np.concatenate(ids)))
    return index, lambda per_row: torch.repeat_interleave(per_row.float(), lengths)


def suppress_stop_ids(
    logits: torch.Tensor,  # [B, V], changed in place
    rows: Sequence[int],
    stop_ids: Sequence[Sequence[int]],  # per listed row: the ids that would end it
) -> None:
    """``-inf`` on each listed row's stop ids (``min_tokens`` not reached yet), except in a
    row where nothing else is allowed (its grammar has ended: min_tokens never outlasts it)."""
    for row, ids in zip(rows, stop_ids, strict=True):
        if not ids:
            continue
        index = torch.tensor(ids)
        allowed = ~torch.isneginf(logits[row])
        if int(allowed.sum()) > int(allowed[index].sum()):
            logits[row, index] = float("-inf")
