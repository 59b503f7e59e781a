"""The OpenAI request fields (chat and completions) this server knows but does not use,
each with why. Every other field is either declared in ``schema.py`` (honoured, or
refused there) or unknown (a 400 naming it, ``common/fields.check_fields``).
"""

from __future__ import annotations

from typing import Any

from runtime.server.api.common.fields import IgnoredFields, RefusedFields, is_empty, is_false


def _text_only(value: Any) -> bool:
    return value == ["text"]


IGNORED: IgnoredFields = {
    "store": "nothing is stored for later retrieval; the answer is the same",
    "metadata": "tags for OpenAI's stored completions; nothing is stored",
    "service_tier": "this server has one tier",
    "prompt_cache_key": "the prefix cache is automatic (radix tree), no key is needed",
    "safety_identifier": "no abuse monitoring on this server; the tenant is `user` or X-Tenant",
    "prediction": "a speed hint (predicted output); the answer is the same without it",
    "stream_options.include_obfuscation": "no obfuscation padding is sent",
    "guided_decoding_backend": "the server's --grammar-backend picks the backend; the output "
                               "obeys the constraint either way",
    "messages.*.refusal": "an earlier answer's refusal text; the prompt shows its content",
    "messages.*.annotations": "an earlier answer's citations; not part of the prompt",
    "spaces_between_special_tokens": "fast tokenizers never insert spaces between special tokens",
}

REFUSED: RefusedFields = {
    "audio": ("no audio output", is_empty),
    "modalities": ("text is the only output modality", _text_only),
    "functions": ("the deprecated functions field; use tools", is_empty),
    "function_call": ("the deprecated function_call field; use tool_choice", is_empty),
    "reasoning_effort": ("this model has no reasoning mode", is_empty),
    "verbosity": ("no verbosity control", is_empty),
    "web_search_options": ("no web search", is_empty),
    "guided_whitespace_pattern": ("JSON whitespace follows the server's layout", is_empty),
    "use_beam_search": ("no beam search", is_false),
    "include_stop_str_in_output": ("stop strings are always cut from the output", is_false),
    "echo": ("echo is a completions field", is_false),
}
