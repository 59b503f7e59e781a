"""``/metrics``: Prometheus text from a registry per app."""

from __future__ import annotations

from typing import Any

from server_helpers import samples

from runtime.server import create_app


def test_metrics_report_latencies_engine_state_and_errors(http: Any) -> None:
    gen = (("endpoint", "generate"), ("prompt_bucket", "0-128"), ("tenant", "none"))
    keys = [("arbor_time_to_first_token_seconds_count", gen), ("arbor_inter_token_latency_seconds_count", gen),
            ("arbor_e2e_request_latency_seconds_count", gen),
            ("arbor_errors_total", (("kind", "invalid_request_error"),))]
    before = samples(http.get("/metrics").text)  # NOTE: the app is shared: count what this test adds
    assert http.post("/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 3, "ignore_eos": True,
                                                                          "temperature": 0}}).status_code == 200
    assert http.post("/generate", json={"text": "Hi", "sampling_params": {"temperature": -1}}).status_code == 400
    got = samples(http.get("/metrics").text)
    added = [got[k] - before.get(k, 0.0) for k in keys]
    assert added == [1, 2, 1, 1]  # one first token, two gaps between three tokens, one end, one error
    assert got[("arbor_kv_pages_total", ())] > 0
    for name in ("arbor_num_requests_running", "arbor_num_requests_waiting", "arbor_kv_cache_usage_ratio",
                 "arbor_prefix_cache_hit_rate", "arbor_spec_acceptance_rate", "arbor_server_requests_inflight"):
        assert (name, ()) in got, name


def test_each_app_has_its_own_registry(engine: Any) -> None:
    first, second = create_app(engine), create_app(engine)
    assert first.state.ctx.metrics.registry is not second.state.ctx.metrics.registry
