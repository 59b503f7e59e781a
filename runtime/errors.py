"""Typed errors raised by the runtime. Every bad input maps to one of these."""

from __future__ import annotations


class ArborError(Exception):
    """Base class of every error Arbor raises on purpose."""


class InvalidRequestError(ArborError, ValueError):
    """A request that can never be served as given (bad parameters, empty prompt...)."""


class PromptTooLongError(InvalidRequestError):
    """Prompt plus requested tokens exceed ``max_model_len``."""


class ModelLoadError(ArborError):
    """A model path that does not exist, or files that cannot be read as a model."""


class EngineClosedError(ArborError, RuntimeError):
    """The engine was shut down; no further requests are accepted."""


class EngineFailedError(EngineClosedError):
    """The engine can no longer step (a tensor-parallel rank died): requests in flight
    failed with this reason and new ones are refused with it."""


def check_unicode(text: str, what: str) -> None:
    """Raise ``InvalidRequestError`` unless ``text`` is valid Unicode: a lone UTF-16
    surrogate (``"\\udcff"``, which ``json.loads`` lets through) cannot be tokenized."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequestError(
            f"{what} holds a lone UTF-16 surrogate at index {exc.start}, which is not valid "
            "Unicode text") from None
