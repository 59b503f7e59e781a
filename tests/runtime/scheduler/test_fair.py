"""Fair scheduling: priority classes (interactive before batch, preempting it when the
running batch is full) and tenants taking turns for the running slots."""

from __future__ import annotations

from sim import Sim

from runtime.cache.page_pool import PagePool
from runtime.cache.radix_tree import RadixTree
from runtime.request import Request, RequestStatus
from runtime.sampling.params import SamplingParams
from runtime.scheduler.policy import FairPolicy, FCFSPolicy, make_policy


def _req(rid: str, arrival: int, tenant: str | None = None, priority: str = "interactive") -> Request:
    r = Request(rid, [1, 2, 3], SamplingParams(max_new_tokens=4), tenant=tenant, priority=priority)  # type: ignore[arg-type]
    r.arrival = arrival
    return r


def test_tenants_take_turns_fewest_running_slots_first() -> None:
    cache = RadixTree(PagePool(64, 1))
    waiting = [_req("a1", 0, "A"), _req("a2", 1, "A"), _req("a3", 2, "A"), _req("b1", 3, "B"), _req("b2", 4, "B")]
    running = [_req("a0", -1, "A")]
    order = FairPolicy(FCFSPolicy()).order(waiting, cache, running)
    # B holds no slot, A one: B first, then they alternate (A's turn on a tie: its head is older).
    assert [r.request_id for r in order] == ["b1", "a1", "b2", "a2", "a3"]
    assert [r.request_id for r in FCFSPolicy().order(waiting, cache, running)] == ["a1", "a2", "a3", "b1", "b2"]


def test_interactive_before_batch_whatever_the_tenant() -> None:
    cache = RadixTree(PagePool(64, 1))
    waiting = [_req("x1", 0, "A", "batch"), _req("x2", 1, "A", "batch"), _req("i1", 2, "B")]
    assert [r.request_id for r in FairPolicy(FCFSPolicy()).order(waiting, cache)] == ["i1", "x1", "x2"]


def test_one_tenant_one_class_orders_as_the_base_policy() -> None:
    cache = RadixTree(PagePool(64, 1))
    waiting = [_req(f"r{i}", a) for i, a in enumerate([3, 1, 2, 0])]
    assert (FairPolicy(FCFSPolicy()).order(waiting, cache)
            == FCFSPolicy().order(waiting, cache))


def test_interactive_request_takes_the_newest_batch_slot_when_the_batch_is_full() -> None:
    sim = Sim(num_pages=512, max_running=2, max_prefill_tokens=64, fair=True)
    b1 = sim.add("b1", [1] * 8, 50, tenant="A", priority="batch")
    b2 = sim.add("b2", [2] * 8, 50, tenant="A", priority="batch")
    sim.step()
    sim.step()
    assert b1.status == b2.status == RequestStatus.RUNNING
    i1 = sim.add("i1", [3] * 8, 3, tenant="B")
    batch = sim.step()
    assert [r.request_id for r in batch.retracted] == ["b2"]
    assert i1.status == RequestStatus.RUNNING and b2.status == RequestStatus.WAITING
    sim.run()
    assert [r.request_id for r in sim.finished][0] == "i1"
    assert len(b2.output_ids) == 50  # resumed and finished whole


def test_without_fair_scheduling_the_interactive_request_waits_for_a_slot() -> None:
    sim = Sim(num_pages=512, max_running=2, max_prefill_tokens=64, fair=False)
    sim.add("b1", [1] * 8, 20, tenant="A", priority="batch")
    sim.add("b2", [2] * 8, 20, tenant="A", priority="batch")
    sim.step()
    i1 = sim.add("i1", [3] * 8, 3, tenant="B")
    for _ in range(10):
        sim.step()
        assert i1.status == RequestStatus.WAITING


def test_interactive_prefill_goes_before_a_batch_prefill_in_chunks() -> None:
    # A batch request prefilling a long prompt in chunks of 8 does not hold back an
    # interactive prompt: the interactive one takes the step's budget first.
    sim = Sim(num_pages=512, max_running=8, max_prefill_tokens=8, fair=True)
    long = sim.add("long", list(range(10, 74)), 4, tenant="A", priority="batch")
    sim.step()
    assert long.num_computed == 8
    i1 = sim.add("i1", list(range(100, 106)), 2, tenant="B")
    batch = sim.step()
    assert [item.request.request_id for item in batch.prefill][0] == "i1"
    assert i1.num_computed == 6


def test_make_policy_wraps_the_base_when_fair() -> None:
    assert isinstance(make_policy("lpm", fair=True), FairPolicy)
    assert isinstance(make_policy("fcfs"), FCFSPolicy)


def test_interactive_prefill_step_is_whole_and_carries_no_batch_work() -> None:
    sim = Sim(num_pages=1024, max_running=8, max_prefill_tokens=256, chunked_prefill_size=8, fair=True)
    b1 = sim.add("b1", [1] * 4, 50, tenant="A", priority="batch")
    sim.step()
    sim.step()  # b1 decodes now
    long_batch = sim.add("b2", list(range(10, 74)), 4, tenant="A", priority="batch")
    interactive = sim.add("i1", list(range(100, 160)), 4, tenant="B")
    outputs_before = len(b1.output_ids)
    batch = sim.step()
    assert interactive.num_computed == 60  # whole, in one step: only batch work decodes
    assert [i.request.request_id for i in batch.prefill] == ["i1"] and batch.decode == []
    assert len(b1.output_ids) == outputs_before and long_batch.num_computed == 0  # batch waits a step
    batch = sim.step()  # i1 decodes now: batch work resumes, its prompt in small chunks
    assert long_batch.num_computed == 8 and len(b1.output_ids) == outputs_before + 1
    assert {r.request_id for r in batch.decode} == {"b1", "i1"}
