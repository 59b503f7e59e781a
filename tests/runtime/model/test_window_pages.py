"""A Mistral whose every layer attends to a 16-token window holds pages for that window,
not for the whole sequence, and still gives transformers' greedy tokens.

Page size 4: the next query at position ``n`` sees ``n - 15 .. n``, pages ``(n - 15) // 4
.. n // 4``: at most 5. Without the prefix cache a request owns every page it uses, so it
holds at most those 5 (plus the chunk being prefilled). With the cache, the prompt's full
pages belong to the cache (locked while the request runs, so a later match is exact);
what the request itself owns while decoding is bounded the same way.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from family_models import hf_greedy
from test_families import WINDOW, _prompt_ids, _save

from runtime import Engine, SamplingParams
from runtime.scheduler.batch import ScheduledBatch

PAGE_SIZE = 4
NEW_TOKENS = 32
WINDOW_PAGES = WINDOW // PAGE_SIZE + 1  # the pages one query's window can touch


@pytest.fixture(scope="module")
def mistral(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    hf_dir = _save("mistral", tmp_path_factory.mktemp("mistral") / "hf")
    ids = _prompt_ids(hf_dir)
    want, _ = hf_greedy(hf_dir, ids, NEW_TOKENS)
    return {"hf_dir": hf_dir, "ids": ids, "want": want}


def _run(hf_dir: Path, ids: list[int], **config: Any) -> tuple[list[int], list[tuple[str, int, int, int]]]:
    """Greedy tokens, and per step and request: (kind, tokens it computes, pages it owns,
    pool pages in use), seen after the step's pages were allocated."""
    seen: list[tuple[str, int, int, int]] = []
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    with Engine(model=str(hf_dir), num_pages=256, page_size=PAGE_SIZE, **config) as engine:
        assert engine.scheduler.window == WINDOW

        def observe(batch: ScheduledBatch) -> None:
            used = engine.pool.num_usable_pages - engine.pool.num_free_pages - engine.cache.num_evictable_pages
            steps = [("prefill", i.request, i.num_tokens) for i in batch.prefill]
            steps += [("decode", r, 1) for r in batch.decode]
            steps += [("verify", v.request, 1 + len(v.draft_ids)) for v in batch.verify]  # prompt-lookup drafts
            seen.extend((kind, n, sum(p != 0 for p in r.own_pages), used) for kind, r, n in steps)

        engine.add_step_hook(observe)
        tokens = engine.generate(input_ids=[ids], sampling_params=params)[0].token_ids
        engine.check_integrity()
    return tokens, seen


def _bound(num_tokens: int) -> int:
    """Pages a step computing ``num_tokens`` new tokens may touch: its queries' windows."""
    return WINDOW_PAGES + -(-(num_tokens - 1) // PAGE_SIZE)


def test_without_the_prefix_cache_pages_stay_within_the_window(mistral: dict[str, Any]) -> None:
    ids = mistral["ids"]
    assert len(ids) // PAGE_SIZE > 2 * WINDOW_PAGES  # the prompt alone would hold many more pages
    tokens, seen = _run(mistral["hf_dir"], ids, disable_prefix_cache=True, chunked_prefill_size=16,
                        max_prefill_tokens=16)
    assert tokens == mistral["want"]
    assert [kind for kind, *_ in seen].count("prefill") == -(-len(ids) // 16)
    assert {kind for kind, *_ in seen} >= {"prefill", "decode"}
    for kind, n, own, used in seen:
        assert own == used <= _bound(n), (kind, n, own, used)


def test_with_the_prefix_cache_decode_pages_stay_within_the_window(mistral: dict[str, Any]) -> None:
    ids = mistral["ids"]
    tokens, seen = _run(mistral["hf_dir"], ids)
    assert tokens == mistral["want"]
    decoding = [(n, own) for kind, n, own, _ in seen if kind != "prefill"]
    assert decoding and all(own <= _bound(n) for n, own in decoding)
    # the prompt's full pages are the cache's, locked while the request runs
    assert all(used <= len(ids) // PAGE_SIZE + _bound(n) for _, n, _, used in seen)


def test_a_second_request_matches_the_cached_prompt_exactly(mistral: dict[str, Any]) -> None:
    """The first request's output pages fell out of its window: the cache keeps its prompt
    only, and a request continuing that output reuses exactly the prompt's whole pages."""
    ids, want = mistral["ids"], mistral["want"]
    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    follow = ids + want[:24]
    follow_want, _ = hf_greedy(mistral["hf_dir"], follow, 8)
    with Engine(model=str(mistral["hf_dir"]), num_pages=256, page_size=PAGE_SIZE) as engine:
        engine.generate(input_ids=[ids], sampling_params=SamplingParams(max_new_tokens=NEW_TOKENS,
                                                                        temperature=0.0, ignore_eos=True))
        second = engine.generate(input_ids=[follow], sampling_params=params)[0]
        engine.check_integrity()
    assert second.token_ids == follow_want
    assert second.num_cached_tokens == len(ids) // PAGE_SIZE * PAGE_SIZE
