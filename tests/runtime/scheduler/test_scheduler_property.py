"""Random workloads on random small pools always finish, exactly, with whole pages.

Each example builds a scheduler (page size, pool size, policy, cache on/off, running cap,
prefill budget, decode reserve) and a handful of requests that each fit the pool alone
(prompt + outputs <= capacity, as the engine's max_model_len guarantees), some sharing
prefixes. ``Sim.run`` checks the page identity before and after every step and fails on
a step that schedules nothing while work is left (a livelock). This is the test that
found the decode reserve blocking a request that could only ever run alone.
"""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from sim import Sim, fake_outputs


@st.composite
def workloads(draw: st.DrawFn) -> tuple[Sim, list[Any]]:
    page_size = draw(st.sampled_from([1, 2, 4]))
    usable = draw(st.integers(4, 24))
    sim = Sim(num_pages=usable + 1, page_size=page_size,
              policy=draw(st.sampled_from(["fcfs", "lpm"])),
              prefix_cache=draw(st.booleans()),
              max_running=draw(st.integers(1, 6)),
              max_prefill_tokens=draw(st.integers(1, 20)),
              decode_reserve_tokens=draw(st.sampled_from([0, 2, 16])),
              fair=draw(st.booleans()))
    capacity = usable * page_size
    stem = draw(st.lists(st.integers(1, 3), min_size=capacity, max_size=capacity))
    requests = []
    for _ in range(draw(st.integers(1, 8))):
        prompt_len = draw(st.integers(1, capacity - 1))
        cut = draw(st.integers(0, prompt_len))  # shares stem[:cut]
        prompt = stem[:cut] + draw(st.lists(st.integers(4, 6), min_size=prompt_len - cut,
                                            max_size=prompt_len - cut))
        requests.append((prompt, draw(st.integers(1, capacity - prompt_len)),
                         draw(st.sampled_from([None, "A", "B"])),
                         draw(st.sampled_from(["interactive", "batch"]))))
    return sim, requests


@settings(max_examples=150, deadline=None, derandomize=True)
@given(workloads())
def test_random_workloads_finish_with_whole_pages(case: tuple[Sim, list[Any]]) -> None:
    sim, specs = case
    reqs = [sim.add(f"r{i}", prompt, max_new, tenant=tenant, priority=priority)
            for i, (prompt, max_new, tenant, priority) in enumerate(specs)]
    sim.run(max_steps=2000)
    for req, (_, max_new, _, _) in zip(reqs, specs, strict=True):
        assert req.output_ids == fake_outputs(max_new) and req.finish_reason == "length"
    assert sim.used_pages == 0 and sim.cache.num_locked_pages == 0
    sim.cache.evict(sim.pool.num_usable_pages)
    assert sim.pool.num_free_pages == sim.pool.num_usable_pages
