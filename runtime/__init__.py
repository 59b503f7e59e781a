"""Arbor's runtime: the engine that runs request graphs on a Llama-family model."""

from runtime.config import EngineConfig
from runtime.engine import Engine
from runtime.errors import (
    ArborError,
    EngineClosedError,
    InvalidRequestError,
    ModelLoadError,
    PromptTooLongError,
)
from runtime.outputs import RequestOutput
from runtime.sampling_params import SamplingParams

__all__ = [
    "ArborError",
    "Engine",
    "EngineClosedError",
    "EngineConfig",
    "InvalidRequestError",
    "ModelLoadError",
    "PromptTooLongError",
    "RequestOutput",
    "SamplingParams",
]
