"""The byte string of every ordinary token of a HF tokenizer (for outlines-core).

Handles the two common vocabularies: byte-level BPE (GPT-2 style, tokens spelled in
the printable-byte alphabet) and SentencePiece/Metaspace (``▁`` for a space and
``<0xHH>`` byte tokens).
"""

from __future__ import annotations

from functools import cache
from typing import Any


@cache
def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's printable stand-in character for each byte, inverted: char → byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = dict(zip(printable, printable, strict=True))
    extra = 0
    for byte in range(256):
        if byte not in chars:
            chars[byte] = 256 + extra
            extra += 1
    return {chr(code): byte for byte, code in chars.items()}


def _is_byte_level(hf_tokenizer: Any) -> bool:
    decoder = getattr(hf_tokenizer, "backend_tokenizer", None)
    return decoder is not None and "ByteLevel" in repr(decoder.decoder)


def _token_bytes(token: str, byte_level: bool) -> bytes:
    if byte_level:
        alphabet = _byte_level_alphabet()
        return bytes(alphabet[c] for c in token)
    if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
        return bytes([int(token[3:5], 16)])
    return token.replace("\u2581", " ").encode("utf-8")


def ordinary_token_bytes(hf_tokenizer: Any) -> dict[bytes, list[int]]:
    """Map token bytes → token ids, leaving out special and added tokens."""
    special = set(hf_tokenizer.all_special_ids) | set(hf_tokenizer.added_tokens_decoder)
    byte_level = _is_byte_level(hf_tokenizer)
    table: dict[bytes, list[int]] = {}
    for token, token_id in hf_tokenizer.get_vocab().items():
        if token_id not in special:
            table.setdefault(_token_bytes(token, byte_level), []).append(token_id)
    return table
