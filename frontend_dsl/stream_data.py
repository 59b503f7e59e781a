"""The executed contents of one state: text, token ids, variables, messages.

Owned by the executor and mutated only on the DSL loop thread, one node at a time per
stream (a stream's nodes form a chain). Invariant: ``codec.decode(ids) == text``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from frontend_dsl.tokens import Codec, align_generated, plan_append


@dataclass
class StreamData:
    """Text and ids of one state plus what its nodes produced."""

    text: str = ""
    ids: list[int] = field(default_factory=list)
    variables: dict[str, Any] = field(default_factory=dict)
    meta: dict[str, dict[str, Any]] = field(default_factory=dict)  # per variable
    messages: list[dict[str, str]] = field(default_factory=list)
    open_role: tuple[str, int] | None = None  # (role, text offset where content starts)
    own_variables: list[str] = field(default_factory=list)  # set since the fork that made it
    fork_text_len: int = 0  # len(text) when this branch was forked off
    capture_starts: dict[str, int] = field(default_factory=dict)  # open var_scopes: text offset
    ends_with_text: bool = False  # the last append was constant text (token healing applies)

    def append_text(self, text: str, codec: Codec) -> None:
        """Append constant text by the boundary rule of ``tokens.py``."""
        keep_len, new_ids = plan_append(self.ids, text, codec)
        self.ids[keep_len:] = new_ids
        self.text += text
        self.ends_with_text = bool(text) or self.ends_with_text

    def append_generated(self, text: str, token_ids: list[int], codec: Codec) -> None:
        """Append a generation, keeping the model's own ids."""
        self.ids.extend(align_generated(text, token_ids, codec))
        self.text += text
        self.ends_with_text = False

    def replace_last_token(self, text: str, token_ids: list[int], codec: Codec) -> None:
        """Append a token-healed generation: ``text`` starts with the text of the state's
        last token, which the generation's ids replace."""
        healed_len = len(codec.decode(self.ids[-1:]))
        self.ids[-1:] = align_generated(text, token_ids, codec)
        self.text = self.text[: len(self.text) - healed_len] + text
        self.ends_with_text = False

    def set_variable(self, name: str | None, value: Any, meta: dict[str, Any]) -> None:
        if name is None:
            return
        self.variables[name] = value
        self.meta[name] = meta
        self.own_variables.append(name)

    def begin_message(self, role: str) -> None:
        self.open_role = (role, len(self.text))

    def end_message(self) -> None:
        assert self.open_role is not None, "end_message without begin_message"
        role, start = self.open_role
        self.messages.append({"role": role, "content": self.text[start:]})
        self.open_role = None

    def branch(self) -> StreamData:
        """A copy for a fork branch: same text and ids, fresh record of own variables."""
        child = StreamData(self.text, list(self.ids), dict(self.variables),
                           copy.deepcopy(self.meta), [dict(m) for m in self.messages],
                           self.open_role)
        child.fork_text_len = len(self.text)
        child.capture_starts = dict(self.capture_starts)
        child.ends_with_text = self.ends_with_text
        return child
