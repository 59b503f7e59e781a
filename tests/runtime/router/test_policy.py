"""Routing policies and the router's prefix index: pure, synchronous, exact decisions."""

from __future__ import annotations

import pytest

from runtime.errors import InvalidRequestError
from runtime.router.config import PolicyConfig
from runtime.router.policy import CacheAware, ConsistentHash, NoWorkerError, make_policy
from runtime.router.prefix_index import PrefixIndex
from runtime.router.routing_key import IDS_TAG, TEXT_TAG, routing_key, text_key


def test_prefix_index_matches_inserted_prefixes_and_evicts_lru_at_capacity() -> None:
    index = PrefixIndex(capacity=10)
    assert index.insert([1, 2, 3, 4]) == 0
    assert index.insert([1, 2, 3, 9]) == 3
    assert index.match_len([1, 2, 3, 4, 5]) == 4 and index.match_len([1, 2, 7]) == 2
    assert index.num_symbols == 5
    index.insert([5, 6, 7, 8, 9])  # 10 symbols: full
    index.insert([1, 2, 3, 4])  # refresh [1 2 3 4]: [.. 9] is now the least recently used leaf
    index.insert([7, 7])  # needs 2: evicts the [9] leaf, then the LRU leaf [5 6 7 8 9]
    assert index.match_len([1, 2, 3, 9]) == 3
    assert index.match_len([5, 6, 7, 8, 9]) == 0
    assert index.match_len([1, 2, 3, 4]) == 4 and index.match_len([7, 7]) == 2
    index.check_integrity()


def test_prefix_index_keeps_the_head_of_a_key_longer_than_its_capacity() -> None:
    index = PrefixIndex(capacity=4)
    index.insert([1, 2, 3, 4, 5, 6])
    assert index.match_len([1, 2, 3, 4, 5, 6]) == 4
    index.check_integrity()


def test_match_len_is_a_read_that_does_not_refresh_lru() -> None:
    index = PrefixIndex(capacity=4)
    index.insert([1, 1])
    index.insert([2, 2])
    assert index.match_len([1, 1]) == 2  # a look-up must not save [1 1] from eviction
    index.insert([3, 3])
    assert index.match_len([1, 1]) == 0 and index.match_len([2, 2]) == 2


def test_routing_keys_by_route() -> None:
    assert routing_key("/generate", {"text": "ab"}) == [TEXT_TAG, 97, 98]
    assert routing_key("/generate", {"input_ids": [5, 6]}) == [IDS_TAG, 5, 6]
    assert routing_key("/v1/completions", {"prompt": ["xy", "z"]}) == text_key("xy")
    assert routing_key("/v1/completions", {"prompt": [[3, 4]]}) == [IDS_TAG, 3, 4]
    chat = routing_key("/v1/chat/completions", {"messages": [{"role": "system", "content": "S"},
                                                             {"role": "user", "content": "q"}]})
    assert chat == text_key("<system>S<user>q")
    assert routing_key("/programs/p", {"arguments": {"b": 1, "a": 2}}) == text_key('/programs/p\n{"a":2,"b":1}')
    assert routing_key("/v1/models", None) is None and routing_key("/generate", ["not", "a dict"]) is None
    assert routing_key("/generate", {"text": ""}) is None


def test_cache_aware_follows_the_prefix_then_balances() -> None:
    policy = make_policy(PolicyConfig(balance_abs_threshold=2, balance_rel_threshold=1.5), 3)
    sys_a, sys_b = text_key("A" * 50), text_key("B" * 50)
    loads = [0, 0, 0]
    first = policy.route(sys_a + [1], loads, [0, 1, 2])
    assert (first.worker, first.reason, first.matched_len) == (0, "least_load", 0)
    loads[0] = 1
    other = policy.route(sys_b + [1], loads, [0, 1, 2])
    assert (other.worker, other.reason) == (1, "least_load")  # a new prefix goes to the least loaded
    again = policy.route(sys_a + [2], loads, [0, 1, 2])
    assert (again.worker, again.reason, again.matched_len) == (0, "prefix", 51)
    loads[0] = 3  # 3 - 0 <= 2 is false and 3 > 1.5 * 0: overloaded
    balanced = policy.route(sys_a + [3], loads, [0, 1, 2])
    assert (balanced.worker, balanced.reason) == (2, "balance")  # least loaded, then emptiest index
    loads = [3, 2, 4]  # both 0 and 2 hold the prefix now: the less loaded one, 0
    assert policy.route(sys_a + [4], loads, [0, 1, 2]).worker == 0  # 3 - 2 <= 2: no balancing


def test_cache_aware_ignores_a_short_match_and_skips_unhealthy_workers() -> None:
    policy = make_policy(PolicyConfig(cache_threshold=0.5), 2)
    policy.route([1, 2, 3, 4], [0, 0], [0, 1])  # worker 0
    short = policy.route([1, 9, 9, 9, 9], [0, 5], [0, 1])
    assert (short.worker, short.reason) == (0, "least_load")  # 1/5 matched < 0.5: least loaded
    assert policy.route([1, 2, 3, 4], [0, 0], [1]).worker == 1
    with pytest.raises(NoWorkerError):
        policy.route([1], [0, 0], [])


def test_cache_aware_forgets_a_worker_that_went_down() -> None:
    policy = make_policy(PolicyConfig(), 2)
    assert isinstance(policy, CacheAware)
    policy.route([7] * 10, [0, 0], [0, 1])
    policy.forget(0)
    assert policy.indexes[0].match_len([7] * 10) == 0


def test_round_robin_least_load_and_consistent_hash() -> None:
    rr = make_policy(PolicyConfig(policy="round_robin"), 3)
    assert [rr.route([1], [0, 0, 0], [0, 1, 2]).worker for _ in range(4)] == [0, 1, 2, 0]
    ll = make_policy(PolicyConfig(policy="least_load"), 3)
    assert ll.route([1], [4, 1, 2], [0, 1, 2]).worker == 1
    assert ll.route([1], [4, 1, 2], [0, 2]).worker == 2
    ch = make_policy(PolicyConfig(policy="consistent_hash", hash_prefix_len=4), 8)
    assert isinstance(ch, ConsistentHash)
    owner = ch.route([1, 2, 3, 4, 99], [0] * 8, range(8)).worker
    assert ch.route([1, 2, 3, 4, 5, 6], [0] * 8, range(8)).worker == owner  # same hashed prefix
    others = [w for w in range(8) if w != owner]
    assert ch.route([1, 2, 3, 4], [0] * 8, others).worker != owner
    spread = {ch.route([k, 0, 0, 0], [0] * 8, range(8)).worker for k in range(200)}
    assert spread == set(range(8))


def test_bad_policy_settings_are_refused() -> None:
    with pytest.raises(InvalidRequestError, match="policy must be one of"):
        PolicyConfig(policy="random")  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="cache_threshold"):
        PolicyConfig(cache_threshold=1.5)
    with pytest.raises(ValueError, match="capacity"):
        PrefixIndex(0)


def test_namespaced_keys_follow_the_workers_cache_namespaces() -> None:
    from runtime.router.routing_key import NAMESPACE_TAG, namespaced_key

    body = {"prompt": "ab"}
    assert namespaced_key("/v1/completions", body, {}) == text_key("ab")  # anonymous: the plain key
    tenant_a = namespaced_key("/v1/completions", body, {"x-tenant": "a"})
    assert tenant_a is not None and tenant_a[0] == NAMESPACE_TAG and tenant_a[-3:] == text_key("ab")
    assert namespaced_key("/v1/completions", {**body, "user": "a"}, {}) == tenant_a
    assert namespaced_key("/v1/completions", {**body, "user": "b"}, {"x-tenant": "a"}) == tenant_a  # header wins
    assert namespaced_key("/v1/messages", {"messages": [{"role": "user", "content": "ab"}],
                                           "metadata": {"user_id": "a"}}, {}) is None  # no key for the route
    salted = namespaced_key("/v1/completions", {**body, "cache_salt": "s"}, {"x-tenant": "a"})
    assert salted not in (tenant_a, None)
    # Shared across tenants: a tenant alone is no namespace, a salt still is.
    assert namespaced_key("/v1/completions", body, {"x-tenant": "a"}, share_across_tenants=True) == text_key("ab")
    assert namespaced_key("/v1/completions", {**body, "cache_salt": "s"}, {"x-tenant": "b"}, True) == \
        namespaced_key("/v1/completions", {**body, "cache_salt": "s"}, {"x-tenant": "a"}, True)
    # A salt the worker refuses gives the plain key (the worker answers 400 anyway).
    assert namespaced_key("/v1/completions", {**body, "cache_salt": ""}, {}) == text_key("ab")
    # Another namespace's key matches none of the prompt: at most the namespaces' shared
    # head (here '["a'), as the kind tag ends each namespace.
    index = PrefixIndex(1000)
    index.insert(tenant_a)
    longer = namespaced_key("/v1/completions", body, {"x-tenant": "aa"})
    assert longer is not None and index.match_len(longer) == len([NAMESPACE_TAG, *'["a'])
    assert index.match_len(tenant_a) == len(tenant_a)
