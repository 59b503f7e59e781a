"""Encode/decode/chat-template over a Hugging Face tokenizer, shared by the backends."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class HFCodec:
    """The tokenizer half of a ``Backend`` for a transformers tokenizer.

    ``encode`` adds no BOS/EOS and maps special-token text (``<|im_start|>``) to its id;
    ``decode`` keeps special tokens and does no clean-up, so ``decode(encode(t)) == t``.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, token_ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(token_ids), skip_special_tokens=False,
                                         clean_up_tokenization_spaces=False))

    def render_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        return str(self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt))
