"""Arbor's runtime: the engine that runs request graphs on a Llama-family model.

``Engine`` is imported on first use: the torch-free core (``runtime.cache``,
``runtime.scheduler``, ``runtime.request``, the settings and the request/response types)
loads without torch, the engine and the model with it.
"""

from typing import TYPE_CHECKING

from runtime.config import EngineConfig
from runtime.errors import (
    ArborError,
    EngineClosedError,
    InvalidRequestError,
    ModelLoadError,
    PromptTooLongError,
)
from runtime.output.request_output import ConstraintCheck, RequestOutput
from runtime.sampling.params import SamplingParams

if TYPE_CHECKING:
    from runtime.engine import Engine

__all__ = [
    "ArborError",
    "ConstraintCheck",
    "Engine",
    "EngineClosedError",
    "EngineConfig",
    "InvalidRequestError",
    "ModelLoadError",
    "PromptTooLongError",
    "RequestOutput",
    "SamplingParams",
]


def __getattr__(name: str) -> object:
    if name == "Engine":  # NOTE: lazily, so the torch-free core imports without torch
        from runtime.engine import Engine

        return Engine
    raise AttributeError(f"module 'runtime' has no attribute {name!r}")
