"""Sampling settings that would do nothing are refused at construction."""

from __future__ import annotations

import pytest

from runtime import InvalidRequestError, SamplingParams


def test_logprob_start_len_needs_prompt_logprobs() -> None:
    assert SamplingParams(prompt_logprobs=True, logprob_start_len=3).logprob_start_len == 3
    with pytest.raises(InvalidRequestError,
                       match="logprob_start_len applies only with prompt_logprobs=True"):
        SamplingParams(logprob_start_len=3)
