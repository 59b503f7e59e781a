"""The shadow comparison of two answers, and the bounded shadow queue."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import pytest
import torch

from runtime.eval.replay import greedy_match, mean_kl
from runtime.eval.targets import Generation, PositionDists
from runtime.router.rollout_plan import ShadowSettings
from runtime.router.shadow import PairComparison, ShadowJob, ShadowRunner, compare_pair
from runtime.router.shadow_answers import shadowable

GREEDY = {"text": "x", "sampling_params": {"temperature": 0.0, "top_logprobs": 3}}


def answer(ids: list[int], tops: list[dict[int, float]] | None = None, valid: bool | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"prompt_tokens": 3, "completion_tokens": len(ids), "cached_tokens": 0}
    if tops is not None:
        meta["top_logprobs"] = [{str(t): lp for t, lp in top.items()} for top in tops]
    if valid is not None:
        meta["constraint_check"] = {"valid": valid, "checked": True}
    return {"text": "", "output_ids": ids, "finish_reason": "length", "meta": meta}


def top(*pairs: tuple[int, float]) -> dict[int, float]:
    return dict(pairs)


def test_identical_greedy_answers_match_exactly() -> None:
    tops = [top((5, -0.1), (6, -2.5)), top((7, -0.2), (8, -1.9))]
    pair = compare_pair(GREEDY, answer([5, 7], tops, valid=True), answer([5, 7], tops, valid=True))
    assert pair == PairComparison(True, True, None, 1.0, True, True, 1.0, 0.0, 2, "ids")


def test_divergence_length_validity_and_kl_over_the_shared_positions() -> None:
    base_tops = [top((5, -0.1), (6, -2.5)), top((7, -0.3), (8, -1.5)), top((9, -0.1), (1, -3.0))]
    cand_tops = [top((5, -0.2), (6, -1.8)), top((8, -0.4), (7, -1.2)), top((2, -0.1), (3, -3.0))]
    pair = compare_pair(GREEDY, answer([5, 7, 9], base_tops, valid=True), answer([5, 8, 2, 3], cand_tops, valid=False))
    assert (pair.exact, pair.first_divergence, pair.kl_positions) == (False, 1, 2)
    assert (pair.base_valid, pair.cand_valid) == (True, False)
    assert pair.length_ratio == pytest.approx(4 / 3) and pair.prefix_share == pytest.approx(1 / 3)
    # NOTE: the same figure ``arbor eval`` computes from the same top-k (its server path)
    dists = [PositionDists(torch.tensor([list(t) for t in tops[:2]]), torch.tensor([list(t.values()) for t in tops[:2]]),
                           None) for tops in (base_tops, cand_tops)]
    eval_kl, method = mean_kl(dists[0], dists[1])
    assert method == "top-2" and pair.kl == pytest.approx(eval_kl)
    by_hand = (math.exp(-0.1) * (-0.1 + 0.2) + math.exp(-2.5) * (-2.5 + 1.8)
               + math.exp(-0.3) * (-0.3 + 1.2) + math.exp(-1.5) * (-1.5 + 0.4)) / 2
    assert pair.kl == pytest.approx(by_hand)
    same, prefix = greedy_match([Generation([5, 7, 9], "")], [Generation([5, 8, 2, 3], "")])
    assert (same, prefix) == (0.0, pair.prefix_share)


def test_sampled_requests_and_answers_without_logprobs() -> None:
    pair = compare_pair({"text": "x"}, answer([1, 2]), answer([1, 2]))
    assert (pair.greedy, pair.exact, pair.kl, pair.base_valid) == (False, True, None, None)


def test_the_shadow_queue_is_capped_and_yields_to_users() -> None:
    async def run() -> tuple[dict[str, int], list[PairComparison]]:
        gate = asyncio.Event()
        users = [0]
        pairs: list[PairComparison] = []

        async def send(job: ShadowJob) -> dict[str, Any] | None:
            await gate.wait()
            return answer([1, 2])

        runner = ShadowRunner(ShadowSettings(share=0.5, queue_cap=2, max_user_inflight=3), send, pairs.append,
                              lambda: users[0])
        assert [runner.wants() for _ in range(6)] == [False, True, False, True, False, True]
        runner.start()
        job = ShadowJob("/generate", GREEDY, [], answer([1, 2]))
        runner.offer(job)
        await asyncio.sleep(0.01)  # NOTE: the first job is taken (and waits on the gate)
        assert runner.offer(job) and runner.offer(job) and not runner.offer(job)  # cap 2
        users[0] = 4
        assert not runner.offer(job)  # users above max_user_inflight: dropped first
        users[0] = 0
        gate.set()
        await runner.drain()
        await runner.stop()
        return dict(runner.counts), pairs

    counts, pairs = asyncio.run(run())
    assert counts == {"offered": 5, "sent": 3, "compared": 3, "dropped_full": 1, "dropped_load": 1}
    assert len(pairs) == 3 and all(p.exact for p in pairs)


# --- OpenAI answers ----------------------------------------------------------------------------

def completion(ids: list[int], tops: list[dict[int, float]] | None = None, as_ids: bool = True,
               valid: bool | None = None) -> dict[str, Any]:
    """A ``/v1/completions`` answer; with ``tops``, legacy logprobs (tokens "token_id:N"
    when ``as_ids``, else the text "t<N>")."""
    name = (lambda t: f"token_id:{t}") if as_ids else (lambda t: f"t{t}")
    choice: dict[str, Any] = {"index": 0, "text": "".join(f"t{t}" for t in ids), "finish_reason": "length"}
    if tops is not None:
        choice["logprobs"] = {"tokens": [name(t) for t in ids], "token_logprobs": [-0.1] * len(ids),
                              "top_logprobs": [{name(t): lp for t, lp in top.items()} for top in tops],
                              "text_offset": list(range(len(ids)))}
    if valid is not None:
        choice["constraint_check"] = {"valid": valid, "checked": True}
    return {"object": "text_completion", "choices": [choice]}


def chat(ids: list[int], tops: list[dict[int, float]] | None = None, logprobs: bool = True) -> dict[str, Any]:
    """A ``/v1/chat/completions`` answer whose tokens are the texts "t<N>"."""
    choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": "".join(f"t{t}" for t in ids)},
                              "finish_reason": "length"}
    if logprobs:
        choice["logprobs"] = {"content": [
            {"token": f"t{t}", "logprob": -0.1, "bytes": None,
             "top_logprobs": [{"token": f"t{i}", "logprob": lp, "bytes": None} for i, lp in (top or {}).items()]}
            for t, top in zip(ids, tops or [None] * len(ids), strict=True)]}
    return {"object": "chat.completion", "choices": [choice]}


BASE_TOPS = [top((5, -0.1), (6, -2.5)), top((7, -0.3), (8, -1.5)), top((9, -0.1), (1, -3.0))]
CAND_TOPS = [top((5, -0.2), (6, -1.8)), top((8, -0.4), (7, -1.2)), top((2, -0.1), (3, -3.0))]


def test_openai_answers_are_compared_like_generate_on_the_same_tokens() -> None:
    native = compare_pair(GREEDY, answer([5, 7, 9], BASE_TOPS), answer([5, 8, 2], CAND_TOPS))
    greedy = {"prompt": "x", "temperature": 0, "logprobs": 2, "return_tokens_as_token_ids": True}
    by_ids = compare_pair(greedy, completion([5, 7, 9], BASE_TOPS), completion([5, 8, 2], CAND_TOPS),
                          "/v1/completions")
    assert by_ids == native  # the same ids and top logprobs: the same figures, unit "ids"
    by_text = compare_pair({**greedy, "return_tokens_as_token_ids": False},
                           completion([5, 7, 9], BASE_TOPS, as_ids=False),
                           completion([5, 8, 2], CAND_TOPS, as_ids=False), "/v1/completions")
    assert by_text.unit == "tokens" and by_text.kl == pytest.approx(native.kl)
    assert (by_text.first_divergence, by_text.prefix_share, by_text.exact) == (1, pytest.approx(1 / 3), False)
    msgs = {"messages": [{"role": "user", "content": "x"}], "temperature": 0.0, "logprobs": True, "top_logprobs": 2}
    on_chat = compare_pair(msgs, chat([5, 7, 9], BASE_TOPS), chat([5, 8, 2], CAND_TOPS), "/v1/chat/completions")
    assert on_chat.unit == "tokens" and on_chat.greedy and on_chat.kl == pytest.approx(native.kl)
    assert (on_chat.first_divergence, on_chat.kl_positions) == (1, 2)


def test_openai_answers_without_token_logprobs_compare_their_text() -> None:
    plain = compare_pair({"prompt": "x"}, completion([5, 7]), completion([5, 71]), "/v1/completions")
    # "t5t7" against "t5t71": the candidate's text extends the baseline's
    assert (plain.unit, plain.greedy, plain.exact, plain.first_divergence, plain.kl) == ("text", False, False, None,
                                                                                          None)
    assert plain.prefix_share == 1.0 and plain.length_ratio == pytest.approx(5 / 4)
    msgs = {"messages": [], "temperature": 0}
    same = compare_pair(msgs, chat([1, 2], logprobs=False), chat([1, 2], logprobs=False), "/v1/chat/completions")
    assert (same.unit, same.greedy, same.exact) == ("text", True, True)
    # chosen-token logprobs without top_logprobs: tokens compared, no KL
    no_tops = compare_pair(msgs, chat([1, 2]), chat([1, 3]), "/v1/chat/completions")
    assert (no_tops.unit, no_tops.first_divergence, no_tops.kl) == ("tokens", 1, None)


def test_chat_tool_calls_compare_what_was_called_not_the_call_id() -> None:
    def called(call_id: str, city: str) -> dict[str, Any]:
        call = {"id": call_id, "type": "function", "function": {"name": "weather", "arguments": f'{{"city": "{city}"}}'}}
        return {"choices": [{"index": 0, "message": {"role": "assistant", "content": None, "tool_calls": [call]},
                             "finish_reason": "tool_calls"}]}

    msgs = {"messages": [], "temperature": 0}
    assert compare_pair(msgs, called("call_a", "Paris"), called("call_b", "Paris"), "/v1/chat/completions").exact
    assert not compare_pair(msgs, called("call_a", "Paris"), called("call_a", "Rome"), "/v1/chat/completions").exact


def test_openai_constraint_validity_and_what_can_be_shadowed() -> None:
    pair = compare_pair({"prompt": "x"}, completion([1], valid=True), completion([1], valid=False), "/v1/completions")
    assert (pair.base_valid, pair.cand_valid) == (True, False)
    assert shadowable("/v1/chat/completions", {"messages": []}) and shadowable("/generate", {"text": "x"})
    assert not shadowable("/v1/chat/completions", {"messages": [], "stream": True})
    assert not shadowable("/v1/completions", {"prompt": "x", "echo": True})  # the prompt would count as output
    assert not shadowable("/programs/qa", {"arguments": {}})
    with pytest.raises(IndexError):  # an answer of another shape: the runner counts the job failed
        compare_pair({}, {"choices": []}, completion([1]), "/v1/completions")
