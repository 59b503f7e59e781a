"""Which backend a program run uses: the one passed as ``backend=``, else the default.

Either may be a ``Backend`` or a ``runtime.Engine``; an engine is wrapped in its
``EngineBackend`` (one per engine, see ``engine_backend.backend_for``).
"""

from __future__ import annotations

from typing import Any

from frontend_dsl.backend import Backend
from frontend_dsl.errors import ProgramDefinitionError

_default_backend: Backend | None = None


def set_default_backend(backend: Any) -> None:
    """Use ``backend`` for every program run without an explicit ``backend=``.

    Accepts a ``Backend`` or a ``runtime.Engine`` (wrapped in ``EngineBackend``).
    """
    global _default_backend
    _default_backend = as_backend(backend)


def get_default_backend() -> Backend:
    """The backend set by ``set_default_backend``; raises if none was set."""
    if _default_backend is None:
        raise ProgramDefinitionError("no backend: call set_default_backend(...) or pass backend=")
    return _default_backend


def resolve_backend(backend: Any) -> Backend:
    """The backend of a run given ``backend=`` (``None``: the default)."""
    return get_default_backend() if backend is None else as_backend(backend)


def as_backend(backend: Any) -> Backend:
    """``backend`` itself if it is a ``Backend``, else the ``EngineBackend`` around it."""
    if isinstance(backend, Backend):
        return backend
    # NOTE: deferred so that `import frontend_dsl` does not load the engine (torch) for
    # programs that never use one; whoever passes an engine has loaded `runtime` already.
    from frontend_dsl.engine_backend import backend_for

    return backend_for(backend)
