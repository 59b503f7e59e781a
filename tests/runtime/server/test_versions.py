"""Version labels: every answer and every metric sample says which model and which engine
configuration served it."""

from __future__ import annotations

from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from runtime.config import EngineConfig


def test_every_answer_carries_model_and_config_version(http: Any, engine: Any) -> None:
    version = engine.config.version()
    answers = [
        http.post("/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 2}}),
        http.post("/generate", json={"text": "Hi", "sampling_params": {"temperature": -1}}),  # 400
        http.post("/generate", content=b"x" * 300_000),  # 413 from middleware
        http.get("/v1/models", headers={"Authorization": "Bearer wrong"}),  # 401 from middleware
        http.get("/health"),
        http.get("/metrics"),
    ]
    with http.stream("POST", "/generate", json={"text": "Hi", "stream": True,
                                                "sampling_params": {"max_new_tokens": 2}}) as stream:
        answers.append(stream)
    assert [a.status_code for a in answers] == [200, 400, 413, 401, 200, 200, 200]
    for a in answers:
        assert a.headers["X-Arbor-Model"] == "m"
        assert a.headers["X-Arbor-Config-Version"] == version


def test_every_metric_sample_carries_the_version_labels(http: Any, engine: Any) -> None:
    http.post("/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 2}})
    families = list(text_string_to_metric_families(http.get("/metrics").text))
    assert len(families) > 10
    for family in families:
        for sample in family.samples:
            assert sample.labels["model"] == "m", sample
            assert sample.labels["config_version"] == engine.config.version(), sample


def test_config_version_changes_with_any_setting() -> None:
    base = EngineConfig()
    assert base.version() == EngineConfig().version() and len(base.version()) == 12
    assert EngineConfig(page_size=16).version() != base.version()
    assert EngineConfig(fair_scheduling=False).version() != base.version()
