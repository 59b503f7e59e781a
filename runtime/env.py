"""Every environment variable Arbor reads, read here and nowhere else."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Where converted models and downloaded wheels live (``ARBOR_CACHE_DIR``)."""
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "arbor"
    return Path(os.environ.get("ARBOR_CACHE_DIR", default))


def default_gguf_path() -> Path | None:
    """An explicit GGUF file for the default model (``ARBOR_DEFAULT_GGUF``), if set."""
    value = os.environ.get("ARBOR_DEFAULT_GGUF")
    return Path(value) if value else None


def debug_enabled() -> bool:
    """``ARBOR_DEBUG=1`` runs integrity checks whenever the engine goes idle."""
    return os.environ.get("ARBOR_DEBUG", "") not in ("", "0", "false")


def step_trace_path() -> Path | None:
    """``ARBOR_STEP_TRACE=FILE``: the engine appends one JSON line per step to FILE (its
    rows, the step's wall time and the cost model's prediction), to find where a latency tail
    comes from."""
    value = os.environ.get("ARBOR_STEP_TRACE")
    return Path(value) if value else None
