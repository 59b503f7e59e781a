"""Version labels: which model and which engine configuration answered.

Every HTTP answer carries ``X-Arbor-Model`` (the served model name) and
``X-Arbor-Config-Version`` (``EngineConfig.version()``: a hash of every engine setting),
and every Prometheus sample carries them as the labels ``model`` and ``config_version``,
so a canary and its baseline can be told apart in logs, dashboards and benchmarks
(``benchmarks/bench_serving.py --compare`` reads the headers).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import Metric
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

MODEL_HEADER = "X-Arbor-Model"
CONFIG_HEADER = "X-Arbor-Config-Version"


@dataclass(frozen=True)
class VersionLabels:
    model: str  # the served model name (the first of them)
    config_version: str  # EngineConfig.version()

    def headers(self) -> list[tuple[bytes, bytes]]:
        return [(MODEL_HEADER.lower().encode(), _header_value(self.model)),
                (CONFIG_HEADER.lower().encode(), self.config_version.encode())]

    def labels(self) -> dict[str, str]:
        return {"model": self.model, "config_version": self.config_version}


def _header_value(text: str) -> bytes:
    """Header-safe bytes (a model path may hold any character)."""
    return text.encode("latin-1", "replace").replace(b"\r", b"?").replace(b"\n", b"?")


class VersionHeadersMiddleware:
    """Adds the two version headers to every HTTP answer (errors and streams included)."""

    def __init__(self, app: ASGIApp, versions: VersionLabels) -> None:
        self.app = app
        self.extra = versions.headers()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_labelled(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *self.extra]}
            await send(message)

        await self.app(scope, receive, send_labelled)


class LabelledView(Collector):
    """A registry's metrics with ``labels`` added to every sample (for ``generate_latest``)."""

    def __init__(self, registry: Any, labels: dict[str, str]) -> None:
        self.registry = registry
        self.labels = labels

    def collect(self) -> Iterator[Metric]:
        for family in self.registry.collect():
            labelled = Metric(family.name, family.documentation, family.type, family.unit)
            labelled.samples = [s._replace(labels={**s.labels, **self.labels}) for s in family.samples]
            yield labelled
