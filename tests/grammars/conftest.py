"""Fixtures for the grammar front-end tests."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _prefer_project_packages() -> None:
    """Put the repository root first on ``sys.path`` and drop namespace-package shadows.

    The editable install may still list ``grammars`` as a namespace package (it was
    installed before ``grammars/__init__.py`` existed); importing it that way skips
    ``__init__`` and loses the public names.
    """
    if sys.path[:1] != [str(ROOT)]:
        sys.path.insert(0, str(ROOT))
    for name in ("grammars", "runtime"):
        module = sys.modules.get(name)
        if module is not None and getattr(module, "__file__", None) is None:
            del sys.modules[name]


_prefer_project_packages()
