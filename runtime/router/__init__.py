"""Data parallelism: a cache-aware router in front of independent engine workers.

    routing_key   what of a request is compared for prefix reuse (text code points or ids)
    prefix_index  the router's picture of one worker's cache (a capacity-bound RadixTree)
    policy        cache_aware / round_robin / least_load / consistent_hash (torch-free,
                  synchronous: the simulator ``benchmarks/sim_router.py`` runs it too)
    workers       health probes, load, taking workers out and back
    proxy, app    the HTTP front (``create_router_app``); ``metrics`` its /metrics
    launch        ``arbor router --workers URL ...`` and ``arbor serve --dp N``

Rollouts (``docs/rollouts.md``; the core torch-free and clock-injectable):

    pools          named pools, sticky keys, the bucket -> pool choice
    rollout_plan   the plan file (steps, match, sticky, gates, shadow), checked at start
    gates          sliding windows and gate verdicts with minimum sample counts
    rollout        the state machine (advance, roll back, promote, pause, set weight)
    rollout_store  its SQLite state and event log
    shadow         the live quality replay (a bounded queue; ``runtime.eval.compare``)
    shadow_answers what a pair compares per route (token ids, token texts or text)
    split_metrics  router metrics by pool / model / config version / tenant / entry / context
    canary         the rollout inside the router (routing, checks, rollout metrics)
    rollout_cli    ``arbor rollout status|promote|rollback|pause|resume|weight``
    ui             ``GET /ui``: the rollout page (static HTML + JS over ``GET /rollout``'s JSON)
"""
