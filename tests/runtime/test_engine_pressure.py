"""The engine under KV pressure, end to end on a tiny random Llama (CPU, fp32).

64 concurrent greedy requests share a pool far too small for all of them: the scheduler
must retract and resume, and every request must still produce exactly the tokens it
produces when it runs alone. Afterwards the pool is whole again.
"""

from __future__ import annotations

import random
import threading
from pathlib import Path

import pytest

from runtime import Engine, SamplingParams
from runtime.output.request_output import RequestOutput

NUM_REQUESTS = 64
_alone: list[list[list[int]]] = []  # outputs of each request run alone (computed once)


def workload() -> tuple[list[list[int]], list[SamplingParams]]:
    """64 prompts (4-40 tokens, a third sharing a 24-token stem) with 6-24 new tokens."""
    rng = random.Random(0)
    stem = [rng.randrange(3, 49152) for _ in range(24)]
    prompts, params = [], []
    for i in range(NUM_REQUESTS):
        own = [rng.randrange(3, 49152) for _ in range(rng.randint(4, 16))]
        prompts.append(stem + own if i % 3 == 0 else own + [rng.randrange(3, 49152)] * rng.randint(0, 24))
        params.append(SamplingParams(max_new_tokens=rng.randint(6, 24), temperature=0.0,
                                     ignore_eos=True))
    return prompts, params


def run_alone(model_dir: Path) -> list[list[int]]:
    """Each request on its own, one after another, in a roomy pool without a prefix cache."""
    if not _alone:
        prompts, params = workload()
        with Engine(model=str(model_dir), page_size=1, num_pages=4096, num_threads=1,
                    disable_prefix_cache=True) as engine:
            _alone.append([engine.generate(input_ids=p, sampling_params=sp)[0].token_ids
                           for p, sp in zip(prompts, params, strict=True)])
    return _alone[0]


# Pools of 160 tokens and 176 tokens for ~64 x 40 tokens of demand. The decode reserve is
# off so that admission is optimistic and decode runs out of pages (retraction).
@pytest.mark.parametrize(("page_size", "num_pages", "reserve"),
                         [pytest.param(1, 161, 0, marks=pytest.mark.slow), (16, 12, 0)])
def test_concurrent_requests_under_pressure_match_alone(
    tiny_llama_dir: Path, page_size: int, num_pages: int, reserve: int
) -> None:
    prompts, params = workload()
    alone = run_alone(tiny_llama_dir)
    assert len({tuple(t) for t in alone}) > NUM_REQUESTS // 2  # outputs are diverse
    with Engine(model=str(tiny_llama_dir), page_size=page_size, num_pages=num_pages,
                decode_reserve_tokens=reserve, num_threads=1, debug=True) as engine:
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        assert [o.token_ids for o in outs] == alone
        assert all(o.finish_reason == "length" for o in outs)
        assert engine.wait_idle()
        engine.check_integrity()
        m = engine.metrics()
        assert m["num_retractions"] > 0
        assert (m["kv_pages_used"], m["num_running"], m["num_waiting"]) == (0, 0, 0)
        assert m["kv_pages_total"] == num_pages - 1
        assert m["num_finished"] == NUM_REQUESTS
        engine.cache.evict(num_pages)
        assert engine.pool.num_free_pages == num_pages - 1


def test_aborts_under_pressure_free_pages_and_leave_others_exact(tiny_llama_dir: Path) -> None:
    # Every 4th request is aborted from its own callback once it has 2 tokens (mid-decode,
    # possibly retracted or waiting again by the time the abort lands).
    prompts, params = workload()
    alone = run_alone(tiny_llama_dir)
    finals: dict[int, RequestOutput] = {}
    done = threading.Event()
    with Engine(model=str(tiny_llama_dir), page_size=4, num_pages=41, decode_reserve_tokens=0,
                num_threads=1, debug=True) as engine:
        rids: dict[str, int] = {}

        def on_output(out: RequestOutput) -> None:
            i = rids[out.request_id]
            if out.finished:
                finals[i] = out
                if len(finals) == NUM_REQUESTS:
                    done.set()
            elif i % 4 == 0 and len(out.token_ids) == 2:
                engine.abort(out.request_id)

        for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
            rids[f"r{i}"] = i
            engine.add_request(input_ids=p, params=sp, request_id=f"r{i}", callback=on_output)
        assert done.wait(timeout=120)
        for i, out in sorted(finals.items()):
            if i % 4 == 0:
                assert out.finish_reason == "abort" and out.token_ids == alone[i][: len(out.token_ids)]
            else:
                assert out.finish_reason == "length" and out.token_ids == alone[i]
        assert engine.wait_idle()
        engine.check_integrity()
        m = engine.metrics()
        assert (m["num_aborts"], m["kv_pages_used"], m["num_running"]) == (NUM_REQUESTS // 4, 0, 0)
        assert m["num_retractions"] > 0


def test_metrics_cache_hit_rate(tiny_llama_dir: Path) -> None:
    first = list(range(1000, 1020))
    second = first[:16] + [7, 8, 9, 10]
    params = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
    rates = {}
    for disable in (False, True):
        with Engine(model=str(tiny_llama_dir), page_size=1, num_pages=256, num_threads=1,
                    disable_prefix_cache=disable) as engine:
            m = engine.metrics()
            assert {"cache_hit_rate", "num_running", "num_waiting", "kv_pages_used",
                    "kv_pages_total"} <= set(m)
            assert (m["kv_pages_total"], m["kv_pages_used"], m["cache_hit_rate"]) == (255, 0, 0.0)
            engine.generate(input_ids=first, sampling_params=params)
            out = engine.generate(input_ids=second, sampling_params=params)[0]
            assert engine.wait_idle()
            m = engine.metrics()
            rates[disable] = m["cache_hit_rate"]
            assert out.num_cached_tokens == (0 if disable else 16)
            assert m["prompt_tokens"] == 40 and m["kv_pages_used"] == 0
    assert rates == {False: 16 / 40, True: 0.0}


def test_request_that_fills_the_pool_alone_is_served(tiny_llama_dir: Path) -> None:
    # Regression: with the default 16-token decode reserve, an 8-token prompt in a 9-page
    # pool was never admitted (8 + 16 > 9) and the engine spun forever. max_model_len is the
    # pool's capacity (9), so the request stops after one token.
    with Engine(model=str(tiny_llama_dir), page_size=1, num_pages=10, num_threads=1) as engine:
        assert engine.max_model_len == 9
        done: list[object] = []
        engine.add_request(input_ids=list(range(100, 108)), callback=done.append,
                           params=SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True))
        assert engine.wait_idle(timeout=20), "the request was never admitted"
        assert len(done) == 1 and engine.metrics()["kv_pages_used"] == 0
