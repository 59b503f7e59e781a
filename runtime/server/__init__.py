"""HTTP serving: every API family (``api/``: native ``/generate`` and SGLang's protocol,
OpenAI chat / completions / Responses / embeddings, Anthropic Messages, hosted programs),
``/metrics`` and ``/health`` around one engine (``create_app``), and a typed client.

The package splits into the app (``app`` and the families' ``routes`` modules, on FastAPI)
and the parts a client or a program host imports without it: the wire schemas
(``api/<family>/schema.py``, ``api/common/``), the client (``client``) and the hosting protocol for programs (``hosting``). So that importing
those stays light, ``create_app`` and ``ServerLimits`` are loaded here on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from runtime.server.app import create_app
    from runtime.server.limits import ServerLimits

__all__ = ["ServerLimits", "create_app"]

_LAZY = {"create_app": "runtime.server.app", "ServerLimits": "runtime.server.limits"}


def __getattr__(name: str) -> object:
    if name not in _LAZY:
        raise AttributeError(f"module 'runtime.server' has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name]), name)
