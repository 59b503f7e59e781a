"""Data parallelism: a cache-aware router in front of independent engine workers.

    routing_key   what of a request is compared for prefix reuse (text code points or ids)
    prefix_index  the router's picture of one worker's cache (a capacity-bound RadixTree)
    policy        cache_aware / round_robin / least_load / consistent_hash (torch-free,
                  synchronous: the simulator ``benchmarks/sim_router.py`` runs it too)
    workers       health probes, load, taking workers out and back
    proxy, app    the HTTP front (``create_router_app``); ``metrics`` its /metrics
    launch        ``arbor router --workers URL ...`` and ``arbor serve --dp N``
"""
