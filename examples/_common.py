"""Shared by the examples: the backend to run on."""

from __future__ import annotations

from typing import Any


def default_engine(engine: Any = None) -> Any:
    """``engine`` if given, else a fresh ``runtime.Engine`` on the default model."""
    if engine is not None:
        return engine
    from runtime import Engine

    return Engine(model="default")
