r"""How a state's token ids grow when text is appended.

The boundary rule (one rule for constant text, role markers and selected choices):

    state ids:  [ t0 t1 ... t(n-2) | t(n-1) ]      new text: "xyz"
                 \_____ kept _____/  \_ last _/
    new ids  =  encode(decode([t(n-1)]) + "xyz")

If the re-encoding still starts with ``t(n-1)`` the state keeps all ``n`` ids and appends
the rest; otherwise the last id merged with the new text and is replaced. So at most ONE
existing token is ever re-tokenized, the rest of the state's ids never change, and forks
keep sharing their parent's ids exactly (all but at most the last one) — which is what the
engine's radix cache matches on. Only the new text is tokenized, never the whole state.
A last token that does not round-trip through decode/encode on its own (a partial UTF-8
byte) is never merged.

Generated text keeps the ids the model produced (see ``align_generated``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class Codec(Protocol):
    """The tokenizer half of a ``Backend``."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: Sequence[int]) -> str: ...


def plan_append(ids: Sequence[int], text: str, codec: Codec) -> tuple[int, list[int]]:
    """Where appending ``text`` leaves the ids.

    Returns:
        ``(keep_len, new_ids)``: the state's ids become ``ids[:keep_len] + new_ids``;
        ``keep_len`` is ``len(ids)`` or ``len(ids) - 1``.
    """
    if not ids:
        return 0, codec.encode(text)
    last = ids[-1]
    last_text = codec.decode([last])
    if codec.encode(last_text) != [last]:
        return len(ids), codec.encode(text)
    merged = codec.encode(last_text + text)
    if merged[:1] == [last]:
        return len(ids), merged[1:]
    return len(ids) - 1, merged


def align_generated(text: str, token_ids: Sequence[int], codec: Codec) -> list[int]:
    """Ids for generated ``text`` that decode to exactly ``text``.

    Normally the model's own ids. When they decode to more than ``text`` (a stop string
    was cut from the text but its tokens were generated) the longest prefix of the ids
    that decodes to a prefix of ``text`` is kept and the remainder of the text encoded.
    """
    ids = list(token_ids)
    if codec.decode(ids) == text:
        return ids
    while ids and not text.startswith(codec.decode(ids)):
        ids.pop()
    rest = text[len(codec.decode(ids)):]
    return ids + (codec.encode(rest) if rest else [])
