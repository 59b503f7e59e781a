r"""Token healing for ``gen(token_healing=True)``.

A prompt that ends mid-word or on a space ends with a token the model would rarely have
produced there ("http:" is tokenized ``http`` ``:``, but the model writes ``://`` as one
token). Healing backs up one token and lets the model generate it again, constrained to
re-produce that token's text as a prefix:

    state ids:  [ ... t(n-2) | t(n-1) ]       t(n-1) decodes to ":"
    request:    [ ... t(n-2) ]  with regex  ":" + (the gen's regex, or anything)

The generation's ids then replace ``t(n-1)``; the variable holds the text after ":".
Only a state that ends with appended text is healed (generated ids are the model's own),
and only a last token that round-trips through decode/encode, is no EOS, and holds no
stop string.
"""

from __future__ import annotations

import dataclasses
import re

from frontend_dsl.backend import Backend, GenParams
from frontend_dsl.output_constraint import OutputConstraint
from frontend_dsl.primitives import Gen
from frontend_dsl.stream_data import StreamData


def healing_plan(data: StreamData, spec: Gen, backend: Backend) -> tuple[list[int], GenParams, int] | None:
    """``(prompt ids, params, healed text length)`` for a healed generation, or None
    when the state's last token is not healed."""
    if not data.ends_with_text or not data.ids:
        return None
    last = data.ids[-1]
    last_text = backend.decode([last])
    if (not last_text or last in backend.eos_token_ids or backend.encode(last_text) != [last]
            or any(stop in last_text for stop in spec.params.stop)):
        return None
    constraint = spec.params.constraint
    rest = r"[\s\S]*" if constraint is None else f"(?:{constraint.value})"
    healed = OutputConstraint("regex", re.escape(last_text) + rest)
    params = dataclasses.replace(spec.params, constraint=healed, max_tokens=spec.params.max_tokens + 1)
    return data.ids[:-1], params, len(last_text)
