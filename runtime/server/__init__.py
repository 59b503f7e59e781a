"""HTTP serving: native ``/generate``, the OpenAI-compatible API, compiled programs,
``/metrics`` and ``/health`` around one engine (``create_app``), and a typed client."""

from runtime.server.app import create_app
from runtime.server.limits import ServerLimits

__all__ = ["ServerLimits", "create_app"]
