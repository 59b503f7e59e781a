"""OpenAI's chat and completions API: ``/v1/chat/completions`` (``chat.py``),
``/v1/completions`` (``completions.py``), what both share (``endpoint.py``), ``/v1/models``."""
