"""Arbor's tokenizer and session endpoints' wire shapes (``routes.py``)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from runtime.server.api.common.wire import Strict


class TokenizeRequest(Strict):
    text: str
    add_special_tokens: bool = False


class TokenizeResponse(BaseModel):
    input_ids: list[int]


class DetokenizeRequest(Strict):
    token_ids: list[int]
    skip_special_tokens: bool = False


class DetokenizeResponse(BaseModel):
    text: str


class ChatTemplateRequest(Strict):
    messages: list[dict[str, Any]]
    add_generation_prompt: bool = True


class ChatTemplateResponse(BaseModel):
    text: str


class TokenizerInfo(BaseModel):
    model: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: list[int]
    bos_token_id: int | None
    chat_template: str | None


class EndSessionResponse(Strict):
    """``DELETE /sessions/{id}``: the session ended; its pins are released."""

    session_id: str
    pages_released: int  # KV pages it had pinned (now evictable like any other)
